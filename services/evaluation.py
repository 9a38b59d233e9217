"""pass@1, pass@k and the malformed rate of a policy on a list of items (`threepo eval`, bootstrap).

The policy is anything that maps prompts to samples (`GenerateFn`): `engines.hf.generate_text` bound
to a model (an engine's, or one being trained). Verification goes through the same verifiers
the runtime uses, so an evaluation scores exactly like training does.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from threepo.algorithms.pass_at_k import pass_at_k
from threepo.services.engines.base import GeneratedSample
from threepo.services.messages import SamplingParams, TaskItem, VerifyRequest, VerifyStatus
from threepo.services.verifiers.base import Verifier, load_verifier

GenerateFn = Callable[[Sequence[str], SamplingParams], list[list[GeneratedSample]]]


@dataclass(frozen=True)
class EvalConfig:
    """What `threepo eval` (and the before/after evaluation of `threepo train`) measures."""

    split: str = "heldout"
    """Task split to evaluate on (`train` or `heldout`); ignored when `data.path` names a dataset."""
    num_items: int = 256
    """How many items to evaluate."""
    samples_per_item: int = 8
    """Samples drawn per item (n of the unbiased pass@k estimator)."""
    k: int = 4
    """The k of pass@k (≤ samples_per_item)."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation."""
    batch_size: int = 256
    """Sequences decoded together."""
    around_training: bool = True
    """`threepo train` evaluates held-out before and after training, in the driver's process
    (false: only the periodic evaluations of `runtime.eval_every`)."""

    def __post_init__(self) -> None:
        if self.split not in ("train", "heldout"):
            raise ValueError(f"eval.split: expected 'train' or 'heldout', got {self.split!r}")
        if not 1 <= self.k <= self.samples_per_item:
            raise ValueError(f"eval.k={self.k}: expected 1 <= k <= eval.samples_per_item={self.samples_per_item}")
        if self.num_items < 1:
            raise ValueError(f"eval.num_items: expected >= 1, got {self.num_items}")


@dataclass(frozen=True)
class EvalReport:
    num_items: int
    samples_per_item: int
    k: int
    pass_at_1: float
    pass_at_k: float
    malformed_rate: float
    status_counts: Mapping[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"pass@1 {self.pass_at_1:.3f}  pass@{self.k} {self.pass_at_k:.3f}  "
                f"malformed {self.malformed_rate:.3f}  ({self.num_items} items x {self.samples_per_item} samples)")


def evaluate(generate: GenerateFn, items: Sequence[TaskItem], verifiers: Mapping[str, Verifier], *,
             samples_per_item: int, k: int, temperature: float, max_new_tokens: int,
             batch_size: int = 256, progress: Callable[[int], None] | None = None) -> EvalReport:
    """Sample `samples_per_item` completions per item, verify them, and estimate pass@1 / pass@k."""
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=samples_per_item)
    correct, statuses = [], Counter()
    for start in range(0, len(items), max(1, batch_size // samples_per_item)):
        chunk = items[start:start + max(1, batch_size // samples_per_item)]
        samples = generate([it.prompt for it in chunk], params)
        results = verify_all(verifiers, [VerifyRequest(item=it, completion=s.text, finish_reason=s.finish_reason)
                                         for it, group in zip(chunk, samples) for s in group])
        for i in range(len(chunk)):
            group = results[i * samples_per_item:(i + 1) * samples_per_item]
            correct.append(sum(r.status is VerifyStatus.OK for r in group))
            statuses.update(r.status.value for r in group)
        if progress is not None:
            progress(len(chunk))
    infra = statuses.get(VerifyStatus.INFRA_ERROR.value, 0)
    if infra:
        raise RuntimeError(f"{infra} verifications failed with infra_error: the evaluation would be biased")
    total, n = len(items) * samples_per_item, [samples_per_item] * len(items)
    return EvalReport(
        num_items=len(items), samples_per_item=samples_per_item, k=k,
        pass_at_1=float(pass_at_k(n, correct, 1).mean()),
        pass_at_k=float(pass_at_k(n, correct, k).mean()),
        malformed_rate=statuses.get(VerifyStatus.MALFORMED.value, 0) / total,
        status_counts=dict(statuses),
    )


def verifiers_for(items: Sequence[TaskItem]) -> dict[str, Verifier]:
    """One verifier (default options) per verifier name the items use."""
    return {name: load_verifier(name) for name in sorted({it.verifier for it in items})}


def model_pass_at_1(model, tokenizer, items: Sequence[TaskItem], *, temperature: float,
                    max_new_tokens: int) -> float:
    """pass@1 of a live model (one sample per item), e.g. the learner's copy or one being trained;
    the model is put in eval mode for the call and its previous mode restored."""
    from threepo.services.engines.hf import generate_text

    verifiers, was_training = verifiers_for(items), model.training
    model.eval()
    try:
        report = evaluate(lambda p, params: generate_text(model, tokenizer, p, params, batch_size=256), items,
                          verifiers, samples_per_item=1, k=1, temperature=temperature,
                          max_new_tokens=max_new_tokens)
    finally:
        model.train(was_training)
        for verifier in verifiers.values():
            verifier.close()
    return report.pass_at_1


def verify_all(verifiers: Mapping[str, Verifier], requests: Sequence[VerifyRequest]):
    """Verify on the calling thread (math-verify's SIGALRM timeouts need the main thread)."""
    async def run():
        return [await verifiers[r.item.verifier].verify(r) for r in requests]
    missing = sorted({r.item.verifier for r in requests} - set(verifiers))
    if missing:
        raise KeyError(f"no verifier loaded for {missing}: items name verifiers {sorted(verifiers)} lack")
    return asyncio.run(run())
