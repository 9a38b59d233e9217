"""hf vs vllm sampler engines on the same checkpoint: tokens/s, time to switch slots, time to take a
new version; then (unless `--no-train`) `threepo train` wall time with each backend at equal rollouts.

Each engine runs alone in its own process (one torch thread, the sampler layout), one after the
other: 64 prompts x 32 new tokens, fp32, T=1, on default-task prompts; a slot switch is `serve` of
another seed of the held version (θ̂ built from m and σ, loaded, verified); a new version is
`load_version` of a fresh (m, σ) (checksum check, mean served). The training comparison runs the
default configuration with `sampler.backend` hf and vllm, the same steps and prompts per step.

    python3 benchmarks/engine_backends.py                 # embedded default model
    python3 benchmarks/engine_backends.py --quick --model tiny
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import _common


def engine_figures(backend: str, model: str, prompts: list[str], max_new_tokens: int, repeats: int) -> dict:
    """Runs in a fresh process: start the engine, then time generate, serve and load_version."""
    import numpy as np
    import torch

    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.deploy.actors import make_engine
    from threepo.services.model.modeling import load_model, trainable_named_parameters
    from threepo.services.sampling.engines.base import EngineRequest, SamplerConfig
    from threepo.services.wire.messages import NoiseSpec, SamplingParams

    started = time.perf_counter()
    engine = make_engine(model, SamplerConfig(backend=backend, batch_size=len(prompts), threads=1), 0, "float32")
    start_s = time.perf_counter() - started
    mean = {n: p.detach().numpy().copy() for n, p in trainable_named_parameters(load_model(model))}
    sigma = {n: np.full(a.shape, 0.01, np.float32) for n, a in mean.items()}
    checksum = weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())
    engine.load_version(1, mean, sigma, checksum)
    from threepo.services.tasks.prompting import PromptConfig, PromptEncoder

    encoder = PromptEncoder.from_path(model, PromptConfig())
    requests = [EngineRequest(encoder.encode(p), 1, 1000 + i) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=encoder.stop_ids)
    engine.generate(requests, params)  # warm-up
    rates, serves, loads = [], [], []
    for k in range(repeats):
        t = time.perf_counter()
        out = engine.generate(requests, params)
        rates.append(sum(len(s.token_ids) for group in out for s in group) / (time.perf_counter() - t))
        t = time.perf_counter()
        assert engine.serve(NoiseSpec(1 + k, 7 + k)).loaded_ok
        serves.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.load_version(2 + k, mean, sigma, checksum)
        loads.append(time.perf_counter() - t)
    return {"backend": backend, "start_s": start_s, "tokens_per_s": statistics.median(rates),
            "serve_s": statistics.median(serves), "load_version_s": statistics.median(loads)}


def _child(args, queue) -> None:
    queue.put(engine_figures(*args))


def in_process(*args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(args, queue))
    proc.start()
    out = queue.get(timeout=1200)
    proc.join()
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="learner steps of each training run")
    p.add_argument("--no-train", action="store_true", help="engine figures only")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps = 2, 4
    model = _common.model_path(args)
    prompts = [it.prompt for it in _common.task_prompts(args.prompts)]
    figures = [in_process(b, model, prompts, args.max_new_tokens, args.repeats) for b in ("hf", "vllm")]
    rows = [[f["backend"], f"{f['start_s']:.1f}", f"{f['tokens_per_s']:,.0f}", f"{1e3 * f['serve_s']:.1f}",
             f"{1e3 * f['load_version_s']:.1f}"] for f in figures]
    _common.table(f"engines: {args.prompts} prompts x {args.max_new_tokens} tokens, fp32, 1 thread",
                  ["backend", "start s", "tokens/s", "slot switch ms", "new version ms"], rows)
    hf, vllm = figures
    print(f"vllm / hf tokens/s: {vllm['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    results = {"model": model, "engines": figures, "args": vars(args)}
    if not args.no_train:
        runs = {b: _common.train_run(model, [f"sampler.backend={b}", f"runtime.steps={args.steps}", *args.overrides],
                                     f"train {b}") for b in ("hf", "vllm")}
        trows = [[b, r["summary"]["consumed_rollouts"], f"{r['summary']['wall_s']:.1f}",
                  f"{r['rollouts_per_s']:.0f}", f"{r['rows'][-1]['reward_mean']:.3f}"] for b, r in runs.items()]
        _common.table("threepo train at equal rollouts", ["backend", "rollouts", "wall s", "rollouts/s (loop)",
                                                          "final reward"], trows)
        print(f"vllm / hf train wall: {runs['vllm']['summary']['wall_s'] / runs['hf']['summary']['wall_s']:.2f}x")
        results["train"] = {b: {k: v for k, v in r.items() if k != "rows"} for b, r in runs.items()}
    _common.write_results("engine_backends", results)


if __name__ == "__main__":
    main()
