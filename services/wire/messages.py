"""Typed, frozen messages that cross role boundaries (driver, samplers, verifiers, learner).

Every message is a frozen dataclass; none is a free-form dict. Arrays travel as numpy (Ray moves
numpy zero-copy, torch tensors with a pickle copy). The hot path is arrays: a sampler call returns a
`CompletionBatch` (flat token / log-prob arrays with offsets) that goes by reference to a verifier
and to the learner, a verifier returns a `ScoreBatch`, and the driver sees only the small
`GenerateReport` and `ScoreBatch` and tells the learner which rows form each group (`GroupRows`).
`Completion`, `ScoredCompletion` and `Group` are the per-completion record form (tests, reading a
rollout log), built off the hot path by services/wire/batching.py; the rollout log itself keeps each
step's arrays (`ConsumedStep`). Messages that leave a process outside Ray
(rollout logs, the rollout buffer in checkpoints, remote verifiers) go through `services/wire/codec.py`,
which stamps them with `SCHEMA_VERSION`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from threepo.services.errors import UserInputError

if TYPE_CHECKING:
    import numpy as np

SCHEMA_VERSION = 6  # 2: Completion carries mean_checksum, weights_verified; 3: Group carries the step;
# 4: RolloutRequest and Completion carry the slot's σ multiplier (slot_scale); 5: TaskItem carries
# code_prefix and entry_point; 6: CompletionBatch carries the sampler's slot-KL measurements


class VerifyStatus(str, enum.Enum):
    """Outcome of one verification. Only `infra_error` says nothing about the completion."""

    OK = "ok"
    WRONG = "wrong"
    MALFORMED = "malformed"
    TIMEOUT = "timeout"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    INFRA_ERROR = "infra_error"


@dataclass(frozen=True)
class GeneratedSample:
    """What an engine returns for one sampled sequence (the Sampler service adds ids and tags: `Completion`); `completion_batch` in services/wire/batching.py packs them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (EOS sampled, the EOS token included) or "length"
    text: str


@dataclass(frozen=True)
class TaskItem:
    """One prompt with what is needed to score a completion of it.

    `verifier` names the verifier that scores it (`math`, `countdown`, `code_output`, `code_tests`
    or a plug-in's name). `answer` is the gold answer (for countdown: the target; for
    `code_output`: the expected stdout; unused by `code_tests`). `solution` is a reference solution
    (LamPO's ROUGE-L), and `tests` holds test statements for code tasks, run in order after the
    program (a `code_tests` item needs at least one). `numbers` are countdown's given numbers.
    `code_prefix` is code a body-only completion continues (HumanEval's prompt) and `entry_point` the
    function the tests call (services/verifiers/code_verifiers.py says how both are used).
    A `tests` given as one string, or a `code_tests` item without tests, is refused here.
    """

    uid: str
    prompt: str
    answer: str
    verifier: str = "math"
    solution: str = ""
    tests: tuple[str, ...] = ()
    numbers: tuple[int, ...] = ()
    family: str = ""
    difficulty: int = 0
    code_prefix: str = ""
    entry_point: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.tests, str) or not all(isinstance(t, str) for t in self.tests):
            raise UserInputError(f"TaskItem.tests of {self.uid!r}: expected a sequence of test statements "
                                 f"(strings), got {self.tests!r:.80}")
        if not isinstance(self.tests, tuple):
            object.__setattr__(self, "tests", tuple(self.tests))
        if self.verifier == "code_tests" and not self.tests:
            raise UserInputError(f"TaskItem.tests of {self.uid!r}: expected at least one test for the "
                                 "code_tests verifier, got none")


@dataclass(frozen=True)
class VerifyRequest:
    """A completion to score. `finish_reason` is `stop` (ended with EOS) or `length` (truncated)."""

    item: TaskItem
    completion: str
    finish_reason: str = "stop"


