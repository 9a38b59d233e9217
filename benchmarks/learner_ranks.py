"""The learner on R data-parallel ranks (issue 12): step time with 1 and R ranks, optimizer-state
bytes per rank against R, and the time to publish a version from the sharded learner.

Both sides on the same machine in one run, on the same step's inputs: one learner actor (what
`learner.ranks=1` runs) and a group of R rank actors (`learner.ranks=R`, gloo on CPU), each rank
with `runtime.learner_cpus` CPUs. A step's inputs are `runtime.prompts_per_step` groups of
`algo.group_size` completions of `sampler.max_new_tokens` random tokens (the learner's work does
not depend on what the tokens say). Figures per side: the learner's own step time (median of
`step_time_s` over the timed steps), the wall time of a `step` call seen from the driver, the
wall time of `published()` (rank 0 gathering m and σ from the owners; one learner copying them),
and the optimizer-state bytes each rank holds (IVON: m, h, g_m of its tensors). Bytes for R beyond
those started are computed from the owner map (`shard_by_numel`), marked "computed".

    python3 benchmarks/learner_ranks.py [--ranks 2] [--steps 5] [section.field=value ...]
"""

from __future__ import annotations

import statistics
import time

import _common


def step_inputs(model: str, cfg, seed: int = 0):
    """(groups, [CompletionBatch], [ScoreBatch]) of one step: one batch holding every request."""
    import numpy as np

    from threepo.algorithms.exploration import make_plan
    from threepo.algorithms.weight_checks import weights_checksum
    from threepo.services.model.modeling import load_model, load_tokenizer, trainable_named_parameters
    from threepo.services.wire.batching import completion_batch, score_batch
    from threepo.services.wire.messages import GeneratedSample, GroupRows, RolloutRequest, VerifyResult, VerifyStatus

    a, rng = cfg.algo, np.random.default_rng(seed)
    tokenizer = load_tokenizer(model)
    checksum = weights_checksum(trainable_named_parameters(load_model(model)))
    plan = make_plan(a.exploration, version=0, base_seed=cfg.seed, group_size=a.group_size, n_slots=a.n_slots)
    requests, prompts, samples, groups, row = [], [], [], [], 0
    for item in _common.task_prompts(cfg.runtime.prompts_per_step, seed):
        prompt = tuple(tokenizer(item.prompt, add_special_tokens=False)["input_ids"])
        parts: dict[int, list] = {}
        for slot in plan.slots:
            n = plan.rollouts_per_slot
            requests.append(RolloutRequest(f"{item.uid}/s{slot.index}", item.uid, item, 0, slot.index, slot.seed, n))
            prompts.append(prompt)
            tokens = rng.integers(3, len(tokenizer), size=(n, cfg.sampler.max_new_tokens))
            samples.append([GeneratedSample(tuple(t.tolist()), (-3.0,) * len(t), "length", "") for t in tokens])
            parts.setdefault(plan.group_of(slot.index), []).append((0, row, n))
            row += n
        groups += [GroupRows(f"{item.uid}/g{g}", item, 0, 0, tuple(p)) for g, p in parts.items()]
    batch = completion_batch(engine_id=0, incarnation="", policy_version=0, mean_checksum=checksum,
                             requests=requests, prompts=prompts, samples=samples, verified=[True] * len(requests),
                             first_seq_no=0, generate_s=0.0)
    rewards = rng.random(row) < 0.5
    scores = score_batch([VerifyResult(VerifyStatus.OK if r else VerifyStatus.WRONG, float(r)) for r in rewards], 0.0)
    return groups, [batch], [scores]


def measure(learner, inputs, steps: int) -> dict:
    """Step and publish times of a learner actor or group (`.remote` methods), after one warm-up step."""
    import ray

    groups, batches, scores = inputs
    ray.get(learner.published.remote("start"))
    ray.get(learner.step.remote(groups, 1, *batches, *scores))
    inner, wall, publish = [], [], []
    for _ in range(steps):
        started = time.perf_counter()
        result, _ = ray.get(learner.step.remote(groups, 1, *batches, *scores))
        wall.append(time.perf_counter() - started)
        inner.append(result.metrics["step_time_s"])
        started = time.perf_counter()
        ray.get(learner.published.remote())
        publish.append(time.perf_counter() - started)
    return {"step_s": statistics.median(inner), "step_wall_s": statistics.median(wall),
            "publish_s": statistics.median(publish), "step_s_all": inner, "publish_s_all": publish}


