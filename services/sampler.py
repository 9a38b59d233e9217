"""The sampler service: one engine, turning rollout requests into tagged completions (architecture.md
role 2).

A Sampler holds one engine (services/engines/) and the posterior version it was last given. Calls are
sequential, so a new version (`update`) takes effect at the next request boundary by construction.
`generate` serves each (version, slot seed) of a batch once — the engine regenerates the slot's noise
locally from the seed — and samples all of that slot's prompts together. Every completion carries
what the driver and learner need for exactly-once delivery and off-policy correction: a deterministic
completion id (request id / index, so a re-issued request yields the same ids), this engine's id and
a per-engine sequence number (gaps reveal lost work), the policy version, the slot seed and the
checksum of the weights it was sampled with (the driver compares it with the posterior server's).

Not here: choosing slots or engines (the driver), checksum comparison (driver), Ray.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from threepo.algorithms.param_noise import tensor_seed
from threepo.services.messages import Completion, NoiseSpec, RolloutRequest, SamplingParams
from threepo.services.metrics import CATALOGUE, Metrics, register_catalogue

if TYPE_CHECKING:
    from collections.abc import Mapping

    import numpy as np

    from threepo.services.engines.base import Engine, SamplerConfig

_METRICS = ("threepo_tokens_generated_total", "threepo_completions_total", "threepo_sync_bytes_total",
            "threepo_sync_seconds")


class Sampler:
    """Wraps one `Engine`; see the module docstring. `metrics` (services/metrics.py) receives
    tokens, completions, sync bytes and sync seconds, labelled with the engine id."""

    def __init__(self, engine: Engine, engine_id: int, cfg: SamplerConfig, metrics: Metrics | None = None):
        self.engine, self.engine_id, self.cfg = engine, engine_id, cfg
        self.version: int | None = None
        self._serving: NoiseSpec | None = None  # what the engine serves now, with its checksum
        self._checksum = ""
        self._seq_no = 0
        self._stats = {"requests": 0, "completions": 0, "tokens_generated": 0, "serves": 0,
                       "generate_s": 0.0, "serve_s": 0.0, "update_s": 0.0, "updates": 0, "sync_bytes": 0}
        self._metrics = None if metrics is None else register_catalogue(
            metrics, [m for m in CATALOGUE if m.name in _METRICS])

    def update(self, version: int, mean: Mapping[str, np.ndarray], sigma: Mapping[str, np.ndarray] | None) -> None:
        """Take posterior version `version` (one transfer of m and σ, whatever the number of slots).
        An older version is allowed: the driver re-issues a crashed sampler's requests at the version
        they were admitted with, while the posterior server keeps that version alive."""
        started = time.perf_counter()
        self.engine.update_posterior(version, mean, sigma)
        self.version, self._serving = version, None  # the engine serves the mean now; re-serve slots
        elapsed = time.perf_counter() - started
        sent = sum(a.nbytes for part in (mean, sigma or {}) for a in part.values())
        self._stats["update_s"] += elapsed
        self._stats["updates"] += 1
        self._stats["sync_bytes"] += sent
        if self._metrics is not None:
            self._metrics["threepo_sync_seconds"].observe(elapsed, engine_id=self.engine_id)
            self._metrics["threepo_sync_bytes_total"].inc(sent, engine_id=self.engine_id)

    def generate(self, requests: list[RolloutRequest]) -> list[Completion]:
        """Completions of `requests`, in request order (each request's `n` in a row)."""
        for r in requests:
            if r.policy_version != self.version:
                raise ValueError(f"request {r.request_id!r} wants policy_version {r.policy_version}, but "
                                 f"sampler {self.engine_id} holds version {self.version}: update first")
        by_slot: dict[tuple[int, int | None], list[int]] = {}
        for i, r in enumerate(requests):
            by_slot.setdefault((r.policy_version, r.slot_seed), []).append(i)
        samples: list[list | None] = [None] * len(requests)
        checksums: list[str] = [""] * len(requests)
        for (version, seed), indices in by_slot.items():
            checksum = self._serve(NoiseSpec(version, seed))
            by_n: dict[int, list[int]] = {}
            for i in indices:
                by_n.setdefault(requests[i].n, []).append(i)
            for n, same_n in by_n.items():  # requests of one slot almost always share n
                seed = tensor_seed(self.cfg.seed, "|".join(requests[i].request_id for i in same_n))
                for i, drawn in zip(same_n, self._sample([requests[i].item.prompt for i in same_n], n, seed)):
                    samples[i], checksums[i] = drawn, checksum
        completions = [self._tag(r, j, s, checksums[i])
                       for i, r in enumerate(requests) for j, s in enumerate(samples[i])]
        self._count(len(requests), completions)
        return completions

    def stats(self) -> dict:
        """Counters since construction; `tokens_per_s` is tokens generated per second in generate."""
        out = dict(self._stats, engine_id=self.engine_id, version=self.version, next_seq_no=self._seq_no)
        out["tokens_per_s"] = out["tokens_generated"] / out["generate_s"] if out["generate_s"] else 0.0
        return out

    def close(self) -> None:
        """Release the engine."""
        self.engine.close()

    def _serve(self, noise: NoiseSpec) -> str:
        # the engine keeps serving one policy between calls: re-serving it would copy every weight again
        if noise != self._serving:
            started = time.perf_counter()
            self._checksum = self.engine.serve(noise)
            self._serving = noise
            self._stats["serve_s"] += time.perf_counter() - started
            self._stats["serves"] += 1
        return self._checksum

    def _sample(self, prompts: list[str], n: int, seed: int) -> list[list]:
        """Sample with a stream seeded by the request ids: a re-issued or resumed request draws the
        same tokens whatever the engine did before."""
        cfg = self.cfg
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                max_new_tokens=cfg.max_new_tokens, n=n)
        started = time.perf_counter()
        samples = self.engine.generate(prompts, params, seed=seed)
        self._stats["generate_s"] += time.perf_counter() - started
        if len(samples) != len(prompts) or any(len(s) != n for s in samples):
            raise RuntimeError(f"engine {self.engine_id} returned {[len(s) for s in samples]} samples for "
                               f"{len(prompts)} prompts × n={n}")
        return samples

    def _tag(self, r: RolloutRequest, j: int, s, checksum: str) -> Completion:
        self._seq_no += 1
        return Completion(
            completion_id=f"{r.request_id}/{j}", request_id=r.request_id, group_id=r.group_id, slot=r.slot,
            prompt_uid=r.item.uid, engine_id=self.engine_id, seq_no=self._seq_no - 1,
            policy_version=r.policy_version, slot_seed=r.slot_seed, weights_checksum=checksum,
            prompt_ids=tuple(s.prompt_ids), token_ids=tuple(s.token_ids), logprobs=tuple(s.logprobs),
            finish_reason=s.finish_reason, text=s.text)

    def _count(self, n_requests: int, completions: list[Completion]) -> None:
        tokens = sum(len(c.token_ids) for c in completions)
        self._stats["requests"] += n_requests
        self._stats["completions"] += len(completions)
        self._stats["tokens_generated"] += tokens
        if self._metrics is not None:
            self._metrics["threepo_completions_total"].inc(len(completions), engine_id=self.engine_id)
            self._metrics["threepo_tokens_generated_total"].inc(tokens, engine_id=self.engine_id)
