"""LoRA adapters (services/model/lora.py) and the learner training them (optimizers.LoRAAdamW): the merged
weights are the adapted model, a step moves the adapters alone, a version publishes the merged model
under the model's own names, the export is an HF checkpoint plus a PEFT adapter directory peft loads,
and a checkpoint resumes only with the adapters it was written with."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from lora_learners import ivon_lora_learner  # tests/ is on sys.path
from lora_learners import nudge_adapters as _nudge_adapters
from test_learner import _groups, _step  # the learner tests' rollouts (tests/services is on sys.path)

from threepo.services.learner.config import AlgoConfig
from threepo.services.learner.core import Learner
from threepo.services.learner.optim_config import OptimConfig, SyncConfig
from threepo.services.model.lora import LoRAConfig, attach, merged_weights
from threepo.services.model.modeling import load_model, load_tokenizer, trainable_named_parameters

LORA = LoRAConfig(rank=4, alpha=8.0)


def _lora_learner(path, lora=LORA):
    return Learner(path, AlgoConfig(exploration="none", n_slots=1, group_size=8),
                   OptimConfig(name="adamw", lr=1e-2, weight_decay=0.0), SyncConfig(max_staleness=1),
                   temperature=1.0, max_new_tokens=10, lora=lora)


@pytest.fixture(scope="module")
def sampler(tiny_dense_path):
    return load_model(tiny_dense_path).eval(), load_tokenizer(tiny_dense_path)


def test_merged_weights_are_the_adapted_model_under_the_models_own_names(tiny_dense_path):
    base = load_model(tiny_dense_path).eval()
    names = [n for n, _ in base.named_parameters()]
    model = attach(load_model(tiny_dense_path).eval(), LORA)
    assert all(".lora_" in n for n, _ in trainable_named_parameters(model))  # the base frozen
    assert {n.split(".")[-4] for n, _ in trainable_named_parameters(model)} == set(LORA.target_modules)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)  # B = 0: the base model
    _nudge_adapters(model)
    merged = merged_weights(model)
    assert list(merged) == names
    with torch.no_grad():
        for n, p in base.named_parameters():
            p.copy_(merged[n])
    adapted = model(input_ids=ids).logits
    assert not torch.allclose(adapted, load_model(tiny_dense_path)(input_ids=ids).logits, atol=1e-4)
    torch.testing.assert_close(base(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
    untouched = [n for n in names if not any(f".{t}." in n for t in LORA.target_modules) or n.endswith(".bias")]
    assert untouched and all(torch.equal(merged[n], dict(load_model(tiny_dense_path).named_parameters())[n])
                             for n in untouched)


def test_a_target_that_names_no_module_is_one_clear_error(tiny_dense_path):
    with pytest.raises(ValueError, match=r"lora.target_modules: \['qkv'\] name no module"):
        attach(load_model(tiny_dense_path), LoRAConfig(rank=2, target_modules=("q_proj", "qkv")))


def test_a_step_moves_the_adapters_alone_and_a_version_publishes_the_merged_model(sampler, tiny_dense_path):
    learner = _lora_learner(tiny_dense_path)
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" not in n}
    first = learner.published()
    assert first.sigma is None
    start = {n: p.detach().numpy() for n, p in load_model(tiny_dense_path).named_parameters()}
    assert list(first.mean) == list(start) and all((first.mean[n] == start[n]).all() for n in start)
    _step(learner, _groups(sampler, learner, "none", 1, 8))
    assert all(torch.equal(p, base[n]) for n, p in learner.model.named_parameters() if ".lora_" not in n)
    pv = learner.published()
    moved = {n for n in start if not (pv.mean[n] == start[n]).all()}
    assert moved and all(any(f".{t}.weight" in n for t in LORA.target_modules) for n in moved)
    merged = merged_weights(learner.model)
    assert all(torch.equal(torch.from_numpy(pv.mean[n]), merged[n]) for n in merged)


def test_the_export_is_an_hf_checkpoint_and_a_peft_adapter_of_the_same_policy(sampler, tiny_dense_path, tmp_path):
    from peft import PeftModel

    learner = _lora_learner(tiny_dense_path)
    _nudge_adapters(learner.model)
    out = learner.save_pretrained(str(tmp_path / "final"))
    load_tokenizer(tiny_dense_path).save_pretrained(out)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = learner.model.eval()(input_ids=ids).logits
        merged = load_model(out).eval()(input_ids=ids).logits
        adapter = PeftModel.from_pretrained(load_model(tiny_dense_path).eval(), os.path.join(out, "adapter"))
        via_peft = adapter(input_ids=ids).logits
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(via_peft, want, atol=1e-5, rtol=1e-5)



def test_model_path_takes_an_adapter_directory_as_its_base_with_the_adapter_merged(tiny_dense_path, tmp_path,
                                                                                   monkeypatch):
    from threepo.services.model.modeling import resolve_model

    monkeypatch.setenv("THREEPO_CACHE", str(tmp_path / "cache"))
    learner = _lora_learner(tiny_dense_path)
    _nudge_adapters(learner.model, seed=3)
    adapter = os.path.join(learner.save_pretrained(str(tmp_path / "final")), "adapter")
    path = resolve_model(adapter)
    assert path.startswith(str(tmp_path / "cache")) and resolve_model(adapter) == path  # merged once
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(load_model(path)(input_ids=ids).logits, learner.model.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    assert load_tokenizer(path).get_vocab() == load_tokenizer(tiny_dense_path).get_vocab()


def test_a_checkpoint_resumes_the_adapters_and_refuses_other_lora_settings(sampler, tiny_dense_path):
    a = _lora_learner(tiny_dense_path)
    groups = _groups(sampler, a, "none", 1, 8)
    _step(a, groups)
    tensors, meta = a.state()
    assert all(".lora_" in k for k in tensors if k.startswith("param/"))  # the adapters, not the base
    b = _lora_learner(tiny_dense_path)
    b.load_state({k: v.clone() for k, v in tensors.items()}, meta)
    ra, rb = _step(a, groups), _step(b, groups)
    assert ra.metrics["loss"] == pytest.approx(rb.metrics["loss"], abs=1e-7)
    assert all(torch.equal(x, y) for x, y in zip(merged_weights(a.model).values(), merged_weights(b.model).values()))
    with pytest.raises(ValueError, match=r"holds LoRA adapters \(rank 4.*this run trains LoRA adapters \(rank 2"):
        _lora_learner(tiny_dense_path, LoRAConfig(rank=2)).load_state(tensors, meta)
    with pytest.raises(ValueError, match="holds LoRA adapters .* this run trains every weight"):
        _lora_learner(tiny_dense_path, LoRAConfig()).load_state(tensors, meta)


def test_an_adapter_directory_without_a_usable_base_is_one_clear_error(tmp_path):
    from threepo.services.errors import MissingPathError
    from threepo.services.model.modeling import resolve_model

    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(MissingPathError, match="names no base_model_name_or_path"):
        resolve_model(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "/no/such"}')
    with pytest.raises(MissingPathError, match=r"model.path \(the base_model_name_or_path of .*no such directory"):
        resolve_model(str(tmp_path))


def test_the_kl_reference_under_lora_is_the_base_model_without_a_second_copy(sampler, tiny_dense_path):
    from threepo.services.model.lora import adapters_off

    learner = Learner(tiny_dense_path, AlgoConfig(exploration="none", n_slots=1, group_size=8, kl_coef=0.1),
                      OptimConfig(name="adamw", lr=1e-2, weight_decay=0.0), SyncConfig(max_staleness=1),
                      temperature=1.0, max_new_tokens=10, lora=LORA)
    assert learner.ref_model is None
    _nudge_adapters(learner.model, seed=5)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(6))
    model = learner.model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with adapters_off(model) as ref:
            torch.testing.assert_close(ref(input_ids=ids).logits, load_model(tiny_dense_path)(input_ids=ids).logits,
                                       atol=1e-6, rtol=1e-6)
        assert torch.equal(model(input_ids=ids).logits, adapted)  # the adapters are back
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)
    learner.model.train()
    before = {n: p.detach().clone() for n, p in learner.named}
    result = _step(learner, _groups(sampler, learner, "none", 1, 8))  # the penalty's forward runs adapters-off
    assert result.metrics["loss"] == result.metrics["loss"]
    assert any(not torch.equal(p, before[n]) for n, p in learner.named)  # and the adapters still train


# ---- IVON over the adapters (optimizers.LoRAIVONPosterior) and engines serving adapter samples ----

IVON_LORA = LoRAConfig(rank=2, alpha=4.0, target_modules=("proj",))


class _Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 5, bias=False)

    def forward(self, x):
        return self.proj(x)


def test_ivon_on_adapters_equals_ivon_on_the_adapter_tensors_of_w0_plus_s_b_a():
    from threepo.algorithms.ivon import IVON
    from threepo.algorithms.noise_mask import NoiseConfig
    from threepo.services.learner.optimizers import LoRAIVONPosterior, make_optimizer
    from threepo.services.learner.ranks import SingleRank

    torch.manual_seed(0)
    model = attach(_Projection(), IVON_LORA)
    named = trainable_named_parameters(model)
    a_name, b_name = (n for n, _ in named)
    assert ".lora_A." in a_name and ".lora_B." in b_name
    hyper = dict(lr=0.05, ess=200.0, hess_init=0.5, beta1=0.9, beta2=0.999, weight_decay=1e-4, clip_radius=1.0)
    opt = make_optimizer(model, named, OptimConfig(name="ivon", **hyper), SingleRank(), -1,
                         NoiseConfig(modules="everything"), IVON_LORA)
    assert isinstance(opt, LoRAIVONPosterior) and opt.adapter == (2, 4.0)
    # the reference: the adapters as two plain tensors, y = x W0ᵀ + s (x Aᵀ) Bᵀ, trained by IVON itself
    w0, s = model.proj.base_layer.weight.detach().clone(), IVON_LORA.alpha / IVON_LORA.rank
    ref = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    ref_ivon = IVON(ref, **hyper)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 5, generator=torch.Generator().manual_seed(2))
    for step in range(5):
        for seed in (10 * step, 10 * step + 1):  # two posterior samples per step
            with opt.at(seed):
                opt.backward(torch.nn.functional.mse_loss(model(x), y))
            with ref_ivon.sampled_params(seed):
                a, b = ref[0][1], ref[1][1]
                torch.nn.functional.mse_loss(x @ w0.T + s * (x @ a.T) @ b.T, y).backward()
        opt.step()
        ref_ivon.step()
    assert torch.equal(model.proj.base_layer.weight, w0)  # the base frozen
    for name, _ in named:
        for kind in ("mean", "hess", "momentum"):
            torch.testing.assert_close(opt.ivon.state[name][kind], ref_ivon.state[name][kind], atol=1e-6, rtol=1e-5)
    assert opt.ivon.state[b_name]["mean"].abs().max() > 1e-3  # B left zero: the adapters learned


def _ivon_lora_learner(path, lora=LORA):
    return ivon_lora_learner(path, lora)


def _lora_groups(sampler, learner):
    """`_groups` for a C3PO learner over adapters: its slots' seeds, the completions drawn from the
    base model (the adapted model of a fresh learner: B = 0), synthetic rewards."""
    import dataclasses
    import types

    base = {n: p.detach().numpy() for n, p in sampler[0].named_parameters()}
    pv = dataclasses.replace(learner.published(), mean=base, sigma=None, lora=None)
    return _groups(sampler, types.SimpleNamespace(published=lambda: pv), "c3po", 2, 8)


def test_an_adapter_posterior_version_is_adapter_sized_and_the_engine_serves_the_learners_slot(sampler, tiny_dense_path):
    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    learner = _ivon_lora_learner(tiny_dense_path)
    _step(learner, _lora_groups(sampler, learner))
    pv = learner.published()
    adapters = {n for n, _ in learner.named}
    assert pv.lora == (LORA.rank, LORA.alpha) and set(pv.mean) == adapters == set(pv.sigma)
    full = sum(p.numel() for _, p in load_model(tiny_dense_path).named_parameters())
    assert sum(a.size for a in pv.mean.values()) < full / 4  # the adapters alone travel
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    engine.load_version(1, pv.mean, pv.sigma, pv.mean_checksum, pv.noise_rank, lora=pv.lora)
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(8))
    model = learner.model.eval()
    for seed, scale in ((None, 1.0), (7, 1.0), (7, 2.5), (8, 1.0)):
        report = engine.serve(NoiseSpec(1, seed=seed, scale=scale))
        assert report.loaded_ok and engine.verify()
        served = load_model(tiny_dense_path).eval()
        with torch.no_grad():
            for n, p in served.named_parameters():
                p.copy_(engine.served()[n])
            got = served(input_ids=ids).logits
            if seed is None:
                want = model(input_ids=ids).logits
            else:
                with learner.optimizer.at(seed, train=False, scale=scale, served=True):
                    want = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # what the engine decodes (the base shared, the slot's adapter term beside it) is that policy too
        sample = engine.generate([EngineRequest((5, 6, 7), 1, seed=3)], SamplingParams(max_new_tokens=6))[0][0]
        full = torch.tensor([[5, 6, 7, *sample.token_ids]])
        with torch.no_grad(), (learner.optimizer.at(seed, train=False, scale=scale, served=True) if seed is not None
                               else contextlib.nullcontext()):
            logp = torch.log_softmax(model(input_ids=full).logits[0, 2:-1], -1)
        want_lp = logp.gather(1, full[0, 3:, None])[:, 0]
        np.testing.assert_allclose(sample.logprobs, want_lp.numpy(), atol=1e-4)
        if seed == 7 and scale == 1.0:
            slot7 = got
    assert not torch.allclose(slot7, got, atol=1e-4)  # slots 7 and 8 are different policies


def test_adapter_slots_decoded_together_sample_as_each_served_alone(sampler, tiny_dense_path):
    import numpy as np

    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    learner = ivon_lora_learner(tiny_dense_path, LORA, nudge_seed=9)  # B ≠ 0 so the slots differ in both factors
    pv = learner.published()
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    engine.load_version(2, pv.mean, pv.sigma, pv.mean_checksum, lora=pv.lora)
    params = SamplingParams(max_new_tokens=8)
    groups = [(NoiseSpec(2, seed=s, scale=c), [EngineRequest((5, 6, 7), 2, seed=s or 40)])
              for s, c in ((31, 1.0), (32, 1.0), (33, 3.0), (None, 1.0))]
    together = engine.generate_slots(groups, params)
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        assert report == engine.serve(noise) and report.loaded_ok and unchanged
        alone = engine.generate(requests, params)
        assert [[s.token_ids for s in r] for r in samples] == [[s.token_ids for s in r] for r in alone]
        for got, want in zip(samples, alone):
            np.testing.assert_allclose([s.logprobs for s in got], [s.logprobs for s in want], atol=1e-5)
    assert together[0][2][0][0].logprobs != together[1][2][0][0].logprobs


def test_the_adapter_weight_check_refuses_a_changed_adapter_and_a_lora_version_after_a_full_one(sampler,
                                                                                                 tiny_dense_path):
    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig, WeightsMismatch
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    pv = _ivon_lora_learner(tiny_dense_path).published()
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    changed = {n: a.copy() for n, a in pv.mean.items()}
    next(a for n, a in changed.items() if ".lora_A." in n)[0, 0] += 1e-3
    with pytest.raises(WeightsMismatch, match="checksum"):
        engine.load_version(1, changed, pv.sigma, pv.mean_checksum, lora=pv.lora)
    from threepo.algorithms import weight_checks

    stray = {**pv.mean, "model.layers.0.mlp.nonesuch.lora_A.default.weight": np.zeros((4, 8), np.float32)}
    with pytest.raises(WeightsMismatch, match="nonesuch"):
        engine.load_version(1, stray, None, weight_checks.weights_checksum(
            (n, torch.from_numpy(a)) for n, a in stray.items()), lora=pv.lora)
    engine.load_version(1, pv.mean, pv.sigma, pv.mean_checksum, lora=pv.lora)
    assert engine.serve(NoiseSpec(1, seed=4)).loaded_ok and engine.verify()
    with torch.no_grad():
        next(iter(engine._terms[0].values()))[0][0, 0, 0] += 1e-3  # a stray write into the served adapter sample
    assert not engine.verify()
    assert engine.serve(NoiseSpec(1, seed=4)).loaded_ok and engine.verify()  # serving builds it afresh
    with torch.no_grad():
        engine._base_set[0, 11] += 1e-3  # a stray write into the base the slots share
    assert not engine.verify()
    (report, unchanged, _), = engine.generate_slots([(NoiseSpec(1, seed=5), [EngineRequest((5, 6), 1, seed=1)])],
                                                    SamplingParams(max_new_tokens=2))
    assert report.loaded_ok and not unchanged
    with torch.no_grad():
        engine._base_set[0, 11] -= 1e-3
    full = {n: p.detach().numpy().copy() for n, p in engine._params.items()}
    engine.load_version(2, full, None, weight_checks.weights_checksum((n, torch.from_numpy(a)) for n, a in full.items()))
    with pytest.raises(WeightsMismatch, match="after a full version"):
        engine.load_version(3, pv.mean, pv.sigma, pv.mean_checksum, lora=pv.lora)


def test_an_adapter_posterior_checkpoint_resumes_and_refuses_other_lora_settings(sampler, tiny_dense_path):
    a = _ivon_lora_learner(tiny_dense_path)
    groups = _lora_groups(sampler, a)
    _step(a, groups)
    tensors, meta = a.state()
    assert meta["lora"] == [LORA.rank, LORA.alpha, list(LORA.target_modules)]
    b = _ivon_lora_learner(tiny_dense_path)
    b.load_state({k: v.clone() for k, v in tensors.items()}, meta)
    assert a.published().mean_checksum == b.published().mean_checksum
    with pytest.raises(ValueError, match="holds LoRA adapters .* this run trains every weight"):
        _ivon_lora_learner(tiny_dense_path, LoRAConfig()).load_state(tensors, meta)


def test_adamw_adapter_versions_ship_the_adapters_alone_and_the_hf_engine_serves_the_merged_policy(sampler,
                                                                                                  tiny_dense_path):
    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.wire.messages import SamplingParams

    learner = Learner(tiny_dense_path, AlgoConfig(exploration="none", n_slots=1, group_size=8),
                      OptimConfig(name="adamw", lr=1e-2, weight_decay=0.0), SyncConfig(max_staleness=1),
                      temperature=1.0, max_new_tokens=10, lora=LORA, adapter_versions=True)
    _step(learner, _groups(sampler, _lora_learner(tiny_dense_path), "none", 1, 8))
    pv = learner.published()
    assert pv.lora == (LORA.rank, LORA.alpha) and pv.sigma is None
    assert list(pv.mean) == [n for n, _ in learner.named]  # the adapters alone
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    engine.load_version(1, pv.mean, None, pv.mean_checksum, lora=pv.lora)
    merged = merged_weights(learner.model)
    for n, t in engine.served().items():
        torch.testing.assert_close(t, merged[n], atol=1e-6, rtol=1e-6)
    sample = engine.generate([EngineRequest((5, 6, 7), 1, seed=3)], SamplingParams(max_new_tokens=6))[0][0]
    full = torch.tensor([[5, 6, 7, *sample.token_ids]])
    with torch.no_grad():
        logp = torch.log_softmax(learner.model.eval()(input_ids=full).logits[0, 2:-1], -1)
    np.testing.assert_allclose(sample.logprobs, logp.gather(1, full[0, 3:, None])[:, 0].numpy(), atol=1e-4)
