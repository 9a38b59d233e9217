"""One device check for a GPU machine: the GPU test tier, then C3PO and GRPO figures on a ~0.5B-shaped
Qwen2 built from a config (random weights, bf16), written as one JSON report.

Needs only torch, transformers, safetensors, numpy, msgpack and threepo (no Ray, no vLLM), so it runs
on a bare CUDA box in under 10 minutes:

    python3 benchmarks/gpu_check.py                      # on one GPU: benchmarks/results/gpu_check.json
    python3 benchmarks/gpu_check.py --dry-run            # CPU self-check: the tier with the CPU as target,
                                                         # the measurements on a tiny model (CI runs this)

Parts, each timed and recorded with its error if it fails (a failed part does not stop the others):
- `tier`: `pytest -m gpu tests/gpu` (dry run: THREEPO_GPU_TIER_DEVICE=cpu);
- `noise`: one slot's z for every weight drawn on the device (the counter generator) and a whole slot
  switch of the hf engine (θ̂ built, cast, fingerprinted): seconds and parameters per second;
- `engine`: the hf engine in bf16 on the device, one slot × 64 rows against 4 slots × 16 rows,
  128 tokens: tokens/s of each and their ratio;
- `learner`: a C3PO step (IVON, N = 4) and a GRPO step (AdamW) in bf16 mixed precision on the same
  model, groups sampled by the engine: seconds per step (the second of two) and peak device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

# ~Qwen2.5-0.5B: 24 layers, 896 wide, 14 heads (2 kv), MLP 4864, vocabulary 151,936, tied head
FULL = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
            vocab=151_936, max_positions=512, tokens=128)
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab=512,
            max_positions=128, tokens=8)


def build_checkpoint(directory: str, shape: dict) -> str:
    """A randomly initialised Qwen2 of `shape` saved in bf16 with threepo's character tokenizer."""
    from threepo.services.model.modeling import ModelConfig, build_model
    from threepo.services.model.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = ModelConfig(kind="dense", hidden_size=shape["hidden_size"], num_layers=shape["num_layers"],
                      num_heads=shape["num_heads"], num_kv_heads=shape["num_kv_heads"],
                      intermediate_size=shape["intermediate_size"], max_positions=shape["max_positions"],
                      dtype="bfloat16")
    model = build_model(cfg, vocab_size=shape["vocab"], pad_id=tokenizer.pad_token_id,
                        eos_id=tokenizer.eos_token_id, seed=0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def part_tier(dry_run: bool) -> dict:
    env = dict(os.environ, THREEPO_GPU_TIER_DEVICE="cpu" if dry_run else "cuda")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           os.path.join(ROOT, "tests", "gpu")], cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (done.stdout + done.stderr).strip().splitlines()
    return {"ok": done.returncode == 0, "summary": tail[-1] if tail else "", "tail": tail[-20:]}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: str) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def _engine_at_version(path: str, device: str):
    """The hf engine in bf16 on `device`, holding version 1: its own weights as m, σ = 1% of |m| + 1e-4."""
    import torch

    from threepo.algorithms import weight_checks
    from threepo.services.sampling.engines.base import SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine

    engine = HFEngine(path, SamplerConfig(device=device, dtype="bfloat16", batch_size=64, seed=0))
    mean = {n: p.detach().float().cpu().numpy() for n, p in engine._params.items()}
    sigma = {n: (abs(a) * 0.01 + 1e-4).astype("float32") for n, a in mean.items()}
    engine.load_version(1, mean, sigma, weight_checks.weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items()))
    return engine


def part_noise(path: str, device: str) -> dict:
    import torch

    from threepo.algorithms import counter_normal, param_noise
    from threepo.services.wire.messages import NoiseSpec

    engine = _engine_at_version(path, device)
    params = engine._params
    numel = sum(p.numel() for p in params.values())
    out = torch.empty(max(p.numel() for p in params.values()), device=device)
    _sync(device)
    start = time.perf_counter()
    for name, p in params.items():
        counter_normal.standard_normal(param_noise.tensor_seed(7, name), p.numel(), out=out[:p.numel()])
    _sync(device)
    draw = time.perf_counter() - start
    times = []
    for seed in (11, 12):
        _sync(device)
        start = time.perf_counter()
        report = engine.serve(NoiseSpec(1, seed=seed))
        _sync(device)
        times.append(time.perf_counter() - start)
    return {"parameters": numel, "z_draw_s": round(draw, 4), "z_params_per_s": round(numel / draw),
            "slot_switch_s": round(times[-1], 4), "slot_loaded_ok": report.loaded_ok, "peak_gib": _peak_gib(device)}


