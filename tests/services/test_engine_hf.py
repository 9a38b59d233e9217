"""The HF sampler engine: tokenizer round trip, exact behaviour log-probs, parameter noise, restore,
slots decoded together from the slot bank."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from threepo.algorithms import param_noise, weight_checks
from threepo.services.model.tokenizer import CHARSET
from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
from threepo.services.sampling.engines.hf import HFEngine
from threepo.services.wire.messages import NoiseSpec, SamplingParams


def test_tokenizer_round_trips_through_autotokenizer(tiny_dense_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dense_path)
    text = "Q: 23+58= A: \\boxed{81} " + CHARSET
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character, spaces included
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1


@pytest.fixture(scope="module")
def engine(tiny_dense_path):
    return HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))


def _posterior(engine, scale=0.02):
    mean = {n: p.detach().numpy().copy() for n, p in engine._params.items()}
    checksum = weight_checks.weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    return mean, {n: np.full(a.shape, scale, dtype=np.float32) for n, a in mean.items()}, checksum


def test_a_row_draws_the_same_tokens_whatever_shares_its_batch(engine):
    # the counter stream depends on the row's seed only: batch size, position and neighbours don't matter
    params = SamplingParams(max_new_tokens=10)
    alone = engine.generate([EngineRequest((5, 6, 7), 3, seed=42)], params)[0]
    crowd = engine.generate([EngineRequest((9,), 2, seed=1), EngineRequest((5, 6, 7), 3, seed=42),
                             EngineRequest((3, 3, 3, 3, 3), 1, seed=7)], params)[1]
    assert [s.token_ids for s in alone] == [s.token_ids for s in crowd]
    # padding changes the summation order of the forward, so log-probs agree to fp32 rounding only
    np.testing.assert_allclose([s.logprobs for s in alone], [s.logprobs for s in crowd], atol=1e-5)
    assert len({s.token_ids for s in alone}) == 3  # sample j draws from seed + j


def test_perturbation_is_identical_in_another_process(engine, tiny_dense_path):
    engine.load_version(3, *_posterior(engine))
    engine.serve(NoiseSpec(3, seed=2026))
    here = weight_checks.weights_checksum(engine.served().items())
    code = f"""
import numpy as np, torch
from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.sampling.engines.base import SamplerConfig
from threepo.services.sampling.engines.hf import HFEngine
from threepo.services.wire.messages import NoiseSpec
e = HFEngine({tiny_dense_path!r}, SamplerConfig(threads=2))
mean = {{n: p.detach().numpy().copy() for n, p in e._params.items()}}
e.load_version(3, mean, {{n: np.full(a.shape, 0.02, dtype=np.float32) for n, a in mean.items()}},
               weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items()))
for seed in (2026, 2027):
    e.serve(NoiseSpec(3, seed=seed))
    print(weights_checksum(e.served().items()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    there_same, there_other = out.stdout.split()
    assert there_same == here and there_other != here


def test_checksum_is_order_and_thread_independent():
    gen = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(1000, generator=gen)), ("b", torch.randn(7, 3, generator=gen))]
    assert weight_checks.weights_checksum(named) == weight_checks.weights_checksum(named[::-1])
    flipped = [("a", named[0][1].flip(0)), named[1]]  # a permutation changes it
    assert weight_checks.weights_checksum(flipped) != weight_checks.weights_checksum(named)
    nudged = [("a", named[0][1].clone()), named[1]]
    nudged[0][1][500] = torch.nextafter(nudged[0][1][500], torch.tensor(10.0))  # one ulp
    assert weight_checks.weights_checksum(nudged) != weight_checks.weights_checksum(named)


def test_the_checksum_position_term_is_the_term_by_term_sum_in_wrapping_int64():
    # the columns-of-65521 sum must equal Σ_i b_i (i mod 65521 + 1) mod 2^64 for any length, also
    # where the int64 sums wrap (huge bit patterns over millions of elements)
    for n, fill in ((1, None), (65521, None), (65522, None), (200_003, None), (5_000_000, -3e38)):
        t = torch.full((n,), fill) if fill else torch.randn(n, generator=torch.Generator().manual_seed(n))
        bits = t.view(torch.int32).to(torch.int64)
        direct = int((bits * (torch.arange(n, dtype=torch.int64) % 65521 + 1)).sum())
        assert weight_checks._position_weighted_sum(bits) == direct


