"""The typed config: recipes, overrides, clear errors naming the key, resolved config round trip."""

from __future__ import annotations

import re

import pytest

from threepo.deploy.config import ConfigError, RunConfig, load_config, to_toml
from threepo.services.tasks.prompting import NUMBER_INSTRUCTION


def test_defaults_and_overrides():
    cfg = load_config(None, ["sampler.temperature=0.7", "algo.exploration=m3po", "runtime.mode=sync"])
    assert isinstance(cfg, RunConfig) and cfg.sampler.temperature == 0.7
    assert cfg.algo.exploration == "m3po" and cfg.runtime.mode == "sync"
    assert load_config(None, ["optim.lr=3"]).optim.lr == 3.0  # an int where a float is expected


@pytest.mark.parametrize("override,message", [
    ("sampler.tempreature=1", "unknown config key 'sampler.tempreature'"),
    ("nosuch.key=1", "unknown config key 'nosuch'"),
    ("sampler.temperature=hot", "sampler.temperature: expected float"),
    ("sampler.temperature=-1", "sampler.temperature: expected > 0"),
    ("algo.exploration=ppo", "algo.exploration: expected one of"),
    ("runtime.steps=1.5", "runtime.steps: expected int"),
    ("algo.group_size=10", "algo.group_size=10: expected a multiple of algo.n_slots=4"),
    ("sampler", "expected section.field=value"),
    ("noise.modules=embeddings", "noise.modules: expected one of"),
    ("noise.layers=[1]", "noise.layers: expected [first, last]"),
    ("noise.layers=[0.5, 1]", "noise.layers[0]: expected int"),
    ("noise.target_kl=-0.1", "noise.target_kl: expected > 0 nats per token, or \"off\""),
    ("noise.target_kl=0", "noise.target_kl: expected > 0 nats per token, or \"off\""),
    ("noise.gate=0", "noise.gate: expected > 1"),
    ("noise.gate=1", "noise.gate: expected > 1"),
    ("noise.rank=0", "noise.rank: expected an integer >= 1, or \"full\""),
    ("noise.probe_rows=0", "noise.probe_rows: expected an integer >= 1"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, [override])


@pytest.mark.parametrize("overrides,message", [
    (["algo.exploration=c3po", "optim.name=adamw"], "set optim.name=ivon"),
    (["algo.vp2o=true"], "set model.kind=moe"),
    (["algo.exploration=b3po"], "b3po uses one slot; set algo.n_slots=1"),
    (["algo.equal_compute=false"], "algo.equal_compute=false: M3PO's unconstrained mode"),
    (["algo.dead_group_scale=2"], "re-admitted only with algo.readmit_fraction > 0"),
    (["algo.exploration=none", "algo.n_slots=1", "optim.name=adamw", "algo.readmit_fraction=0.25",
      "algo.dead_group_scale=2"], "exploration none serves the mean"),
    (["algo.filter_replacements=0.5"], "only used with algo.dynamic_filter=true"),
    (["algo.readmit_fraction=0.25", "algo.solved_group_scale=0"], "solved_group_scale: expected > 0"),
    (["sampler.device=cuda"], "sampler.device=cuda needs runtime.sampler_gpus >= 1"),
    (["sampler.backend=vllm", "sampler.device=cuda", "runtime.sampler_gpus=1"], "applies to the hf engine only"),
    (["sampler.backend=sglang"], "runs on CUDA only"),
    (["sampler.backend=vllm", "runtime.sampler_gpus=1", "sampler.tensor_parallel_size=2"], "does not cover"),
    (["sampler.tensor_parallel_size=2"], "the hf engine runs on one device"),
    (["sampler.batch_invariant=true"], "needs sampler.backend=vllm with runtime.sampler_gpus > 0"),
    (["runtime.eval_gpus=0.1"], "only with eval.device=cuda"),
    (["eval.device=cuda", "runtime.eval_gpus=0"], "needs one then"),
])
def test_contradictory_combinations_are_rejected_at_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_resolved_config_is_a_valid_recipe(tmp_path):
    cfg = load_config(None, ["algo.advantage=lampo", "data.path=x.jsonl", "seed=7"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_config(str(path)) == cfg


def test_shipped_recipes_load():
    import os

    from threepo.deploy.config import CONFIG_DIR

    names = [f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".toml")]
    assert "default" in names
    for name in names:
        load_config(name)
    with pytest.raises(ConfigError, match="not a shipped recipe"):
        load_config("no-such-recipe")


def test_optimizer_settings_default_to_the_chosen_optimizers_own():
    ivon, adamw = load_config(None, []).optim, load_config("grpo_baseline", ["optim.lr=auto"]).optim
    assert (ivon.lr, ivon.beta2, ivon.weight_decay) == (10.0, 0.9999, 1e-6)
    assert (adamw.lr, adamw.beta2, adamw.weight_decay) == (1e-4, 0.999, 0.0)
    mine = load_config(None, ["algo.exploration=none", "algo.n_slots=1", "optim.name=adamw", "optim.lr=3e-5"]).optim
    assert (mine.lr, mine.beta2) == (3e-5, 0.999)  # an explicit value wins, the rest stay AdamW's
    with pytest.raises(ConfigError, match="optim.lr: expected float or 'auto', got 'fast'"):
        load_config(None, ["optim.lr=fast"])


def test_eval_k_follows_samples_per_item_unless_set():
    assert load_config(None, []).eval.k == 4
    assert load_config(None, ["eval.samples_per_item=2"]).eval.k == 2
    assert load_config(None, ["eval.samples_per_item=16", "eval.k=16"]).eval.k == 16


def test_gsm8k_files_score_the_last_number_unless_told_otherwise(tmp_path):
    gsm8k = load_config(None, ["data.path=x.jsonl", "data.format=gsm8k"])
    assert gsm8k.verifier.options == (("math", "answer", "last_number"),)
    assert gsm8k.prompt.instruction == NUMBER_INSTRUCTION  # not the boxed instruction it does not score by
    boxed = load_config(None, ["data.path=x.jsonl", "data.format=gsm8k", 'verifier.options=[["math", "answer", "boxed"]]'])
    assert boxed.verifier.options == (("math", "answer", "boxed"),) and boxed.prompt.instruction == "auto"
    assert load_config(None, ["data.path=x.jsonl"]).verifier.options == ()  # prompt_answer keeps the boxed rule
    path = tmp_path / "config.toml"
    path.write_text(to_toml(gsm8k))
    assert load_config(str(path)) == gsm8k


def test_every_role_seed_follows_the_run_seed_unless_set():
    roles = ("task", "sampler", "algo", "vp2o", "verifier")
    default = load_config(None, [])
    assert {getattr(default, r).seed for r in roles} == {default.seed} == {0}
    cfg = load_config(None, ["seed=7", "sampler.seed=3"])
    assert cfg.seed == 7 and cfg.sampler.seed == 3
    assert {getattr(cfg, r).seed for r in roles if r != "sampler"} == {7}
    assert cfg.bootstrap.seed == 0  # one warm start for every run seed
    assert load_config(None, ["sampler.seed=3"]).algo.seed == 0  # no run seed given: the defaults


def test_a_run_seed_keeps_the_embedded_default_warm_start(tmp_path):
    from threepo.services.bootstrap import checkpoint_dir

    paths = {checkpoint_dir(c.model, c.task, c.bootstrap) for c in (load_config(None, [f"seed={s}"]) for s in (0, 5))}
    assert len(paths) == 1
    assert checkpoint_dir(*(lambda c: (c.model, c.task, c.bootstrap))(load_config(None, ["bootstrap.seed=5"]))) not in paths


@pytest.mark.parametrize("override,word", [
    ("runtime.checkpoint_every=0", '"end"'), ("runtime.eval_every=0", '"off"'), ("runtime.num_samplers=0", '"elastic"'),
    ("sampler.max_new_tokens=0", "auto"), ("sync.drift_rows=0", '"all"'), ("learner.activation_mb=0", '"off"'),
])
def test_a_zero_that_used_to_mean_something_else_names_the_word_for_it(override, word):
    with pytest.raises(ConfigError, match=re.escape(word)):
        load_config(None, [override])


def test_the_words_resolve_to_what_they_say():
    cfg = load_config(None, ["runtime.checkpoint_every=end", "runtime.eval_every=off", "runtime.num_samplers=elastic",
                             "sync.drift_rows=all", "learner.activation_mb=off"])
    assert cfg.runtime.elastic and cfg.runtime.fixed_samplers == 0 and not load_config(None, []).runtime.elastic
    assert cfg.sampler.max_new_tokens == 16  # auto: the embedded task tier's limit
    assert cfg.runtime.eval_gpus == 0.0 and load_config(None, ["eval.device=cuda"]).runtime.eval_gpus == 1.0


def test_the_renamed_exploration_names_its_new_value():
    with pytest.raises(ConfigError, match=re.escape('algo.exploration=grpo: renamed "none"')):
        load_config(None, ["algo.exploration=grpo"])
    assert load_config(None, ["algo.exploration=none", "algo.n_slots=1"]).algo.exploration == "none"