def part_engine(path: str, device: str, tokens: int) -> dict:
    from threepo.services.sampling.engines.base import EngineRequest
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    engine = _engine_at_version(path, device)
    # no stop token: every row decodes `tokens` tokens, so tokens/s compares equal work
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, stop_token_ids=(10**6,))
    prompt = tuple(engine.tokenizer("Q: 12+34= A:", add_special_tokens=False)["input_ids"])

    def run(slots: int, rows: int) -> float:
        calls = [(NoiseSpec(1, seed=100 + s), [EngineRequest(prompt, rows, seed=s * 1000)]) for s in range(slots)]
        engine.generate_slots(calls, SamplingParams(max_new_tokens=2, temperature=1.0))  # warm-up, slots built
        _sync(device)
        start = time.perf_counter()
        out = engine.generate_slots(calls, params)
        _sync(device)
        made = sum(len(s.token_ids) for _, _, per in out for samples in per for s in samples)
        return made / (time.perf_counter() - start)

    one, four = run(1, 64), run(4, 16)
    return {"rows": 64, "tokens": tokens, "one_slot_tokens_per_s": round(one, 1), "four_slots_tokens_per_s": round(four, 1),
            "four_over_one_time": round(one / four, 3), "peak_gib": _peak_gib(device)}


def part_learner(path: str, device: str, tokens: int) -> dict:
    import torch
    from workload import sampled_groups, step

    from threepo.services.learner.config import AlgoConfig
    from threepo.services.learner.core import Learner
    from threepo.services.learner.optim_config import OptimConfig, SyncConfig
    from threepo.services.sampling.engines.base import SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine

    engine = HFEngine(path, SamplerConfig(device=device, dtype="bfloat16", batch_size=128, seed=0))
    result = {}
    for name, exploration, slots, optim in (("c3po", "c3po", 4, OptimConfig()),
                                            ("grpo", "none", 1, OptimConfig(name="adamw", lr=1e-6))):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        learner = Learner(path, AlgoConfig(exploration=exploration, n_slots=slots, group_size=16), optim,
                          SyncConfig(max_staleness=4), temperature=1.0, max_new_tokens=tokens, device=device,
                          bf16=True, activation_mb=8192 if device == "cuda" else 256)
        groups = sampled_groups(engine, learner, exploration, slots, 16, prompts=4, max_new_tokens=tokens)
        times = []
        for _ in range(2):
            _sync(device)
            start = time.perf_counter()
            step(learner, groups)
            _sync(device)
            times.append(time.perf_counter() - start)
        result[name] = {"step_s": round(times[-1], 4), "first_step_s": round(times[0], 4), "peak_gib": _peak_gib(device),
                        "rows": sum(len(g.completions) for g in groups)}
        del learner
        if device == "cuda":
            torch.cuda.empty_cache()
    result["c3po_over_grpo"] = round(result["c3po"]["step_s"] / result["grpo"]["step_s"], 3)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU self-check: the tier with the CPU as target, tiny model")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_check.json"))
    ap.add_argument("--parts", nargs="+", default=["tier", "noise", "engine", "learner"],
                    choices=["tier", "noise", "engine", "learner"])
    args = ap.parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device here; run with --dry-run for the CPU self-check", file=sys.stderr)
        return 2
    shape = TINY if args.dry_run else FULL
    report = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "shape": shape, "parts": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        for part in args.parts:
            t0 = time.perf_counter()
            print(f"gpu_check: {part} ...", flush=True)
            try:
                if part == "tier":
                    out = part_tier(args.dry_run)
                else:
                    path = path or build_checkpoint(tmp, shape)
                    out = {"noise": lambda: part_noise(path, device),
                           "engine": lambda: part_engine(path, device, shape["tokens"]),
                           "learner": lambda: part_learner(path, device, shape["tokens"])}[part]()
                out.setdefault("ok", True)
            except Exception as err:  # noqa: BLE001 (a failed part is recorded; the others still run)
                out = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
            out["seconds"] = round(time.perf_counter() - t0, 1)
            report["parts"][part] = out
            print(f"gpu_check: {part} {'ok' if out['ok'] else 'FAILED'} in {out['seconds']} s: "
                  f"{ {k: v for k, v in out.items() if k not in ('tail', 'trace')} }", flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["ok"] = all(p["ok"] for p in report["parts"].values())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"gpu_check: {'all parts ok' if report['ok'] else 'some parts FAILED'} in {report['seconds']} s -> {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