def test_a_perturbed_sample_written_in_place_is_bit_identical_to_a_new_one():
    gen = torch.Generator().manual_seed(1)
    mean, sigma = torch.randn(300, 7, generator=gen), torch.rand(300, 7, generator=gen) * 1e-2
    out = torch.empty(300, 7)
    built = param_noise.perturbed(mean, sigma, 42, "w", 1.5)
    assert param_noise.perturbed(mean, sigma, 42, "w", 1.5, out=out) is out
    assert torch.equal(out.view(torch.int32), built.view(torch.int32))
    reference = (sigma * param_noise.noise_like(42, "w", (300, 7))) * 1.5 + mean  # the documented order
    assert torch.equal(built.view(torch.int32), reference.view(torch.int32))


def test_slots_decoded_together_sample_as_each_slot_served_alone(tiny_dense_path):
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    engine.load_version(4, *_posterior(engine))
    params = SamplingParams(max_new_tokens=8)
    groups = [(NoiseSpec(4, seed=11), [EngineRequest((5, 6, 7), 3, seed=1), EngineRequest((9,), 2, seed=2)]),
              (NoiseSpec(4, seed=12), [EngineRequest((3, 4), 4, seed=3)]),
              (NoiseSpec(4, seed=11, scale=2.0), [EngineRequest((8, 8, 8, 8), 1, seed=4)]),
              (NoiseSpec(4, seed=None), [EngineRequest((5, 6, 7), 2, seed=1)])]
    served_before = weight_checks.weights_checksum(engine.served().items())
    together = engine.generate_slots(groups, params)  # passes of 5 | 4 + 1 (padded to 4) | 2 rows
    assert weight_checks.weights_checksum(engine.served().items()) == served_before  # what serve serves is untouched
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        alone_report = engine.serve(noise)
        alone = engine.generate(requests, params)
        assert report == alone_report and report.loaded_ok and unchanged
        assert [[s.token_ids for s in r] for r in samples] == [[s.token_ids for s in r] for r in alone]
        for got, want in zip(samples, alone):
            np.testing.assert_allclose([s.logprobs for s in got], [s.logprobs for s in want], atol=1e-5)
    # the slots are different policies: the same request and stream draw differently under each
    assert together[0][2][0][0].logprobs != together[3][2][0][0].logprobs


def test_a_bf16_engine_builds_slots_from_the_published_fp32_mean_without_a_copy_of_its_own(tiny_dense_path):
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3, dtype="bfloat16"))
    params = SamplingParams(max_new_tokens=2)
    (report, unchanged, _), = engine.generate_slots([(NoiseSpec(0, seed=None), [EngineRequest((5, 6), 1, seed=1)])], params)
    assert report.loaded_ok and unchanged  # before any version: the mean it loaded, as the model holds it
    mean = {n: p.detach().float().numpy() + np.float32(1e-4) for n, p in engine._params.items()}  # not bf16 values
    sigma = {n: np.full(a.shape, 0.02, dtype=np.float32) for n, a in mean.items()}
    checksum = weight_checks.weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    engine.load_version(2, mean, sigma, checksum)
    # m is the arrays handed in (views of the published object under Ray), not a private fp32 copy
    assert all(engine._mean[n].data_ptr() == mean[n].ctypes.data for n in engine._params)
    engine.generate_slots([(NoiseSpec(2, seed=5), [EngineRequest((5, 6), 1, seed=1)])], params)
    row = engine.bank.place([(5, 1.0)], lambda *_: pytest.fail("slot 5 is resident"))[0]
    views = engine.bank.layout.views(engine.bank.rows[row])
    for n, a in mean.items():  # θ̂ = m + σ z from the fp32 m, then cast: the learner's θ̂ in bf16
        want = param_noise.perturbed(torch.from_numpy(a), torch.from_numpy(sigma[n]), 5, n).to(torch.bfloat16)
        assert torch.equal(views[n], want), n


def test_slot_weights_corrupted_in_the_bank_are_flagged_then_rebuilt(tiny_dense_path):
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    engine.load_version(1, *_posterior(engine))
    params = SamplingParams(max_new_tokens=4)
    groups = [(NoiseSpec(1, seed=s), [EngineRequest((5, 6), 2, seed=s)]) for s in (21, 22)]
    first = engine.generate_slots(groups, params)
    assert all(r.loaded_ok and unchanged for r, unchanged, _ in first)
    row = engine.bank.place([(22, 1.0)], lambda *_: pytest.fail("slot 22 is resident"))[0]
    with torch.no_grad():
        engine.bank.rows[row, 7] += 1e-3  # a stray write into slot 22's weights
    first, second = engine.generate_slots(groups, params)
    assert first[0].loaded_ok and first[1] and second[0].loaded_ok and not second[1]
    assert all(r.loaded_ok and unchanged for r, unchanged, _ in engine.generate_slots(groups, params))


