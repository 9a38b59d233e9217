"""A learner of 2 data-parallel ranks (Ray actors, gloo on CPU) against one learner: one step of IVON
(C3PO, B3PO; M3PO's K = 2 samples in tests/algorithms/test_ivon_shard.py) and of AdamW gives the same parameters to fp32 tolerance; IVON's optimizer state
is halved per rank; the ranks' checkpoint shards load into one learner and back into 2 ranks; a
2-rank `threepo train` run matches a 1-rank one step for step with exact records; a rank killed
mid-run is restored with its group from the latest checkpoint. One Ray cluster per session."""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch

from threepo.algorithms.exploration import make_plan
from threepo.algorithms.param_noise import perturbed_state
from threepo.deploy.commands import make_run_dir
from threepo.deploy.config import load_config
from threepo.deploy.learner_group import start_learner_group
from threepo.deploy.run import train
from threepo.services.learner.checkpoint import load_learner
from threepo.services.learner.core import Learner
from threepo.services.learner.optim_config import OptimConfig
from threepo.services.model.modeling import load_model, load_tokenizer, trainable_named_parameters
from threepo.services.tasks.synthetic import generate_items
from threepo.services.wire.batching import batches_from_groups
from threepo.services.wire.messages import Completion, Group, ScoredCompletion, VerifyResult, VerifyStatus

pytestmark = pytest.mark.ray

KINDS = {  # exploration, n_slots, optimizer
    "c3po": ("c3po", 4, OptimConfig()),
    "b3po": ("b3po", 1, OptimConfig()),
    "grpo_adamw": ("none", 1, OptimConfig(name="adamw", lr=3e-3)),
}


def _sampled_groups(path: str, pv, exploration: str, n_slots: int, n_prompts: int = 3, group_size: int = 8):
    """Completions of `n_prompts` prompts sampled slot by slot at the published version (T = 1, at
    most 8 tokens), with random rewards: whole groups of `group_size` in record form."""
    model, tokenizer = load_model(path).eval(), load_tokenizer(path)
    mean = {n: torch.from_numpy(a) for n, a in pv.mean.items()}
    sigma = {n: torch.from_numpy(a) for n, a in pv.sigma.items()} if pv.sigma else {}
    plan = make_plan(exploration, version=0, base_seed=0, group_size=group_size, n_slots=n_slots)
    gen, groups = torch.Generator().manual_seed(0), []
    for item in generate_items("arith", "train", n_prompts, seed=1):
        prompt = tuple(tokenizer(item.prompt, add_special_tokens=False)["input_ids"])
        by_group: dict[int, list] = {}
        for slot in plan.slots:
            with torch.no_grad():
                for name, p in trainable_named_parameters(model):
                    p.copy_(perturbed_state(mean, sigma, slot.seed)[name] if sigma else mean[name])
                ids = torch.tensor([prompt] * plan.rollouts_per_slot)
                for _ in range(8):
                    probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
                    ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
                logp = torch.log_softmax(model(input_ids=ids).logits[:, len(prompt) - 1:-1].float(), dim=-1)
            for j, row in enumerate(ids[:, len(prompt):].tolist()):
                lp = tuple(float(logp[j, t, x]) for t, x in enumerate(row))
                c = Completion(completion_id=f"{item.uid}/{slot.index}/{j}", request_id=f"{item.uid}/s{slot.index}",
                               group_id=item.uid, slot=slot.index, prompt_uid=item.uid, engine_id=0, seq_no=0,
                               policy_version=0, slot_seed=slot.seed, mean_checksum=pv.mean_checksum,
                               weights_verified=True, prompt_ids=prompt, token_ids=tuple(row), logprobs=lp,
                               finish_reason="length", text=tokenizer.decode(row))
                reward = float(torch.rand((), generator=gen) < 0.5)
                result = VerifyResult(VerifyStatus.OK if reward else VerifyStatus.WRONG, reward)
                by_group.setdefault(plan.group_of(slot.index), []).append(ScoredCompletion(c, result))
        groups += [Group(f"{item.uid}/g{g}", item, 0, 0, tuple(v)) for g, v in by_group.items()]
    return groups


def _configs(path, tmp_path, kind, ranks):
    exploration, n_slots, optim = KINDS[kind]
    name = "adamw" if optim.name == "adamw" else "ivon"
    overrides = [f"model.path={path}", f"runs_dir={tmp_path}", f"learner.ranks={ranks}", "runtime.learner_cpus=0.5",
                 f"algo.exploration={exploration}", f"algo.n_slots={n_slots}", "algo.group_size=8",
                 f"optim.name={name}", "sync.max_staleness=2"] + (["optim.lr=3e-3"] if name == "adamw" else [])
    return load_config(None, overrides)