def main() -> None:
    import ray

    from threepo.algorithms.ivon_shard import shard_by_numel, shard_loads
    from threepo.deploy.actors import ACTOR_ENV
    from threepo.deploy.cluster import init_ray
    from threepo.deploy.learner_actor import LearnerActor
    from threepo.deploy.learner_group import start_learner_group
    from threepo.services.learner.core import Learner
    from threepo.services.model.modeling import load_model, trainable_named_parameters

    p = _common.parser(__doc__)
    p.add_argument("--ranks", type=int, default=2, help="R of the group (the other side is one learner)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side (after one warm-up step)")
    args = p.parse_args()
    if args.quick:
        args.steps = 2
    model = _common.model_path(args)
    quick = ["runtime.prompts_per_step=2", "algo.group_size=8"] if args.quick else []
    cfg = _common.config(model, [*quick, *args.overrides, f"learner.ranks={args.ranks}"])
    rt, env = cfg.runtime, {"env_vars": ACTOR_ENV}
    init_ray(cfg)
    inputs = step_inputs(model, cfg)
    learner_args = (model, cfg.algo, cfg.optim, cfg.sync)
    kwargs = dict(temperature=cfg.sampler.temperature, max_new_tokens=cfg.sampler.max_new_tokens,
                  threads=max(1, int(rt.learner_cpus)), deepspeed_stage=cfg.learner.deepspeed_stage)
    figures = {}
    alone = {**kwargs, "deepspeed_stage": -1}  # one learner: plain AdamW or IVON
    one = ray.remote(LearnerActor).options(num_cpus=rt.learner_cpus, runtime_env=env).remote(*learner_args, **alone)
    try:
        figures[1] = measure(one, inputs, args.steps)
    finally:
        ray.kill(one)
    group = start_learner_group(cfg, "bench-learner", env, learner_args, kwargs)
    try:
        figures[args.ranks] = measure(group, inputs, args.steps)
        figures[args.ranks]["state_bytes"] = ray.get(group.state_bytes())
    finally:
        group.kill()
    local = Learner(*learner_args, **alone)
    local.step(*inputs)  # AdamW's moments exist after a step
    figures[1]["state_bytes"] = [local.optimizer.state_bytes()]
    numels = [(n, q.numel()) for n, q in trainable_named_parameters(load_model(model))]
    per_param = figures[1]["state_bytes"][0] / sum(n for _, n in numels)
    rows = []
    for r in sorted({1, args.ranks, 4, 8} if cfg.optim.name == "ivon" else {1, args.ranks}):
        measured = figures.get(r, {}).get("state_bytes")
        loads = measured or [round(per_param * n) for n in shard_loads(shard_by_numel(numels, r), numels, r)]
        rows.append([r, f"{max(loads):,}", f"{max(loads) / figures[1]['state_bytes'][0]:.3f}", f"{1 / r:.3f}",
                     "measured" if measured else "computed"])
    _common.table(f"Optimizer-state bytes per rank ({cfg.optim.name}, {sum(n for _, n in numels):,} parameters)",
                  ["R", "largest rank", "÷ one learner", "1/R", ""], rows)
    one_f, many = figures[1], figures[args.ranks]
    _common.table(f"Learner step and publish ({len(inputs[0])} groups × {cfg.algo.group_size}, "
                  f"{cfg.sampler.max_new_tokens} tokens; {rt.learner_cpus:g} CPU per rank; median of {args.steps})",
                  ["ranks", "step_time_s", "step wall s", "publish s"],
                  [[1, one_f["step_s"], one_f["step_wall_s"], one_f["publish_s"]],
                   [args.ranks, many["step_s"], many["step_wall_s"], many["publish_s"]]])
    print(f"step time {args.ranks} ranks ÷ 1: {many['step_s'] / one_f['step_s']:.2f}; "
          f"publish {args.ranks} ranks ÷ 1: {many['publish_s'] / one_f['publish_s']:.2f}")
    _common.write_results("learner_ranks", {"model": model, "ranks": args.ranks, "figures": figures,
                                            "state_rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
