"""Pipeline efficiency: end-to-end generated tokens/s of a `threepo train` run divided by the same
sampler engines' standalone tokens/s (issue 4 target: at least 0.9).

1. Standalone: `runtime.num_samplers` sampler actors, with the run's resources and sampler config,
   hold one posterior version (the checkpoint as mean, IVON's initial σ) and generate the requests a
   run admits (every slot of the plan, `n` rollouts per slot, routed and chunked as the driver does)
   for `--steps` steps' worth of prompts, all queued at once, with nothing else running.
2. Training: a real run (driver, learner, verifier, samplers on local Ray) of `--steps` steps;
   tokens/s = completion tokens of steps 2..T-1 / wall time from the end of step 1 to the end of
   step T-1 (step 1 is warm-up; _common.loop_figures says why step T is left out).

3. Engine busy fraction: each engine's generating seconds ÷ wall time over the same steps, from the
   run's metrics.jsonl (`engine_busy/engine<i>`, weighted by each step's window; issue 10 target:
   at least 0.8 for the engine that does not share its core with the learner — the busiest one).

The ratio is bounded by the learner when one learner step takes longer than generating one step's
rollouts: admission control (runtime.max_offpolicy) then idles the samplers. Both figures are given.
On a 2-core machine the learner and the samplers also share the cores, which the standalone
measurement does not pay.

    python3 benchmarks/pipeline_efficiency.py [--steps 10] [section.field=value ...]
"""

from __future__ import annotations

import time

import _common


def requests_by_sampler(cfg, plan, prompts: int, first: int = 0) -> dict[int, list]:
    """The driver's requests for `prompts` prompts (one per slot), routed slot-major to samplers."""
    from threepo.services.wire.messages import RolloutRequest

    items = _common.task_prompts(first + prompts)
    out: dict[int, list] = {}
    for index in range(first, first + prompts):
        for slot in plan.slots:
            group_id = f"p{index}/g{plan.group_of(slot.index)}"
            request = RolloutRequest(request_id=f"{group_id}/s{slot.index}", group_id=group_id, item=items[index],
                                     policy_version=plan.version, slot=slot.index, slot_seed=slot.seed,
                                     n=plan.rollouts_per_slot)
            out.setdefault((slot.index + index) % cfg.runtime.num_samplers, []).append(request)
    return out


def generate_all(samplers: list, cfg, by_sampler: dict[int, list], weights) -> int:
    """Queue every chunk on its sampler at once (with the reference to its version's weights, as
    the driver sends them); the completion tokens generated, from the calls' reports."""
    import ray

    per_call = cfg.runtime.requests_per_call
    reports = [samplers[i].generate.remote(batch[k:k + per_call], [weights])[0]
               for i, batch in by_sampler.items() for k in range(0, len(batch), per_call)]
    return sum(r.tokens for r in ray.get(reports))


def standalone(model: str, cfg, steps: int) -> dict:
    """Tokens/s of the run's sampler actors alone (see the module docstring, 1.)."""
    import ray
    import torch

    from threepo.algorithms.exploration import make_plan
    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.deploy.actors import ACTOR_ENV, SamplerActor
    from threepo.deploy.cluster import init_ray

    init_ray(cfg)
    rt, algo = cfg.runtime, cfg.algo
    samplers = [ray.remote(SamplerActor).options(num_cpus=rt.sampler_cpus, runtime_env={"env_vars": ACTOR_ENV})
                .remote(model, cfg.sampler, i, cfg.model.dtype) for i in range(rt.num_samplers)]
    try:
        plan = make_plan(algo.exploration, version=1, base_seed=cfg.seed, group_size=algo.group_size,
                         n_slots=algo.n_slots, equal_compute=algo.equal_compute)
        mean, sigma = _common.posterior_arrays(model, cfg)
        weights = ray.put((mean, sigma, weights_checksum((n, torch.from_numpy(a)) for n, a in mean.items())))
        generate_all(samplers, cfg, requests_by_sampler(cfg, plan, rt.prompts_per_step), weights)  # warm-up step
        work = requests_by_sampler(cfg, plan, steps * rt.prompts_per_step, first=rt.prompts_per_step)
        start = time.monotonic()
        tokens = generate_all(samplers, cfg, work, weights)
        elapsed = time.monotonic() - start
    finally:
        for s in samplers:
            ray.kill(s, no_restart=True)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "tokens_per_step": tokens / steps}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--steps", type=int, default=20, help="timed steps (the training run does two more: warm-up and drain)")
    args = p.parse_args()
    if args.quick:
        args.steps = 3
    model = _common.model_path(args)
    overrides = [*(["runtime.prompts_per_step=4", "algo.group_size=8"] if args.quick else []), *args.overrides]
    cfg = _common.config(model, overrides)
    alone = standalone(model, cfg, args.steps)
    run = _common.train_run(model, [*overrides, f"runtime.steps={args.steps + 2}"], "train")
    ratio = run["tokens_per_s"] / alone["tokens_per_s"]
    generation_s = run["tokens_per_step"] / alone["tokens_per_s"]
    rt = cfg.runtime
    _common.table(f"Pipeline efficiency: {rt.num_samplers} samplers x {rt.sampler_cpus:g} CPU, learner "
                  f"{rt.learner_cpus:g} CPU, {cfg.algo.exploration} N={cfg.algo.n_slots} G={cfg.algo.group_size}, "
                  f"{rt.prompts_per_step} prompts/step, mode {rt.mode}",
                  ["measurement", "tokens", "seconds", "tokens/s"],
                  [["samplers alone", alone["tokens"], alone["seconds"], alone["tokens_per_s"]],
                   ["train run (steps 2..T-1)", run["timed_tokens"],
                    run["loop_wall_s"], run["tokens_per_s"]]])
    bound = "learner-bound" if run["learner_step_s"] > generation_s else "generation-bound"
    print(f"pipeline efficiency = {ratio:.2f} (target >= 0.9)")
    print(f"per step: generating its {run['tokens_per_step']:.0f} tokens takes {generation_s:.2f}s on the idle "
          f"samplers, the learner step {run['learner_step_s']:.2f}s, a step of the run {run['step_wall_s']:.2f}s "
          f"-> {bound}")
    if bound == "learner-bound":
        print(f"  the samplers can be busy at most {generation_s / run['learner_step_s']:.2f} of the time: "
              "admission control (runtime.max_offpolicy) waits for the learner")
    busy = run["engine_busy"]
    engines = {k: v for k, v in busy.items() if k != "mean"}
    if engines:
        print("engine busy fraction (steps 2..T-1): " + ", ".join(f"{k} {v:.2f}" for k, v in engines.items())
              + f"; mean {busy['mean']:.2f}, busiest {max(engines.values()):.2f} (target >= 0.8)")
    extra = run["step_wall_s"] - max(generation_s, run["learner_step_s"])
    print(f"  {max(extra, 0.0):.2f}s per step beyond the slower of the two: scoring, driver round trips, version "
          "syncs, and the learner sharing the cores with the samplers (standalone they do not)")
    _common.write_results("pipeline_efficiency", {
        "model": model, "standalone": alone, "train": {k: v for k, v in run.items() if k != "rows"},
        "rows": run["rows"], "ratio": ratio, "engine_busy": busy, "generation_s_per_step": generation_s, "bound": bound,
        "args": vars(args)})


if __name__ == "__main__":
    main()