def _one_learner(path, cfg):
    return Learner(path, cfg.algo, cfg.optim, cfg.sync, temperature=1.0, max_new_tokens=8)


def _group(cfg, path, **kwargs):
    _group.made = getattr(_group, "made", 0) + 1
    return start_learner_group(cfg, f"test-{os.getpid()}-{_group.made}", {}, (path, cfg.algo, cfg.optim, cfg.sync),
                               dict(temperature=1.0, max_new_tokens=8, **kwargs))


def _np(x):
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def _close(a: dict, b: dict, atol: float) -> float:
    assert list(a) == list(b)
    worst = max(float(np.abs(_np(a[n]) - _np(b[n])).max()) for n in a)
    assert worst <= atol, worst
    return worst


def _adam_close(got: dict, want: dict, one: Learner) -> None:
    """Adam's first step is lr·g/(|g| + ε): where the gradient is at rounding level (here ~1e-8 of a
    max of ~0.07; 0.015% of the weights) summation order alone flips its sign. Elsewhere the two
    learners' weights agree to 1e-7 (lr 3e-3)."""
    grads = {n: one.optimizer.torch.state[p]["exp_avg"].numpy() / (1 - one.optim_cfg.beta1) for n, p in one.named}
    top = max(float(np.abs(g).max()) for g in grads.values())
    kept = {n: np.abs(g) > 1e-4 * top for n, g in grads.items()}
    assert sum(int(k.sum()) for k in kept.values()) > 0.9 * sum(k.size for k in kept.values())
    _close({n: got[n][kept[n]] for n in got}, {n: want[n][kept[n]] for n in want}, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_step_of_two_ranks_gives_one_learners_parameters(ray_session, tmp_path, tiny_dense_path, kind):
    cfg = _configs(tiny_dense_path, tmp_path, kind, ranks=2)
    one = _one_learner(tiny_dense_path, cfg)
    start = one.published()
    groups = _sampled_groups(tiny_dense_path, start, *KINDS[kind][:2])
    arrays = batches_from_groups(groups)
    group = _group(cfg, tiny_dense_path)
    try:
        assert ray.get(group.published.remote("start")).mean_checksum == start.mean_checksum
        result, _ = ray.get(group.step.remote(arrays[0], len(arrays[1]), *arrays[1], *arrays[2]))
        expected = one.step(*arrays)
        after, want = ray.get(group.published.remote()), one.published()
        moved = max(float(abs(want.mean[n] - start.mean[n]).max()) for n in want.mean)
        assert moved > 1e-6  # the step moved the weights, and both learners moved them alike:
        if cfg.optim.name == "adamw":
            _adam_close(after.mean, want.mean, one)
        else:  # measured: 99.7% of the weights bit-identical, the rest within 0.05% of the step
            _close(after.mean, want.mean, atol=2e-3 * moved)
            _close(after.sigma, want.sigma, atol=1e-6 * float(max(abs(s).max() for s in want.sigma.values())))
        for key in ("loss", "kl_k3_drift", "ess_frac_drift", "reward_mean", "clip_frac"):
            assert result.metrics[key] == pytest.approx(expected.metrics[key], rel=1e-4, abs=1e-6), key
        assert (result.publish, result.publish_reason) == (expected.publish, expected.publish_reason)
        if kind == "c3po":
            _state_is_sharded_and_loads_into_one_learner(group, one, cfg, tiny_dense_path, tmp_path)
    finally:
        group.kill()


def _state_is_sharded_and_loads_into_one_learner(group, one, cfg, path, tmp_path):
    """IVON's m, h and g_m: about half per rank; the two shards load into one learner (the same state
    as the learner that took the same step) and into two new ranks (the same published version)."""
    per_rank = ray.get(group.state_bytes())
    whole = one.optimizer.state_bytes()
    assert sum(per_rank) == whole and max(per_rank) <= 0.6 * whole, (per_rank, whole)
    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    assert ray.get(group.save_checkpoint.remote(directory)) == "learner"
    assert sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")) == \
        ["learner-rank0.safetensors", "learner-rank1.safetensors"]
    loaded = _one_learner(path, cfg)
    load_learner(loaded, directory)
    for kind, want in (("mean", one.optimizer.ivon.mean_by_name()), ("hess", one.optimizer.ivon.hess_by_name())):
        got = {n: loaded.optimizer.ivon.state[n][kind] for n in want}
        _close(got, want, atol=1e-6 * max(1.0, max(float(t.abs().max()) for t in want.values())))
    assert loaded.step_count == one.step_count == 1
    again = _group(cfg, path, checkpoint=directory)
    try:
        _close(ray.get(again.published.remote()).mean, ray.get(group.published.remote()).mean, atol=0.0)
    finally:
        again.kill()


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_steps_like_one_adamw_and_resumes_its_shards(ray_session, tmp_path, tiny_dense_path, stage):
    cfg = _configs(tiny_dense_path, tmp_path, "grpo_adamw", ranks=2)
    one = _one_learner(tiny_dense_path, cfg)
    arrays = batches_from_groups(_sampled_groups(tiny_dense_path, one.published(), "none", 1))
    group = _group(cfg, tiny_dense_path, deepspeed_stage=stage)
    try:
        ray.get(group.step.remote(arrays[0], len(arrays[1]), *arrays[1], *arrays[2]))
        one.step(*arrays)
        after = ray.get(group.published.remote())
        _adam_close(after.mean, one.published().mean, one)
        # each rank holds half of the fp32 master weights and moments (12 B / 2 per parameter) where
        # one AdamW learner holds its moments whole (8 B per parameter)
        per_rank, whole = ray.get(group.state_bytes()), one.optimizer.state_bytes()
        assert max(per_rank) < 0.8 * whole and abs(per_rank[0] - per_rank[1]) < 0.01 * whole, (per_rank, whole)
        final = ray.get(group.save_hf.remote(str(tmp_path / "final")))
        exported = dict(trainable_named_parameters(load_model(final)))
        _close({n: exported[n] for n in after.mean}, after.mean, atol=0.0)  # the mean, whole (ZeRO-3: gathered)
        directory = str(tmp_path / "ckpt")
        os.makedirs(directory)
        ray.get(group.save_checkpoint.remote(directory))
        again = _group(cfg, tiny_dense_path, deepspeed_stage=stage, checkpoint=directory)
        try:
            _close(ray.get(again.published.remote()).mean, after.mean, atol=0.0)
        finally:
            again.kill()
    finally:
        group.kill()
    plain = _one_learner(tiny_dense_path, cfg)  # the weights export: one learner without DeepSpeed loads it
    load_learner(plain, directory)
    _close(plain.published().mean, after.mean, atol=0.0)


SMALL = ["runtime.sampler_cpus=0.5", "runtime.learner_cpus=0.25", "runtime.verifier_cpus=0.25",
         "runtime.prompts_per_step=2", "runtime.eval_every=off", "algo.group_size=8", "sampler.max_new_tokens=12"]


def _train_cfg(tmp_path, path, *overrides):
    return load_config(None, [f"model.path={path}", f"runs_dir={tmp_path}", *SMALL, *overrides])


def test_two_rank_training_is_the_one_learner_run_with_exact_records(ray_session, tmp_path, tiny_dense_path):
    from test_train_ray import _exact

    det = ["runtime.mode=sync", "runtime.steps=3", "runtime.checkpoint_every=2"]
    runs = {}
    for ranks in (1, 2):
        cfg = _train_cfg(tmp_path / f"r{ranks}", tiny_dense_path, *det, f"learner.ranks={ranks}")
        run_dir = make_run_dir(cfg, "train")
        summary = train(cfg, run_dir, tiny_dense_path)
        runs[ranks] = _exact(run_dir, summary, 3, 2 * 8)
        assert os.path.isfile(os.path.join(summary["final_checkpoint"], "model.safetensors"))
    shards = os.path.join(run_dir, "checkpoints", "step-00000002")
    assert {"learner-rank0.safetensors", "learner-rank1.safetensors", "learner.json"} <= set(os.listdir(shards))
    for a, b in zip(runs[1], runs[2]):  # the same run: the same rollouts, losses and publishes
        assert a["version"] == b["version"] and a["sync_reason"] == b["sync_reason"]
        for key in ("reward_mean", "loss", "kl_k3", "completion_tokens", "sigma_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    final = load_model(os.path.join(run_dir, "final"))
    start = load_model(tiny_dense_path)
    moved = max(float((p - q).abs().max()) for p, q in zip(final.state_dict().values(), start.state_dict().values()))
    assert moved > 0  # the group's mean went into final/


def test_a_killed_rank_is_restored_with_its_group_from_the_latest_checkpoint(ray_session, tmp_path, tiny_dense_path):
    from test_train_ray import _killed_and_restored

    cfg = _train_cfg(tmp_path, tiny_dense_path, "runtime.steps=6", "runtime.checkpoint_every=2", "learner.ranks=2")
    _killed_and_restored(cfg, tiny_dense_path, "learner-rank1")
