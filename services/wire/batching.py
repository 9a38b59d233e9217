"""Array messages on the hot path: building a sampler call's `CompletionBatch`, the verifier's
requests and `ScoreBatch`, and the learner's `TrainBatch`, collated once from the step's batches.

Everything here moves or shapes data (no math): numpy in, numpy or torch out. Completion ids are
implicit (`<request id>/<j>`), so nothing per completion is built on the way from the engine to the
learner's loss. The per-completion record form (`Group` of `ScoredCompletion`s: rollout logs,
tests) is built only by `group_records` and read back by `batches_from_groups`.

torch is imported only by `collate` (the learner's): samplers and verifiers use this module too.

Not here: which rows form a group (the driver's ledger), advantages and losses (algorithms/).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from threepo.services.wire.messages import (STATUSES, Completion, CompletionBatch, ConsumedStep, GeneratedSample,
                                            GenerateReport, Group, GroupRows, RolloutRequest, ScoreBatch,
                                            ScoredCompletion, VerifyRequest, VerifyResult, VerifyStatus)

_CODE = {s: i for i, s in enumerate(STATUSES)}
INFRA = _CODE[VerifyStatus.INFRA_ERROR]
MALFORMED = _CODE[VerifyStatus.MALFORMED]


def completion_batch(*, engine_id: int, incarnation: str, policy_version: int, mean_checksum: str,
                     requests: Sequence[RolloutRequest], prompts: Sequence[Sequence[int]], samples: Sequence[Sequence],
                     verified: Sequence[bool], first_seq_no: int, generate_s: float,
                     measured: Sequence[Sequence] | None = None, draws: Sequence[int] | None = None) -> CompletionBatch:
    """Flatten `samples[r]` (the engine's GeneratedSamples of request r, prompt `prompts[r]`); `measured[r]`:
    per row of request r its slot-KL measurement (Σ KL, positions) or None; `draws[r]`: the gate's redraw
    its slot was served at."""
    rows = [s for per_request in samples for s in per_request]
    lengths = np.array([len(s.token_ids) for s in rows], dtype=np.int64)
    kl = None if measured is None else [x or (0.0, 0) for per_request in measured for x in per_request]
    return CompletionBatch(
        engine_id=engine_id, incarnation=incarnation, policy_version=policy_version, mean_checksum=mean_checksum,
        requests=tuple(requests), verified=np.array(verified, dtype=bool), first_seq_no=first_seq_no,
        row_request=np.repeat(np.arange(len(requests), dtype=np.int32), [len(s) for s in samples]),
        prompt_ids=np.fromiter((t for p in prompts for t in p), dtype=np.int32),
        prompt_offsets=np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int64),
        token_ids=np.fromiter((t for s in rows for t in s.token_ids), dtype=np.int32, count=int(lengths.sum())),
        logprobs=np.fromiter((lp for s in rows for lp in s.logprobs), dtype=np.float32, count=int(lengths.sum())),
        token_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        finish_stop=np.array([s.finish_reason == "stop" for s in rows], dtype=bool),
        texts=tuple(s.text for s in rows), generate_s=generate_s,
        slot_kl=None if kl is None else np.array([k for k, _ in kl], dtype=np.float32),
        slot_kl_positions=None if kl is None else np.array([n for _, n in kl], dtype=np.int32),
        slot_draw=None if draws is None else np.array(draws, dtype=np.int8))


def report_of(batch: CompletionBatch) -> GenerateReport:
    """The small part of a batch the driver reads."""
    return GenerateReport(engine_id=batch.engine_id, incarnation=batch.incarnation,
                          policy_version=batch.policy_version, mean_checksum=batch.mean_checksum,
                          request_ids=tuple(r.request_id for r in batch.requests),
                          request_rows=tuple(r.n for r in batch.requests),
                          verified=tuple(bool(v) for v in batch.verified), first_seq_no=batch.first_seq_no,
                          rows=len(batch.texts), tokens=len(batch.token_ids), generate_s=batch.generate_s)


def verify_requests(batch: CompletionBatch) -> list[VerifyRequest]:
    """One VerifyRequest per row, in row order."""
    return [VerifyRequest(item=batch.requests[r].item, completion=text, finish_reason="stop" if stop else "length")
            for r, text, stop in zip(batch.row_request.tolist(), batch.texts, batch.finish_stop.tolist())]


def score_batch(results: Sequence[VerifyResult], verify_s: float) -> ScoreBatch:
    return ScoreBatch(statuses=np.array([_CODE[r.status] for r in results], dtype=np.uint8),
                      rewards=np.array([r.reward for r in results], dtype=np.float32), verify_s=verify_s)


if TYPE_CHECKING:
    import torch


@dataclass
class TrainBatch:
    """The learner's view of one step: B rows in groups of G (tensors), collated once."""

    input_ids: torch.Tensor    # [B, L] right-padded prompt + completion
    attn: torch.Tensor         # [B, L]
    targets: torch.Tensor      # [B, L-1] next tokens
    mask: torch.Tensor         # [B, L-1] 1 on completion tokens
    logp_behav: torch.Tensor   # [B, L-1] behaviour log-probs aligned with targets
    rewards: torch.Tensor      # [B/G, G] fp64
    slots: torch.Tensor        # [B/G, G] slot index of each rollout
    slot_seeds: list           # [B] seed of the slot that sampled each rollout
    slot_scales: list          # [B] σ multiplier c of that slot (θ̂ = m + c · σ ⊙ z(seed))
    statuses: np.ndarray       # [B] uint8 status codes
    truncated: np.ndarray      # [B] bool: the completion ended at the length limit, not at a stop token
    texts: list                # [B] decoded completions (LamPO's ROUGE-L)
    solutions: list            # [B/G] reference solutions of the groups' items
    published_steps: np.ndarray  # [B/G] learner step that published each group's policy version
    slot_kl: np.ndarray        # [B] the sampler's Σ_t KL(π_θ̂ ‖ π_m) of the row (CompletionBatch.slot_kl)
    slot_kl_positions: np.ndarray  # [B] positions it was measured on (0: not measured)
    slot_draws: np.ndarray     # [B] the KL gate's redraw that served the row (0: the slot's own seed)

    def to(self, device: torch.device) -> TrainBatch:
        """The [B, L] tensors on `device` (rewards and slots stay on the CPU with the advantages' inputs)."""
        moved = {k: getattr(self, k).to(device) for k in ("input_ids", "attn", "targets", "mask", "logp_behav")}
        return self if device.type == "cpu" else replace(self, **moved)


def _rows(groups: Sequence[GroupRows]) -> list[tuple[int, int]]:
    return [(b, first + k) for g in groups for b, first, count in g.parts for k in range(count)]


def collate(groups: Sequence[GroupRows], batches: Sequence[CompletionBatch], scores: Sequence[ScoreBatch]) -> TrainBatch:
    """Right-padded sequences with behaviour log-probs aligned to next-token targets."""
    import torch

    sizes = {sum(count for _, _, count in g.parts) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups: expected one group size, got sizes {sorted(sizes)}")
    rows = _rows(groups)
    statuses = np.array([scores[b].statuses[r] for b, r in rows], dtype=np.uint8)
    if (statuses == INFRA).any():
        raise ValueError(f"infra_error results must never reach the learner: {int((statuses == INFRA).sum())} rows")
    pieces = []
    for b, r in rows:
        batch = batches[b]
        req = int(batch.row_request[r])
        lo, hi = batch.token_offsets[r], batch.token_offsets[r + 1]
        pieces.append((batch.prompt_ids[batch.prompt_offsets[req]:batch.prompt_offsets[req + 1]],
                       batch.token_ids[lo:hi], batch.logprobs[lo:hi], batch.requests[req]))
    width = max(len(p) + len(t) for p, t, _, _ in pieces)
    input_ids = np.zeros((len(rows), width), dtype=np.int64)
    attn = np.zeros_like(input_ids)
    logp_behav = np.zeros((len(rows), width - 1), dtype=np.float32)
    mask = np.zeros_like(logp_behav)
    for i, (prompt, tokens, logprobs, _) in enumerate(pieces):
        p, n = len(prompt), len(tokens)
        input_ids[i, :p], input_ids[i, p:p + n] = prompt, tokens
        attn[i, :p + n] = 1
        logp_behav[i, p - 1:p - 1 + n] = logprobs
        mask[i, p - 1:p - 1 + n] = 1
    g = sizes.pop()
    ids = torch.from_numpy(input_ids)
    return TrainBatch(
        input_ids=ids, attn=torch.from_numpy(attn), targets=ids[:, 1:], mask=torch.from_numpy(mask),
        logp_behav=torch.from_numpy(logp_behav),
        rewards=torch.tensor([float(scores[b].rewards[r]) for b, r in rows], dtype=torch.float64).view(-1, g),
        slots=torch.tensor([req.slot for *_, req in pieces]).view(-1, g),
        slot_seeds=[req.slot_seed for *_, req in pieces], slot_scales=[req.slot_scale for *_, req in pieces],
        statuses=statuses, truncated=np.array([not batches[b].finish_stop[r] for b, r in rows], dtype=bool),
        texts=[batches[b].texts[r] for b, r in rows], solutions=[grp.item.solution for grp in groups],
        published_steps=np.array([grp.published_step for grp in groups], dtype=np.int64),
        slot_kl=np.array([_row(batches[b].slot_kl, r, 0.0) for b, r in rows], dtype=np.float64),
        slot_kl_positions=np.array([_row(batches[b].slot_kl_positions, r, 0) for b, r in rows], dtype=np.int64),
        slot_draws=np.array([_row(batches[b].slot_draw, int(batches[b].row_request[r]), 0) for b, r in rows],
                            dtype=np.int64))


def _row(values: np.ndarray | None, at: int, absent):
    """values[at], or `absent` where the batch carries no such array (no measurement made)."""
    return absent if values is None else values[at].item()


def completions_of(batch: CompletionBatch) -> list[Completion]:
    """The record form of every row of `batch`, in row order (logs, tests)."""
    out, j = [], 0
    for r, rp in enumerate(batch.row_request.tolist()):
        req = batch.requests[rp]
        j = 0 if r == 0 or rp != batch.row_request[r - 1] else j + 1
        lo, hi = batch.token_offsets[r], batch.token_offsets[r + 1]
        out.append(Completion(
            completion_id=f"{req.request_id}/{j}", request_id=req.request_id, group_id=req.group_id, slot=req.slot,
            prompt_uid=req.item.uid, engine_id=batch.engine_id, seq_no=batch.first_seq_no + r,
            policy_version=batch.policy_version, slot_seed=req.slot_seed, mean_checksum=batch.mean_checksum,
            weights_verified=bool(batch.verified[rp]),
            prompt_ids=tuple(batch.prompt_ids[batch.prompt_offsets[rp]:batch.prompt_offsets[rp + 1]].tolist()),
            token_ids=tuple(batch.token_ids[lo:hi].tolist()), logprobs=tuple(batch.logprobs[lo:hi].tolist()),
            finish_reason="stop" if batch.finish_stop[r] else "length", text=batch.texts[r],
            slot_scale=req.slot_scale))
    return out


def group_records(groups: Sequence[GroupRows], batches: Sequence[CompletionBatch], scores: Sequence[ScoreBatch],
                  step: int) -> list[Group]:
    """The consumed groups in record form (rollout log): one ScoredCompletion per row."""
    records = [completions_of(b) for b in batches]
    out = []
    for grp in groups:
        scored = tuple(ScoredCompletion(records[b][r], VerifyResult(STATUSES[scores[b].statuses[r]],
                                                                    float(scores[b].rewards[r])))
                       for b, first, count in grp.parts for r in range(first, first + count))
        out.append(Group(grp.group_id, grp.item, grp.policy_version, grp.published_step, scored, step=step))
    return out


def logged_groups(path: str) -> Iterator[Group]:
    """The consumed groups of the rollout log at `path` in record form, in step order (a log written
    before logs kept arrays holds Group records: they come as they are)."""
    from threepo.services.wire.codec import RolloutLog

    for record in RolloutLog.read(path):
        if isinstance(record, ConsumedStep):
            yield from group_records(record.groups, record.batches, record.scores, record.step)
        else:
            yield record


def batches_from_groups(groups: Sequence[Group]) -> tuple[list[GroupRows], list[CompletionBatch], list[ScoreBatch]]:
    """The array form of record-form groups: one batch per request (tests, replaying a rollout log)."""
    specs, batches, scores = [], [], []
    for g in groups:
        parts, by_request = [], {}
        for s in g.completions:
            c = s.completion
            by_request.setdefault((c.request_id, c.slot, c.slot_seed, c.slot_scale), []).append(s)
        for (rid, *_), scored in by_request.items():
            c0 = scored[0].completion
            request = RolloutRequest(rid, g.group_id, g.item, c0.policy_version, c0.slot, c0.slot_seed, len(scored),
                                     slot_scale=c0.slot_scale)
            samples = [GeneratedSample(s.completion.token_ids, s.completion.logprobs, s.completion.finish_reason,
                                       s.completion.text) for s in scored]
            batches.append(completion_batch(
                engine_id=c0.engine_id, incarnation="", policy_version=c0.policy_version,
                mean_checksum=c0.mean_checksum, requests=[request], prompts=[c0.prompt_ids], samples=[samples],
                verified=[c0.weights_verified], first_seq_no=c0.seq_no, generate_s=0.0))
            scores.append(score_batch([s.result for s in scored], 0.0))
            parts.append((len(batches) - 1, 0, len(scored)))
        specs.append(GroupRows(g.group_id, g.item, g.policy_version, g.published_step, tuple(parts)))
    return specs, batches, scores