def test_the_slot_bank_is_bounded_in_bytes_and_a_call_with_more_slots_takes_several_passes(tiny_dense_path):
    small = HFEngine(tiny_dense_path, SamplerConfig(batch_size=16, seed=3, slot_cache_mb=1))
    mean, sigma, checksum = _posterior(small)
    small.load_version(1, mean, sigma, checksum)
    one_set = sum(a.nbytes for a in sigma.values())  # σ covers every tensor here: a whole fp32 set per slot
    assert small.bank.set_bytes == one_set and small.bank.capacity == (1 << 20) // one_set >= 2
    slots = small.bank.capacity + 2
    groups = [(NoiseSpec(1, seed=100 + s), [EngineRequest((5, 6), 1, seed=s)]) for s in range(slots)]
    params = SamplingParams(max_new_tokens=4)
    together = small.generate_slots(groups, params)
    assert len(small.bank.rows) == small.bank.capacity  # never more rows than the budget holds
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        small.serve(noise)
        assert report.loaded_ok and unchanged
        assert [s.token_ids for s in samples[0]] == [s.token_ids for s in small.generate(requests, params)[0]]


def test_a_slot_holds_only_the_tensors_sigma_covers_and_reads_the_rest_from_the_mean(tiny_dense_path):
    from threepo.services.model.modeling import load_model

    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    mean, full, checksum = _posterior(engine, scale=0.05)
    # layer 0's MLP and layer 1's q projection alone (k and v share its fused matmul: held, at m)
    noised = [n for n in full if n.startswith("model.layers.0.mlp.") or n == "model.layers.1.self_attn.q_proj.weight"]
    engine.load_version(1, mean, {n: full[n] for n in noised}, checksum)
    held = set(engine.bank.layout.spans)
    assert held == {*noised, "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"}
    assert engine.bank.set_bytes == sum(mean[n].nbytes for n in held)  # no embedding, head or norms per slot
    params = SamplingParams(max_new_tokens=6)
    groups = [(NoiseSpec(1, seed=s), [EngineRequest((5, 6, 7), 2, seed=s)]) for s in (31, 32)]
    together = engine.generate_slots(groups, params)
    model = load_model(tiny_dense_path).eval()
    for (noise, requests), (report, unchanged, samples) in zip(groups, together):
        assert report.loaded_ok and unchanged
        theta = {n: param_noise.perturbed(torch.from_numpy(mean[n]), torch.from_numpy(full[n]), noise.seed, n)
                 if n in noised else torch.from_numpy(mean[n]) for n in mean}
        model.load_state_dict(theta, strict=False)
        engine.serve(noise)
        assert all(torch.equal(engine.served()[n].float(), theta[n]) for n in mean)
        for sample in samples[0]:  # transformers' forward at θ̂ gives the log-probs the slot sampled with
            ids = torch.tensor([[5, 6, 7, *sample.token_ids]])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, 2:-1].float(), -1)
            want = logp[torch.arange(len(sample.token_ids)), torch.tensor(sample.token_ids)]
            np.testing.assert_allclose(sample.logprobs, want.numpy(), atol=1e-4)


def test_distinct_rows_are_found_per_weight_slot():
    from threepo.services.sampling.engines.decoding import _distinct_rows

    rows = torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2],    # slot 0: two distinct rows
                         [5, 5], [5, 5], [5, 5], [5, 5]])   # slot 1: one, repeated
    first, inverse = _distinct_rows(rows, slots=2)
    assert len(first) == 4 and (first[:2] < 4).all() and (first[2:] >= 4).all()  # U = 2 per slot
    assert torch.equal(rows[first][inverse], rows)
    assert (inverse[:4] < 2).all() and (inverse[4:] >= 2).all()  # a row stays under its own slot
    assert _distinct_rows(torch.tensor([[1], [2], [1], [2]]), slots=2) is None  # nothing repeats in a slot


