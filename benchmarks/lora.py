"""LoRA against full fine-tuning (issue 26). The learner: peak memory, step time, optimizer state and
the bytes a version ships, for AdamW and IVON on every weight and on LoRA adapters of rank 8 and 1.
The hf engine (`--engine`): a C3PO call's rows sampled under 4 posterior samples against under 1, for a
full-weight posterior (each slot a perturbed copy of the model, decoded together from the slot bank)
and a rank-8 adapter posterior (the base shared, each slot's adapter term beside it).

Each arm runs in a fresh process (so that its peak RSS is its own): a `Learner` (services/learner/
core.py, as the learner actor builds it; GRPO, AdamW) on the same step's inputs, `--steps` timed steps
after one warm-up step (inputs as benchmarks/learner_ranks.py makes them: `runtime.prompts_per_step`
groups of `algo.group_size` completions of `sampler.max_new_tokens` random tokens; the learner's work
does not depend on what they say). Figures per arm: trainable parameters, the median `step_time_s`,
the process's peak RSS, the optimizer's state bytes, the time and bytes of `published()` (what the
posterior server stores and each engine receives per version). `--model smollm2` is the real 135M
model (bf16 autocast, as benchmarks/real_model.py trains it); '' the embedded default.

    python3 benchmarks/lora.py --model smollm2          # SmolLM2-135M-Instruct (a few minutes)
    python3 benchmarks/lora.py                          # the embedded default
    python3 benchmarks/lora.py --quick --model tiny     # smoke
    python3 benchmarks/lora.py --engine --model smollm2 # the engine part alone (--backend vllm: vLLM's)

The engine part: one engine (1 thread, `--rows` rows per call, max_new_tokens 16, T 1, the default
task's prompts), each call's rows split over S = 1 or 4 slots of the held version (`generate_slots`);
time per generated token, after a warm-up call, over `--seconds`; the ratio S=4 ÷ S=1 per version kind.
The slots keep their seeds across calls, as a version's do in a run: full-weight slots are built into
the bank once (the warm-up), adapter samples are stacked at every call (adapter-sized work).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import _common

ARMS = {"full": ("adamw", 0), "lora r8": ("adamw", 8), "lora r1": ("adamw", 1),
        "ivon full": ("ivon", 0), "ivon lora r8": ("ivon", 8), "ivon lora r1": ("ivon", 1)}


def one_arm(model: str, overrides: list[str], arm: tuple, steps: int, bf16: bool, out) -> None:
    """In a fresh process: the figures of one arm, put on `out`."""
    import resource

    import torch
    from learner_ranks import step_inputs

    from threepo.services.learner.core import Learner
    from threepo.services.model.lora import LoRAConfig

    torch.set_num_threads(1)
    optim, rank = arm
    lr = ["optim.lr=1e-4"] if optim == "adamw" else []  # [optim] lr's default (10) is IVON's; AdamW diverges at it
    cfg = _common.config(model, [f"optim.name={optim}", *lr, "algo.exploration=none", "algo.n_slots=1", *overrides])
    inputs = step_inputs(model, cfg)
    learner = Learner(model, cfg.algo, cfg.optim, cfg.sync, temperature=cfg.sampler.temperature,
                      max_new_tokens=cfg.sampler.max_new_tokens, bf16=bf16, lora=LoRAConfig(rank=rank))
    learner.published("start")
    learner.step(*inputs)  # warm-up: the optimizer's moments exist after it
    times, publish, nbytes = [], [], 0
    for _ in range(steps):
        times.append(learner.step(*inputs).metrics["step_time_s"])
        started = time.perf_counter()
        pv = learner.published()
        publish.append(time.perf_counter() - started)
        nbytes = sum(a.nbytes for part in (pv.mean, pv.sigma or {}) for a in part.values())
    out.put({"trainable": sum(p.numel() for _, p in learner.named), "step_s": statistics.median(times),
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "state_mb": learner.optimizer.state_bytes() / 2 ** 20, "publish_s": statistics.median(publish),
             "version_mb": nbytes / 2 ** 20, "step_s_all": times})


def engine_arm(model: str, rank: int, dtype: str, rows: int, seconds: float, backend: str, out) -> None:
    """In a fresh process: seconds per generated token of calls of `rows` rows under 1 and 4 slots of
    a full-weight posterior (rank 0) or a rank-`rank` adapter posterior (σ 1e-3 everywhere), put on
    `out`. An engine that cannot sample a version's slots in one call (vLLM, full weights: each slot
    is a reload) serves them one after the other, as its sampler does."""
    import numpy as np
    import torch
    from engine_throughput import sample_slots

    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.services.model.lora import LoRAConfig, attach
    from threepo.services.model.modeling import load_model, trainable_named_parameters
    from threepo.services.sampling.engines.base import SamplerConfig
    from threepo.services.sampling.engines.hf import HFEngine
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    torch.set_num_threads(1)
    cfg = SamplerConfig(backend=backend, threads=1, batch_size=rows, max_new_tokens=16)
    if backend == "vllm":
        from threepo.services.sampling.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model, cfg, dtype=dtype, adapters=(rank, 4) if rank else None)
    else:
        engine = HFEngine(model, cfg, dtype=dtype)
    if rank:
        adapted = attach(load_model(model), LoRAConfig(rank=rank))
        gen = torch.Generator().manual_seed(0)
        mean = {n: (p.detach() if ".lora_A." in n else torch.randn(p.shape, generator=gen) * 1e-3).numpy().copy()
                for n, p in trainable_named_parameters(adapted)}
    else:
        mean = {n: p.detach().float().numpy().copy() for n, p in trainable_named_parameters(load_model(model))}
    sigma = {n: np.full(a.shape, 1e-3, dtype=np.float32) for n, a in mean.items()}
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    engine.load_version(1, mean, sigma, checksum, **({"lora": (rank, 16.0)} if rank else {}))
    prompts = _common.encoded_requests(engine.tokenizer, [it.prompt for it in _common.task_prompts(rows)])
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    figures = {}
    for slots in (1, 4, 1, 4):  # twice each, interleaved: the second round is kept (the first warms up)
        per = rows // slots
        tokens, calls, start = 0, 0, time.perf_counter()
        while True:
            groups = [(NoiseSpec(1, seed=100 + s), prompts[s * per:(s + 1) * per]) for s in range(slots)]
            tokens += sample_slots(engine, groups, params, getattr(engine, "slots_together", False))
            calls += 1
            if time.perf_counter() - start >= seconds:
                break
        figures[slots] = {"s_per_token": (time.perf_counter() - start) / tokens, "tokens": tokens, "calls": calls}
    out.put({"version_mb": sum(a.nbytes for part in (mean, sigma) for a in part.values()) / 2 ** 20,
             "slots": figures, "ratio": figures[4]["s_per_token"] / figures[1]["s_per_token"]})


def engine_part(model: str, dtype: str, rows: int, seconds: float, backend: str) -> dict:
    ctx, figures = mp.get_context("spawn"), {}
    for label, rank in (("full-weight posterior", 0), ("adapter posterior r8", 8)):
        out = ctx.Queue()
        proc = ctx.Process(target=engine_arm, args=(model, rank, dtype, rows, seconds, backend, out))
        proc.start()
        figures[label] = out.get()
        proc.join()
        print(f"{label}: {figures[label]}", flush=True)
    rows_ = [[label, f"{f['version_mb']:,.2f}", f"{1e3 * f['slots'][1]['s_per_token']:.2f}",
              f"{1e3 * f['slots'][4]['s_per_token']:.2f}", f"{f['ratio']:.2f}"] for label, f in figures.items()]
    _common.table(f"{backend} engine, a call of {rows} rows under S posterior samples ({os.path.basename(model.rstrip('/'))}, "
                  f"{dtype}, 1 thread, max_new_tokens 16, T 1)",
                  ["version", "version MiB", "ms/token S=1", "ms/token S=4", "S=4 ÷ S=1"], rows_)
    return figures


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm (after one warm-up step)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--engine", action="store_true", help="the engine part alone")
    p.add_argument("--rows", type=int, default=32, help="rows per engine call (the engine part)")
    p.add_argument("--seconds", type=float, default=20.0, help="measuring time per engine configuration")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="the engine of the engine part")
    args = p.parse_args()
    sizes = ["runtime.prompts_per_step=4", "algo.group_size=8", "sampler.max_new_tokens=64"]
    if args.quick:
        args.steps, sizes = 1, ["runtime.prompts_per_step=2", "algo.group_size=4", "sampler.max_new_tokens=8"]
    real = args.model == "smollm2"
    if real:
        from threepo.services.model.modeling import smollm2_checkpoint

        args.model = smollm2_checkpoint(os.environ.get("THREEPO_CACHE") or os.path.expanduser("~/.cache/threepo"))
    model = _common.model_path(args)
    if args.engine:
        figures = engine_part(model, "bfloat16" if real else "float32", args.rows, 2.0 if args.quick else args.seconds,
                              args.backend)
        _common.write_results(f"lora_engine_{args.backend}_{'smollm2' if real else 'embedded'}",
                              {"model": model, "figures": figures, "args": vars(args)})
        return
    overrides = [*sizes, *args.overrides]
    ctx, figures = mp.get_context("spawn"), {}
    for arm in args.arms:
        out = ctx.Queue()
        proc = ctx.Process(target=one_arm, args=(model, overrides, ARMS[arm], args.steps, real, out))
        proc.start()
        figures[arm] = out.get()
        proc.join()
        print(f"{arm}: {figures[arm]}", flush=True)
    rows = []
    for arm, f in figures.items():
        full = figures.get("ivon full" if arm.startswith("ivon") else "full")  # the same optimizer on every weight
        rows.append([arm, f"{f['trainable']:,}", f"{f['step_s']:.2f}", f"{f['peak_rss_mb']:,.0f}", f"{f['state_mb']:,.1f}",
                     f"{f['publish_s']:.3f}", f"{f['version_mb']:,.1f}",
                     f"{f['step_s'] / full['step_s']:.2f}" if full else "-",
                     f"{f['peak_rss_mb'] / full['peak_rss_mb']:.2f}" if full else "-"])
    _common.table(f"Learner, AdamW and IVON, full vs LoRA ({os.path.basename(model.rstrip('/'))}; "
                  f"{' '.join(sizes)}; median of {args.steps} steps, 1 thread{', bf16 autocast' if real else ''})",
                  ["arm", "trainable", "step s", "peak RSS MiB", "optimizer state MiB", "publish s", "version MiB",
                   "step ÷ full", "RSS ÷ full"], rows)
    ivon = "_ivon" if all(a.startswith("ivon") for a in args.arms) else ""
    _common.write_results(f"lora_{'smollm2' if real else 'embedded'}{ivon}",
                          {"model": model, "overrides": overrides, "figures": figures})


if __name__ == "__main__":
    main()
