"""pass@1, pass@k, the malformed and truncated rates of a policy on a list of items (`threepo eval`, the
evaluations around and during `threepo train`, the bootstrap).

`evaluate` asks a policy — anything that samples engine requests (`GenerateFn`) — for completions of
the items' prompts, encoded by the model's `PromptEncoder` (services/tasks/prompting.py, as in training),
and scores them through a `VerifierPool` (services/verifiers/pool.py) as training does — the same
verifiers, routes, concurrency and retries of infrastructure failures — so an evaluation scores
exactly like training. Temperature 0 is greedy. `Evaluator` is the one evaluation service, built
the same way by every caller: an hf engine serving a checkpoint or a published mean (the CLI, the
evaluations around training, the evaluator actor) or a live model (the bootstrap), with its encoder
and a verifier pool built from the run's `[verifier]`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from threepo.algorithms.pass_at_k import pass_at_k
from threepo.services.sampling.engines.base import EngineRequest
from threepo.services.verifiers.pool import VerifierConfig, VerifierPool
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
from threepo.services.wire.messages import (GeneratedSample, SamplingParams, TaskItem, VerifyRequest, VerifyResult,
                                            VerifyStatus)

if TYPE_CHECKING:
    from threepo.services.tasks.prompting import PromptEncoder

GenerateFn = Callable[[Sequence[EngineRequest], SamplingParams], list[list[GeneratedSample]]]
VerifyFn = Callable[[list[VerifyRequest]], list[VerifyResult]]  # e.g. VerifierPool.verify_batch
TRUNCATION_WARNING = 0.05  # a share of completions cut at the length limit worth a warning


@dataclass(frozen=True)
class EvalConfig:
    """What `threepo eval` (and the before/after evaluation of `threepo train`) measures."""

    split: str = "heldout"
    """Task split to evaluate on (`train` or `heldout`); ignored when `data.path` names a dataset."""
    num_items: int = 256
    """How many items to evaluate."""
    samples_per_item: int = 8
    """Samples drawn per item (n of the unbiased pass@k estimator)."""
    k: int | Literal["auto"] = "auto"
    """The k of pass@k (≤ samples_per_item); auto = min(4, samples_per_item)."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation; 0 = greedy decoding."""
    batch_size: int = 256
    """Sequences decoded together."""
    around_training: bool = True
    """`threepo train` evaluates held-out before and after training, in the driver's process
    (false: only the periodic evaluations of `runtime.eval_every`)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where evaluation decodes (the hf engine's `sampler.device`): `threepo eval` and the evaluation
    around training in the driver's process, and the evaluator actor of `runtime.eval_every`, which
    then asks Ray for one GPU. On a cluster whose head has no GPU, set `eval.around_training=false`."""

    def __post_init__(self) -> None:
        if self.split not in ("train", "heldout"):
            raise ValueError(f"eval.split: expected 'train' or 'heldout', got {self.split!r}")
        if self.k == "auto":
            object.__setattr__(self, "k", min(4, self.samples_per_item))
        if self.samples_per_item < 1:
            raise ValueError(f"eval.samples_per_item: expected >= 1, got {self.samples_per_item}")
        if not 1 <= self.k <= self.samples_per_item:
            raise ValueError(f"eval.k={self.k}: expected 1 <= k <= eval.samples_per_item={self.samples_per_item}")
        if self.num_items < 1:
            raise ValueError(f"eval.num_items: expected >= 1, got {self.num_items}")
        if not self.temperature >= 0:
            raise ValueError(f"eval.temperature: expected >= 0 (0 = greedy), got {self.temperature}")


@dataclass(frozen=True)
class EvalReport:
    num_items: int
    samples_per_item: int
    k: int
    pass_at_1: float
    pass_at_k: float
    malformed_rate: float
    status_counts: Mapping[str, int] = field(default_factory=dict)
    truncated_rate: float = 0.0  # share of completions cut at the length limit
    temperature: float = 1.0
    correct: tuple[int, ...] = ()  # per item, how many of its samples passed: pass@k for any k <= n

    def pass_at(self, k: int) -> float:
        """pass@k over the items for any k <= samples_per_item (the unbiased estimator)."""
        if not 1 <= k <= self.samples_per_item:
            raise ValueError(f"k={k}: expected 1 <= k <= samples_per_item={self.samples_per_item}")
        return float(pass_at_k([self.samples_per_item] * len(self.correct), list(self.correct), k).mean())

    def summary(self) -> str:
        how = "greedy" if self.temperature == 0 else f"T {self.temperature:g}"
        cut = (f"  truncated {self.truncated_rate:.3f} (over {TRUNCATION_WARNING:.0%}: raise sampler.max_new_tokens)"
               if self.truncated_rate > TRUNCATION_WARNING else "")
        at_k = f"pass@{self.k} {self.pass_at_k:.3f}  " if self.k > 1 else ""
        return (f"pass@1 {self.pass_at_1:.3f}  {at_k}"
                f"malformed {self.malformed_rate:.3f}  ({self.num_items} items x {self.samples_per_item} samples, "
                f"{how}){cut}")