def test_a_shared_prefill_gives_every_row_its_own_logits_and_cache(tiny_dense_path):
    from threepo.services.model.modeling import load_model
    from threepo.services.sampling.engines.decoding import _shared_prefill
    from threepo.services.sampling.engines.lean_decoder import LeanDecoder, WeightLayout

    model = load_model(tiny_dense_path).eval()
    params = dict(model.named_parameters())
    layout = WeightLayout.of(model, list(params))
    sets = torch.empty(2, layout.numel)
    for s in range(2):  # set 1 is another policy: its rows must not share set 0's
        for i, (name, view) in enumerate(layout.views(sets[s]).items()):
            noise = torch.randn(view.shape, generator=torch.Generator().manual_seed(i))
            view.copy_(params[name].detach() + 0.05 * s * noise)
    lean = LeanDecoder(model, layout, sets)
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6],
                        [0, 5, 6], [7, 8, 9], [7, 8, 9], [7, 8, 9]])
    keys = torch.zeros(8, 5, dtype=torch.bool)
    keys[:, :3] = ids != 0
    positions = (keys[:, :3].long().cumsum(-1) - 1).clamp(min=0)
    plain_cache, shared_cache = lean.new_cache(8, 5, torch.float32), lean.new_cache(8, 5, torch.float32)
    with torch.no_grad():
        plain = lean.forward(ids, positions, plain_cache, 0, keys)
        shared = _shared_prefill(lean, ids, positions, shared_cache, keys)
    torch.testing.assert_close(shared, plain, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(shared[0], shared[4])  # the same prompt under two sets differs
    for (k, v), (k_shared, v_shared) in zip(plain_cache, shared_cache):
        torch.testing.assert_close(k_shared, k, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v_shared, v, atol=1e-6, rtol=1e-6)


def test_the_model_holds_the_mean_once_as_views_of_one_flat_weight_set(engine):
    flat = engine._mean_set
    params = list(engine.model.parameters())
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    assert sum(p.numel() for p in params) == flat.numel()


def test_greedy_decoding_takes_the_argmax_and_stops_at_any_stop_token(engine):
    engine.load_version(9, *_posterior(engine))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    first = engine.generate([EngineRequest((5, 6, 7), 2, seed=1)], greedy)[0]
    other = engine.generate([EngineRequest((5, 6, 7), 1, seed=99)], greedy)[0]
    assert first[0].token_ids == first[1].token_ids == other[0].token_ids  # no randomness at all
    assert all(lp == 0.0 for lp in first[0].logprobs)
    tokens = first[0].token_ids
    stop = tokens[2]  # make the third greedy token a stop token: the completion ends there, keeping it
    cut = engine.generate([EngineRequest((5, 6, 7), 1, seed=1)],
                          SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,)))[0][0]
    assert cut.token_ids == tokens[:tokens.index(stop) + 1] and cut.finish_reason == "stop"


def test_decoding_builds_every_tensor_on_the_engines_device(tiny_dense_path):
    """With factory calls that name no device sent to `meta` and the engine on the CPU, a decoding
    helper that builds a tensor without naming the engine's device (or the host's, on purpose)
    fails: what `sampler.device=cuda` would meet. Slots built, sampled and checked as on the CPU."""
    engine = HFEngine(tiny_dense_path, SamplerConfig(batch_size=8, seed=3))
    engine.load_version(4, *_posterior(engine))
    params = SamplingParams(max_new_tokens=6, top_k=20, top_p=0.9)
    groups = [(NoiseSpec(4, seed=11), [EngineRequest((5, 6, 7), 3, seed=1), EngineRequest((9,), 2, seed=2)]),
              (NoiseSpec(4, seed=12), [EngineRequest((3, 4), 2, seed=3)])]
    expected = engine.generate_slots(groups, params)
    engine.bank.clear()
    with torch.device("meta"):
        found = engine.generate_slots(groups, params)
        greedy = engine.generate([EngineRequest((5, 6, 7), 2, seed=1)], SamplingParams(max_new_tokens=4, temperature=0))
    assert [r[:2] for r in found] == [r[:2] for r in expected] and all(r[0].loaded_ok and r[1] for r in found)
    assert [[[s.token_ids for s in q] for q in r[2]] for r in found] == [[[s.token_ids for s in q] for q in r[2]] for r in expected]
    assert len(greedy[0]) == 2 and greedy[0][0].token_ids == greedy[0][1].token_ids


def test_a_model_without_a_pad_token_samples_padded_batches(tiny_dense_path, tmp_path):
    """Llama-family checkpoints often ship no pad token: rows of different lengths are padded with the
    first stop token instead, and sampling runs as with one."""
    import shutil

    from threepo.services.model.modeling import load_tokenizer

    path = tmp_path / "no-pad"
    shutil.copytree(tiny_dense_path, path)
    tokenizer = load_tokenizer(str(path))
    tokenizer.pad_token = None
    tokenizer.save_pretrained(path)
    engine = HFEngine(str(path), SamplerConfig(batch_size=8, seed=3))
    assert engine.tokenizer.pad_token_id is None
    out = engine.generate([EngineRequest((5, 6, 7), 2, seed=1), EngineRequest((9,), 2, seed=2)],
                          SamplingParams(max_new_tokens=5))
    assert [len(r) for r in out] == [2, 2] and all(s.token_ids for r in out for s in r)