@dataclass(frozen=True)
class VerifyResult:
    """Status, reward and a short human-readable detail. `reward` is NaN for `infra_error`, so an
    infrastructure failure can never be mistaken for a zero reward."""

    status: VerifyStatus
    reward: float
    details: str = ""
    latency_s: float = 0.0


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generate call (engine-independent)."""

    temperature: float = 1.0  # 0 = greedy (evaluation only: the behaviour log-prob of a greedy token is 0)
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop ends the completion (kept in it); () = the tokenizer's EOS

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature: expected >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: expected >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError("SamplingParams.max_new_tokens and n: expected >= 1")


@dataclass(frozen=True)
class NoiseSpec:
    """Which perturbed policy to serve: θ̂ = m + c · σ ⊙ z(seed), c = `scale` (the slot's σ multiplier,
    `algorithms.exploration.Slot.scale`). `seed=None` serves the clean mean (c must be 1)."""

    posterior_version: int
    seed: int | None
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0 or (self.seed is None and self.scale != 1.0):
            raise ValueError(f"NoiseSpec.scale: expected > 0, and 1 for the mean (seed None), got {self.scale}")


@dataclass(frozen=True)
class RolloutRequest:
    """Driver -> sampler: `n` rollouts of `item` from slot `slot` of version `policy_version`, served as
    θ̂ = m + c · σ ⊙ z(slot_seed) with c = `slot_scale` (1 unless the prompt was re-admitted by
    dead-group-aware exploration).

    `request_id` is unique per admitted request and deterministic (group id + slot), so a request
    re-issued after a sampler crash yields completions with the same ids, which the driver's ledger
    then drops as duplicates (exactly-once consumption, services/ledger/ledger.py)."""

    request_id: str
    group_id: str
    item: TaskItem
    policy_version: int
    slot: int
    slot_seed: int | None
    n: int
    slot_scale: float = 1.0


@dataclass(frozen=True)
class Completion:
    """One sampled completion with everything the learner needs to correct for off-policyness.

    `logprobs` are the behaviour log-probs of the sampling distribution (after temperature, top-k,
    top-p), one per generated token, of the policy the engine served: θ̂ = m + c · σ ⊙ z(slot_seed),
    c = `slot_scale`. `mean_checksum` is the exact checksum of the posterior mean the
    engine built the slot's weights from (`algorithms.weight_checks.weights_checksum`; the driver
    compares it with the version's published one); `weights_verified` says the engine's own checks
    held around the call (its backend held exactly the θ̂ it fed, unchanged while sampling).
    """

    completion_id: str
    request_id: str
    group_id: str
    slot: int
    prompt_uid: str
    engine_id: int
    seq_no: int
    policy_version: int
    slot_seed: int | None
    mean_checksum: str
    weights_verified: bool
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str
    slot_scale: float = 1.0


@dataclass(frozen=True)
class ScoredCompletion:
    """A completion with its verification result."""

    completion: Completion
    result: VerifyResult


@dataclass(frozen=True)
class Group:
    """One advantage group: all rollouts of one prompt that share a baseline (plan-dependent).

    `published_step` is the learner step at which `policy_version` was published (staleness =
    learner step at consumption − published_step)."""

    group_id: str
    item: TaskItem
    policy_version: int
    published_step: int
    completions: tuple[ScoredCompletion, ...]
    step: int = 0  # the learner step that consumed it (0: not consumed yet)


@dataclass(frozen=True)
class CompletionBatch:
    """One sampler call's completions as arrays. R requests, B = Σ n rows (a request's n rows are
    contiguous, in request order), T = Σ tokens. Row b is completion `requests[row_request[b]].request_id
    / j` (j its index within the request) with per-engine sequence number `first_seq_no + b`."""

    engine_id: int
    incarnation: str
    policy_version: int
    mean_checksum: str        # checksum of the mean the engine built every slot of this call from
    requests: tuple[RolloutRequest, ...]
    verified: np.ndarray      # [R] bool: the engine's weight checks held around the request's slot
    first_seq_no: int
    row_request: np.ndarray   # [B] int32
    prompt_ids: np.ndarray    # [ΣP] int32; request r's prompt is prompt_ids[prompt_offsets[r]:prompt_offsets[r+1]]
    prompt_offsets: np.ndarray  # [R+1] int64
    token_ids: np.ndarray     # [T] int32; row b's tokens are token_ids[token_offsets[b]:token_offsets[b+1]]
    logprobs: np.ndarray      # [T] float32 behaviour log-probs (the sampling distribution's)
    token_offsets: np.ndarray  # [B+1] int64
    finish_stop: np.ndarray   # [B] bool: EOS sampled (else cut at the length limit)
    texts: tuple[str, ...]    # [B] decoded completions
    generate_s: float         # engine time of the call
    # the noise control's measurement where the sampler made one (services/sampling/sampler.py): for row b,
    # Σ_t KL(π_θ̂ ‖ π_m) over its first slot_kl_positions[b] completion tokens (0 positions: not measured)
    slot_kl: np.ndarray | None = None            # [B] float32
    slot_kl_positions: np.ndarray | None = None  # [B] int32
    slot_draw: np.ndarray | None = None          # [R] int8: the KL gate's redraw served (0: the slot's own seed)


@dataclass(frozen=True)
class GenerateReport:
    """What the driver reads of a sampler call (the batch itself stays in the object store)."""

    engine_id: int
    incarnation: str
    policy_version: int
    mean_checksum: str
    request_ids: tuple[str, ...]
    request_rows: tuple[int, ...]
    verified: tuple[bool, ...]
    first_seq_no: int
    rows: int
    tokens: int
    generate_s: float


@dataclass(frozen=True)
class ScoreBatch:
    """A verifier's results for the rows of one CompletionBatch, in row order. `statuses` are indices
    into `STATUSES` (VerifyStatus); `rewards` are NaN for infra_error."""

    statuses: np.ndarray  # [B] uint8
    rewards: np.ndarray   # [B] float32
    verify_s: float


STATUSES: tuple[VerifyStatus, ...] = tuple(VerifyStatus)


@dataclass(frozen=True)
class GroupRows:
    """Driver -> learner: one advantage group as rows of the step's batches. `parts` holds one
    (batch index, first row, rows) per request of the group, in slot order."""

    group_id: str
    item: TaskItem
    policy_version: int
    published_step: int
    parts: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class ConsumedStep:
    """One learner step's consumed groups as the learner received them (a rollout log record):
    the groups' rows of the step's array batches and their scores. `batching.group_records` turns
    it into record-form Groups (`batching.logged_groups` reads a log that way)."""

    step: int
    groups: tuple[GroupRows, ...]
    batches: tuple[CompletionBatch, ...]
    scores: tuple[ScoreBatch, ...]


@dataclass(frozen=True)
class PublishedVersion:
    """A posterior version as the learner publishes it: fp32 mean and σ by parameter name, and the
    exact checksum of the mean (`weight_checks.weights_checksum`) every engine checks on receipt. The
    posterior server numbers versions (it owns them). `slots`: (seed, σ scale) of each slot the
    version serves, as the learner's noise control chose them (services/learner/noise_control.py);
    None: the server draws the seeds of its plan itself, at scale 1. `noise_rank`: the rank of each
    slot's noise per matrix (`[noise] rank`; 0: full noise). `lora`: (r, α) when the version is a LoRA
    adapter posterior (`[lora]` with IVON): `mean` and `sigma` are then the adapters' alone, which engines
    serve over the base weights they loaded (services/sampling/engines/slot_bank.py `Adapters`)."""

    learner_step: int
    reason: str
    mean: dict  # {name: np.ndarray fp32}
    sigma: dict | None  # {name: np.ndarray fp32} of the tensors slots perturb (the noise mask), a subset of
    # mean's names; None when the optimizer has no posterior (AdamW)
    mean_checksum: str
    slots: tuple | None = None  # ((seed, scale), ...) one per slot
    noise_rank: int = 0
    lora: tuple | None = None  # (rank, alpha)