def requests_for(prompt_ids: Sequence[Sequence[int]], n: int, seed: int = 0) -> list[EngineRequest]:
    """Engine requests for encoded prompts: prompt i of the call draws from its own stream, hashed
    from (seed, i, its ids), whatever else is evaluated with it."""
    from threepo.algorithms.param_noise import tensor_seed  # torch: only once a policy is evaluated

    return [EngineRequest(tuple(ids), n, tensor_seed(seed, f"{i}/{list(ids)}")) for i, ids in enumerate(prompt_ids)]


def evaluate(generate: GenerateFn, items: Sequence[TaskItem], verify: VerifyFn,
             prompts: PromptEncoder, *, samples_per_item: int, k: int, temperature: float, max_new_tokens: int,
             batch_size: int = 256, seed: int = 0, progress: Callable[[int], None] | None = None) -> EvalReport:
    """Sample `samples_per_item` completions per item, verify them, and estimate pass@1 / pass@k."""
    from threepo.algorithms.param_noise import tensor_seed

    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=samples_per_item,
                            stop_token_ids=prompts.stop_ids)
    correct, statuses, cut = [], Counter(), 0
    per_call = max(1, batch_size // samples_per_item)
    for start in range(0, len(items), per_call):
        chunk = items[start:start + per_call]
        # item i of a chunk draws from a stream hashed from (seed, i, its prompt)
        samples = generate([EngineRequest(prompts.encode(it.prompt, it.verifier), samples_per_item,
                                          tensor_seed(seed, f"{i}/{it.prompt}")) for i, it in enumerate(chunk)], params)
        cut += sum(s.finish_reason == "length" for group in samples for s in group)
        results = verify([VerifyRequest(item=it, completion=s.text, finish_reason=s.finish_reason)
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
        status_counts=dict(statuses), truncated_rate=cut / total, temperature=temperature, correct=tuple(correct),
    )


class Evaluator:
    """The evaluation service: a policy's completions of `items`, encoded by `prompts`, scored by a
    verifier pool built from the run's `[verifier]` and `[sandbox]` (`verifier`, `sandbox`; the remote
    sandbox's `token`, read from `sandbox.auth_env` in this process when None), as training scores them. The policy is an hf engine serving a checkpoint (`serving`: `threepo
    eval`, the evaluations around training, the evaluator actor, which `load`s each published mean)
    or a live model (`of_model`: the bootstrap). Close it to free the engine and the pool."""

    def __init__(self, generate: GenerateFn, items: Sequence[TaskItem], verifier: VerifierConfig, prompts,
                 *, sandbox: RemoteSandboxConfig | None = None, token: str | None = None, batch_size: int = 256,
                 seed: int = 0, engine=None) -> None:
        self.generate, self.items, self.prompts = generate, list(items), prompts
        sandbox = sandbox or RemoteSandboxConfig()
        self.pool = VerifierPool(verifier, sandbox=sandbox, token=sandbox.token() if token is None else token)
        self.batch_size, self.seed, self.engine = batch_size, seed, engine

    @classmethod
    def serving(cls, model_path: str, items: Sequence[TaskItem], verifier: VerifierConfig, prompt_cfg,
                engine_cfg, *, sandbox: RemoteSandboxConfig | None = None, token: str | None = None,
                dtype: str = "float32", seed: int = 0) -> Evaluator:
        """An hf engine serving the checkpoint at `model_path` (or a mean given to `load`); `engine_cfg`:
        its sampler settings (threads, batch size, device)."""
        from threepo.services.sampling.engines.hf import HFEngine
        from threepo.services.tasks.prompting import PromptEncoder

        engine = HFEngine(model_path, engine_cfg, dtype=dtype)
        return cls(engine.generate, items, verifier, PromptEncoder.from_path(model_path, prompt_cfg), sandbox=sandbox,
                   token=token, batch_size=engine_cfg.batch_size, seed=seed, engine=engine)

    @classmethod
    def of_model(cls, model, prompts: PromptEncoder, items: Sequence[TaskItem],
                 verifier: VerifierConfig | None = None) -> Evaluator:
        """A live model (e.g. one being trained) as its weights are now, decoded in eval mode by the hf
        engine's loop (the lean decoder copies them once, here: build one per evaluation)."""
        from threepo.services.sampling.engines.decoding import generate, own_decoder

        lean = own_decoder(model)

        def sample(requests, params):
            was_training = model.training
            model.eval()
            try:
                return generate(model, prompts.tokenizer, requests, params, batch_size=256, lean=lean)
            finally:
                model.train(was_training)

        return cls(sample, items, verifier or VerifierConfig(), prompts)

    def load(self, mean: Mapping, mean_checksum: str, lora: tuple | None = None) -> None:
        """Serve a published mean (the evaluations during training; `lora` = (r, α): a LoRA adapter's
        mean, over the base the engine loaded)."""
        self.engine.load_version(self.engine.version + 1, mean, None, mean_checksum, lora=lora)

    def evaluate(self, *, samples_per_item: int, k: int, temperature: float, max_new_tokens: int,
                 progress: Callable[[int], None] | None = None) -> EvalReport:
        return evaluate(self.generate, self.items, self.pool.verify_batch, self.prompts,
                        samples_per_item=samples_per_item, k=k, temperature=temperature,
                        max_new_tokens=max_new_tokens, batch_size=self.batch_size, seed=self.seed,
                        progress=progress)

    def close(self) -> None:
        self.pool.close()
        if self.engine is not None:
            self.engine.close()
