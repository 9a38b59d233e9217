"""A learner step's worth of real rollouts without Ray: the hf engine samples every slot of a plan at
the learner's published version, rewards are seeded coin flips, and the groups take the path the
runtime's arrays take (`batching.batches_from_groups`). Used by the GPU tier and benchmarks/gpu_check.py;
needs only torch, transformers, numpy and threepo."""

from __future__ import annotations

import random

from threepo.algorithms.exploration import make_plan
from threepo.services.sampling.engines.base import EngineRequest
from threepo.services.tasks.synthetic import generate_items
from threepo.services.wire.batching import batches_from_groups
from threepo.services.wire.messages import (Completion, Group, NoiseSpec, SamplingParams, ScoredCompletion,
                                            VerifyResult, VerifyStatus)


def sampled_groups(engine, learner, exploration: str, n_slots: int, group_size: int, prompts: int,
                   max_new_tokens: int, seed: int = 0) -> list[Group]:
    """Groups of `prompts` arith items, every slot of `exploration`'s plan sampled by `engine` at the
    learner's published (m, σ) (loaded as engine version 1), rewards 0/1 drawn from `seed`."""
    pv = learner.published()
    engine.load_version(1, pv.mean, pv.sigma, pv.mean_checksum)
    plan = make_plan(exploration, version=1, base_seed=seed, group_size=group_size, n_slots=n_slots)
    items = generate_items("arith", "train", prompts, seed=seed + 1)
    ids = {it.uid: tuple(engine.tokenizer(it.prompt, add_special_tokens=False)["input_ids"]) for it in items}
    calls = [(NoiseSpec(1, seed=slot.seed, scale=slot.scale),
              [EngineRequest(ids[it.uid], plan.rollouts_per_slot, seed=seed * 7919 + i) for i, it in enumerate(items)])
             for slot in plan.slots]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                            stop_token_ids=(engine.tokenizer.eos_token_id,))
    results = engine.generate_slots(calls, params)
    coin = random.Random(seed)
    by_group: dict[tuple[str, int], list[ScoredCompletion]] = {}
    for slot, (report, unchanged, per_request) in zip(plan.slots, results):
        for item, samples in zip(items, per_request):
            for j, s in enumerate(samples):
                c = Completion(completion_id=f"{item.uid}/{slot.index}/{j}", request_id=f"{item.uid}/s{slot.index}",
                               group_id=item.uid, slot=slot.index, prompt_uid=item.uid, engine_id=0, seq_no=0,
                               policy_version=0, slot_seed=slot.seed, mean_checksum=pv.mean_checksum,
                               weights_verified=report.loaded_ok and unchanged, prompt_ids=ids[item.uid],
                               token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason,
                               text=s.text, slot_scale=slot.scale)
                ok = coin.random() < 0.5
                result = VerifyResult(VerifyStatus.OK if ok else VerifyStatus.WRONG, float(ok))
                by_group.setdefault((item.uid, plan.group_of(slot.index)), []).append(ScoredCompletion(c, result))
    by_item = {it.uid: it for it in items}
    return [Group(f"{uid}/g{g}", by_item[uid], 0, 0, tuple(done)) for (uid, g), done in by_group.items()]


def step(learner, groups: list[Group]):
    """One learner step on `groups`, through the array path the runtime uses."""
    return learner.step(*batches_from_groups(groups))
