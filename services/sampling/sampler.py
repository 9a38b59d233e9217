"""The sampler service: one engine, turning rollout requests into tagged completions
(architecture.md §2.2).

A Sampler holds one engine (services/sampling/engines/), the prompt encoder of its model (services/tasks/prompting.py:
every prompt reaches the engine as token ids, with the model's stop tokens) and the posterior version it
was last given. Calls are
sequential, so a new version (`update`) takes effect at the next request boundary by construction.
`generate` serves each (version, slot seed, σ multiplier) of a batch once — the engine regenerates the
slot's noise locally from the seed and scales it — and samples all of that slot's prompts together;
an engine with `slots_together` (hf on the lean decoder's families) takes a call's several slots at once and decodes them in shared
forward passes, each row under its own slot's weights. A call's completions come
back as one `CompletionBatch` (arrays, services/wire/messages.py) carrying what the driver and learner need
for exactly-once delivery, off-policy correction and the weight check: deterministic completion ids
(request id / index, so a re-issued request yields the same ids), this engine's id and incarnation
and per-engine sequence numbers (gaps reveal lost work), the policy version, each request's slot
seed, the checksum of the mean the engine built its slots from (the driver compares it with the one
the learner published) and, per request, whether the engine's own checks held around the call
(loaded exactly what it fed the backend, unchanged while sampling). Each request samples from its own seed,
hashed from the request id, so a re-issued request draws the same tokens wherever it runs.

Where the run's noise control measures on the samplers (`noise`, services/learner/noise_control.py),
the sampler measures each slot it serves where it is cheapest and most faithful: on the slot's own
rollouts, beside the call that sampled them (the engine's `slot_kl`: the rows teacher-forced at the
slot and at the mean). The first rollouts of each (version, slot) it serves, `noise.probe_rows` ×
`KL_POSITIONS` tokens' worth (more rollouts where completions are short), carry their Σ_t
KL(π_θ̂ ‖ π_m) over their first `KL_POSITIONS` tokens in the batch (`slot_kl`, `slot_kl_positions`),
which the learner's noise control reads as feedback. The KL gate acts here too:
a slot whose first measured rollouts are over `noise.gate` × target (× the square of a re-admission's
multiplier) is drawn again (`exploration.redraw_seed`), its requests sampled again, up to
`GATE_REDRAWS` times, the closest draw kept; the broken draw's rollouts are never returned, the draw
served is reported per request (`slot_draw`, and as the requests' slot seed) and served to every
later request of that slot in the version.

Not here: choosing slots or engines (the driver), comparing checksums across roles (driver), Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING

from threepo.algorithms.exploration import redraw_seed
from threepo.algorithms.param_noise import tensor_seed
from threepo.services.metrics import CATALOGUE, Metrics, register_catalogue
from threepo.services.sampling.engines.base import EngineRequest, ServeReport, WeightsMismatch
from threepo.services.wire.batching import completion_batch
from threepo.services.wire.messages import CompletionBatch, NoiseSpec, RolloutRequest, SamplingParams

if TYPE_CHECKING:
    from collections.abc import Mapping

    import numpy as np

    from threepo.algorithms.noise_mask import NoiseConfig
    from threepo.services.sampling.engines.base import Engine, SamplerConfig
    from threepo.services.tasks.prompting import PromptEncoder

_METRICS = ("threepo_tokens_generated_total", "threepo_completions_total", "threepo_sync_bytes_total",
            "threepo_sync_seconds", "threepo_served_noise_ratio", "threepo_weight_check_failures_total")
log = logging.getLogger(__name__)
KL_POSITIONS = 64  # completion tokens of each measured rollout (the learner's probe measures as many)
GATE_REDRAWS = 3  # most new draws of a slot over the gate


class Sampler:
    """Wraps one `Engine`; see the module docstring. `prompts` turns items into token ids and names
    the stop tokens. `metrics` (services/metrics.py) receives tokens, completions, sync bytes and
    seconds, the served-noise ratio and failed weight checks, labelled with the engine id."""

    def __init__(self, engine: Engine, engine_id: int, cfg: SamplerConfig, prompts: PromptEncoder,
                 metrics: Metrics | None = None, incarnation: str = "", noise: NoiseConfig | None = None):
        """`noise`: measure the slots served and gate them (module docstring); None: neither (no noise
        control in the run, or the learner measures)."""
        self.engine, self.engine_id, self.cfg, self.incarnation = engine, engine_id, cfg, incarnation
        self.prompts, self.noise = prompts, noise
        if noise is not None and not hasattr(engine, "slot_kl"):
            raise ValueError(f"sampler {engine_id}: the {type(engine).__name__} engine cannot measure a slot's KL "
                             "to the mean; the learner's noise control measures for it")
        self._published: dict = {}  # seed -> scale of the held version's slots (its gate's reference)
        self._draws: dict[tuple, int] = {}  # (version, seed, scale) -> the seed served for it (the gate's)
        self._draw_of: dict[tuple, int] = {}  # (version, served seed, scale) -> which redraw it is (0: none)
        self._kl_tokens: dict[tuple, int] = {}  # (version, served seed, scale) -> positions measured
        self.version: int | None = None
        self._serving: ServeReport | None = None  # what the engine serves now
        self._seq_no = 0
        self._warned_versions: set[int] = set()
        self._stats = {"requests": 0, "completions": 0, "tokens_generated": 0, "serves": 0,
                       "generate_s": 0.0, "serve_s": 0.0, "update_s": 0.0, "updates": 0, "sync_bytes": 0,
                       "weight_check_failures": 0, "noise_ratio": 1.0, "kl_rows": 0, "kl_s": 0.0,
                       "noise_redraws": 0}
        self._metrics = None if metrics is None else register_catalogue(
            metrics, [m for m in CATALOGUE if m.name in _METRICS])

    def update(self, version: int, mean: Mapping[str, np.ndarray], sigma: Mapping[str, np.ndarray] | None,
               mean_checksum: str, noise_rank: int = 0, lora: tuple | None = None, slots: tuple | None = None) -> None:
        """Take posterior version `version` (one transfer of m and σ, whatever the number of slots; its
        slots' noise of rank `noise_rank` per matrix, 0: full; `lora` = (r, α): m and σ are a LoRA
        adapter's, served over the engine's base weights; `slots`: its (seed, scale) pairs as the noise
        control chose them, the KL gate's reference);
        the engine refuses a mean whose checksum is not `mean_checksum` (WeightsMismatch). An older
        version is allowed: the driver re-issues a crashed sampler's requests at the version they
        were admitted with, while the posterior server keeps that version alive."""
        started = time.perf_counter()
        try:
            self.engine.load_version(version, mean, sigma, mean_checksum, noise_rank, **({"lora": lora} if lora else {}))
        except WeightsMismatch:
            self._failed_check("mean")
            raise
        self.version, self._serving = version, None  # the engine serves the mean now; re-serve slots
        self._published = dict(slots or ())
        self._draws, self._draw_of, self._kl_tokens = ({k: v for k, v in d.items() if k[0] == version}
                                                       for d in (self._draws, self._draw_of, self._kl_tokens))
        elapsed = time.perf_counter() - started
        sent = sum(a.nbytes for part in (mean, sigma or {}) for a in part.values())
        self._stats["update_s"] += elapsed
        self._stats["updates"] += 1
        self._stats["sync_bytes"] += sent
        if self._metrics is not None:
            self._metrics["threepo_sync_seconds"].observe(elapsed, engine_id=self.engine_id)
            self._metrics["threepo_sync_bytes_total"].inc(sent, engine_id=self.engine_id)

    def generate(self, requests: list[RolloutRequest]) -> CompletionBatch:
        """Completions of `requests` (all of one policy version), as one array batch in request
        order (each request's `n` rows in a row)."""
        if not requests:
            raise ValueError(f"sampler {self.engine_id}: generate needs at least one request")
        for r in requests:
            if r.policy_version != self.version:
                raise ValueError(f"request {r.request_id!r} wants policy_version {r.policy_version}, but "
                                 f"sampler {self.engine_id} holds version {self.version}: update first")
        requests = [self._as_served(r) for r in requests]  # a slot the gate redrew serves its redraw
        by_slot: dict[tuple, list[int]] = {}  # (seed, σ multiplier) -> request indices
        for i, r in enumerate(requests):
            by_slot.setdefault((r.slot_seed, r.slot_scale), []).append(i)
        samples: list = [None] * len(requests)
        prompts: list = [None] * len(requests)
        verified = [False] * len(requests)
        measured: list = [None] * len(requests)  # per request: its rows' (Σ KL, positions), where measured
        started = time.perf_counter()
        groups = [(NoiseSpec(self.version, seed, scale), [requests[i] for i in indices])
                  for (seed, scale), indices in by_slot.items()]
        if len(groups) > 1 and getattr(self.engine, "slots_together", False):
            results = self._sample_slots(groups)  # several slots decoded together
        else:
            results = [self._sample_served(noise, reqs) for noise, reqs in groups]
        for indices, group, result in zip(by_slot.values(), groups, results):
            (report, unchanged, drawn), reqs, kls = self._measured(*group, result)
            checksum = report.mean_checksum  # one version per call: every slot is built from one mean
            if not self._check(report, unchanged):
                self._serving = None  # load the slot afresh next time
            for i, r, (prompt, d), kl in zip(indices, reqs, drawn, kls):
                requests[i], prompts[i], samples[i], verified[i] = r, prompt, d, report.loaded_ok and unchanged
                measured[i] = kl
        batch = completion_batch(engine_id=self.engine_id, incarnation=self.incarnation,
                                 policy_version=self.version, mean_checksum=checksum,
                                 requests=requests, prompts=prompts, samples=samples, verified=verified,
                                 first_seq_no=self._seq_no, generate_s=time.perf_counter() - started,
                                 measured=measured if self.noise is not None else None,
                                 draws=[self._draw_of.get((self.version, r.slot_seed, r.slot_scale), 0)
                                        for r in requests] if self.noise is not None else None)
        self._seq_no += len(batch.texts)
        self._count(len(requests), batch)
        return batch

    def stats(self) -> dict:
        """Counters since construction; `tokens_per_s` is tokens generated per second in generate."""
        out = dict(self._stats, engine_id=self.engine_id, version=self.version, next_seq_no=self._seq_no)
        out["tokens_per_s"] = out["tokens_generated"] / out["generate_s"] if out["generate_s"] else 0.0
        return out

    def close(self) -> None:
        """Release the engine."""
        self.engine.close()

    def _serve(self, noise: NoiseSpec) -> ServeReport:
        # the engine keeps serving one policy between calls: re-serving it would reload every weight
        current = self._serving
        if current is None or (current.version, current.seed, current.scale) != (noise.posterior_version, noise.seed,
                                                                                 noise.scale):
            started = time.perf_counter()
            self._serving = self.engine.serve(noise)
            self._stats["serve_s"] += time.perf_counter() - started
            self._stats["serves"] += 1
            self._record_noise(self._serving)
        return self._serving

    def _record_noise(self, report: ServeReport) -> None:
        if report.seed is None:
            return
        self._stats["noise_ratio"] = report.noise_ratio
        if self._metrics is not None:
            self._metrics["threepo_served_noise_ratio"].set(report.noise_ratio, engine_id=self.engine_id)
        if report.noise_ratio < self.cfg.min_noise_ratio and report.version not in self._warned_versions:
            self._warned_versions.add(report.version)
            log.warning("engine %d, version %d: only %.0f%% of the exploration noise survives serving in %s "
                        "(sampler.min_noise_ratio %.2f); serve fp32 (sampler.dtype=float32) or raise σ",
                        self.engine_id, report.version, 100 * report.noise_ratio, self.cfg.dtype,
                        self.cfg.min_noise_ratio)

    def _params(self) -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                              max_new_tokens=cfg.max_new_tokens, stop_token_ids=self.prompts.stop_ids)

    def _engine_requests(self, requests: list[RolloutRequest], encoded: dict | None = None) -> list[EngineRequest]:
        """Each request samples from a stream seeded by its id: a re-issued or resumed request draws
        the same tokens whatever the engine did before and whatever shares its batch. `encoded`:
        prompt ids by (prompt, verifier), shared by one call's groups (a C3PO call asks for each prompt
        once per slot)."""
        encoded = {} if encoded is None else encoded
        for r in requests:
            key = (r.item.prompt, r.item.verifier)
            if key not in encoded:
                encoded[key] = self.prompts.encode(*key)
        return [EngineRequest(encoded[(r.item.prompt, r.item.verifier)], r.n, tensor_seed(self.cfg.seed, r.request_id))
                for r in requests]

    def _sample_served(self, noise: NoiseSpec, requests: list[RolloutRequest]) -> tuple:
        """(report, unchanged, [(prompt ids, samples)]): serve the slot, sample, re-check the weights."""
        report = self._serve(noise)
        engine_requests = self._engine_requests(requests)
        started = time.perf_counter()
        samples = self.engine.generate(engine_requests, self._params())
        self._stats["generate_s"] += time.perf_counter() - started
        self._check_counts(requests, samples)
        unchanged = self.engine.verify()  # the weights the samples came from are still those loaded
        return report, unchanged, [(er.prompt_ids, s) for er, s in zip(engine_requests, samples)]

    def _sample_slots(self, groups: list[tuple[NoiseSpec, list[RolloutRequest]]]) -> list[tuple]:
        """(report, unchanged, [(prompt ids, samples)]) per (slot, requests) group, every group in
        one engine call (`generate_slots`: slots decoded together, what the engine serves untouched)."""
        encoded: dict[tuple[str, str], tuple[int, ...]] = {}
        engine_groups = [(noise, self._engine_requests(reqs, encoded)) for noise, reqs in groups]
        started = time.perf_counter()
        results = self.engine.generate_slots(engine_groups, self._params())
        self._stats["generate_s"] += time.perf_counter() - started
        out = []
        for (_, reqs), (_, ereqs), (report, unchanged, samples) in zip(groups, engine_groups, results):
            self._check_counts(reqs, samples)
            self._record_noise(report)
            out.append((report, unchanged, [(er.prompt_ids, s) for er, s in zip(ereqs, samples)]))
        return out

    def _as_served(self, request: RolloutRequest) -> RolloutRequest:
        """`request` with the seed its slot is served at in its version (the gate's redraw, if any)."""
        seed = self._draws.get((request.policy_version, request.slot_seed, request.slot_scale), request.slot_seed)
        return request if seed == request.slot_seed else dataclasses.replace(request, slot_seed=seed)

    def _measured(self, noise: NoiseSpec, requests: list[RolloutRequest], result: tuple) -> tuple:
        """(result, requests, per request its rows' (Σ KL, positions) or None): the slot's KL measured on
        the call's rollouts while this version's quota of `noise.probe_rows` × `KL_POSITIONS` positions
        is not met (short completions: more rollouts); a slot's first measurement over the gate draws it
        again (`_redrawn`), and the draw kept replaces the result."""
        unmeasured = [[None] * r.n for r in requests]
        if self.noise is None or noise.seed is None:
            return result, requests, unmeasured
        done = self._kl_tokens.get((noise.posterior_version, noise.seed, noise.scale))
        quota = self.noise.probe_rows * KL_POSITIONS - (done or 0)
        if quota <= 0:
            return result, requests, unmeasured
        kls = self._slot_kl(noise, result[2], quota)
        if done is None:  # the slot's first rollouts: the gate decides on them before they go anywhere
            first = (noise.posterior_version, noise.seed, noise.scale)
            noise, requests, result, kls, draw = self._redrawn(noise, requests, result, kls, quota)
            self._draws[first] = noise.seed
            self._draw_of[(noise.posterior_version, noise.seed, noise.scale)] = draw
        key = (noise.posterior_version, noise.seed, noise.scale)
        self._kl_tokens[key] = (done or 0) + sum(x[1] for per in kls for x in per if x is not None)
        return result, requests, kls

    def _slot_kl(self, noise: NoiseSpec, drawn: list, quota: int) -> list[list]:
        """The first rollouts of `drawn` ([(prompt ids, samples)] per request) that hold `quota`
        positions measured (`engine.slot_kl`): per request, per row (Σ KL, positions) or None."""
        rows, held = [], 0
        for prompt, s in ((prompt, s) for prompt, samples in drawn for s in samples):
            if held >= quota:
                break
            rows.append((prompt, s.token_ids))
            held += min(len(s.token_ids), KL_POSITIONS)
        started = time.perf_counter()
        kls = iter(self.engine.slot_kl(noise, rows, KL_POSITIONS, self.cfg.temperature))
        self._stats["kl_s"] += time.perf_counter() - started
        self._stats["kl_rows"] += len(rows)
        out, left = [], len(rows)
        for _, samples in drawn:
            taken = min(left, len(samples))
            out.append([next(kls) for _ in range(taken)] + [None] * (len(samples) - taken))
            left -= taken
        return out

    def _redrawn(self, noise: NoiseSpec, requests: list[RolloutRequest], result: tuple, kls: list, quota: int) -> tuple:
        """(noise, requests, result, kls, draw) of the draw kept: the slot as it came where its KL is
        within the gate, else up to `GATE_REDRAWS` redraws sampled and measured in turn, stopping at one
        within it, the closest kept. The bound is gate × target × (c / c_version)² (a re-admission's
        multiplier asks for that much more); a slot the version did not publish is not gated."""
        published = self._published.get(noise.seed)
        if self.noise.gate_kl == math.inf or not published:
            return noise, requests, result, kls, 0
        bound = self.noise.gate_kl * (noise.scale / published) ** 2
        tried = [(_mean_kl(kls), 0, noise, requests, result, kls)]
        for draw in range(1, GATE_REDRAWS + 1):
            if tried[-1][0] <= bound:
                break
            spec = NoiseSpec(noise.posterior_version, redraw_seed(noise.seed, draw), noise.scale)
            again = [dataclasses.replace(r, slot_seed=spec.seed) for r in requests]
            drawn = self._sample_served(spec, again)
            self._stats["noise_redraws"] += 1
            measured = self._slot_kl(spec, drawn[2], quota)
            tried.append((_mean_kl(measured), draw, spec, again, drawn, measured))
        _, draw, noise, requests, result, kls = min(tried, key=lambda t: t[0])
        return noise, requests, result, kls, draw

    def _check_counts(self, requests: list[RolloutRequest], samples: list) -> None:
        if len(samples) != len(requests) or any(len(s) != r.n for s, r in zip(samples, requests)):
            raise RuntimeError(f"engine {self.engine_id} returned {[len(s) for s in samples]} samples for "
                               f"requests with n = {[r.n for r in requests]}")

    def _check(self, report: ServeReport, unchanged: bool) -> bool:
        """Count a failed weight check; True when the slot's samples can be trusted."""
        if report.loaded_ok and unchanged:
            return True
        self._failed_check("load" if not report.loaded_ok else "changed")
        return False

    def _failed_check(self, reason: str) -> None:
        self._stats["weight_check_failures"] += 1
        if self._metrics is not None:
            self._metrics["threepo_weight_check_failures_total"].inc(1, engine_id=self.engine_id, reason=reason)

    def _count(self, n_requests: int, batch: CompletionBatch) -> None:
        tokens, rows = len(batch.token_ids), len(batch.texts)
        self._stats["requests"] += n_requests
        self._stats["completions"] += rows
        self._stats["tokens_generated"] += tokens
        if self._metrics is not None:
            self._metrics["threepo_completions_total"].inc(rows, engine_id=self.engine_id)
            self._metrics["threepo_tokens_generated_total"].inc(tokens, engine_id=self.engine_id)


def _mean_kl(kls: list[list]) -> float:
    """Per-token KL of measured rows ([per request [(Σ KL, positions) or None]])."""
    total = [x for per in kls for x in per if x is not None]
    return sum(k for k, _ in total) / max(sum(n for _, n in total), 1)
