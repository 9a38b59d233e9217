"""LoRA against full fine-tuning in the learner (issue 26): peak memory, step time, optimizer state
and the bytes a version ships, for AdamW on every weight and AdamW on LoRA adapters of rank 8 and 1.

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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import _common

ARMS = {"full": 0, "lora r8": 8, "lora r1": 1}


def one_arm(model: str, overrides: list[str], rank: int, steps: int, bf16: bool, out) -> None:
    """In a fresh process: the figures of one arm, put on `out`."""
    import resource

    import torch

    from learner_ranks import step_inputs

    from threepo.services.learner.core import Learner
    from threepo.services.lora import LoRAConfig

    torch.set_num_threads(1)
    cfg = _common.config(model, ["optim.name=adamw", "algo.exploration=grpo", "algo.n_slots=1", *overrides])
    inputs = step_inputs(model, cfg)
    learner = Learner(model, cfg.algo, cfg.optim, cfg.sync, temperature=cfg.sampler.temperature,
                      max_new_tokens=cfg.sampler.max_new_tokens, bf16=bf16, lora=LoRAConfig(rank=rank))
    learner.published("start")
    learner.step(*inputs)  # warm-up: AdamW's moments exist after it
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


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm (after one warm-up step)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = p.parse_args()
    sizes = ["runtime.prompts_per_step=4", "algo.group_size=8", "sampler.max_new_tokens=64"]
    if args.quick:
        args.steps, sizes = 1, ["runtime.prompts_per_step=2", "algo.group_size=4", "sampler.max_new_tokens=8"]
    real = args.model == "smollm2"
    if real:
        from threepo.services.modeling import smollm2_checkpoint

        args.model = smollm2_checkpoint(os.environ.get("THREEPO_CACHE") or os.path.expanduser("~/.cache/threepo"))
    model = _common.model_path(args)
    overrides = [*sizes, *args.overrides]
    ctx, figures = mp.get_context("spawn"), {}
    for arm in args.arms:
        out = ctx.Queue()
        proc = ctx.Process(target=one_arm, args=(model, overrides, ARMS[arm], args.steps, real, out))
        proc.start()
        figures[arm] = out.get()
        proc.join()
        print(f"{arm}: {figures[arm]}", flush=True)
    full = figures.get("full")
    rows = [[arm, f"{f['trainable']:,}", f"{f['step_s']:.2f}", f"{f['peak_rss_mb']:,.0f}", f"{f['state_mb']:,.1f}",
             f"{f['publish_s']:.3f}", f"{f['version_mb']:,.1f}",
             f"{f['step_s'] / full['step_s']:.2f}" if full else "-",
             f"{f['peak_rss_mb'] / full['peak_rss_mb']:.2f}" if full else "-"] for arm, f in figures.items()]
    _common.table(f"Learner, AdamW, full vs LoRA ({os.path.basename(model.rstrip('/'))}; "
                  f"{' '.join(sizes)}; median of {args.steps} steps, 1 thread{', bf16 autocast' if real else ''})",
                  ["arm", "trainable", "step s", "peak RSS MiB", "optimizer state MiB", "publish s", "version MiB",
                   "step ÷ full", "RSS ÷ full"], rows)
    _common.write_results("lora_quick" if args.quick else f"lora_{'smollm2' if real else 'embedded'}",
                          {"model": model, "overrides": overrides, "figures": figures})


if __name__ == "__main__":
    main()
