"""The learner's noise control: the seeds and the σ scale c of the slots each version serves, so that
the per-token KL(π_θ̂ ‖ π_m) of a served slot stays at `noise.target_kl` (algorithms/noise_scale.py;
issues 25 and 38).

Where the KL is measured, chosen once where the learner is built (`measured_by_samplers`):
- **On the samplers** (the hf engine): each sampler measures every slot it serves on the slot's own
  first `noise.probe_rows` rollouts of the version, teacher-forced at the slot and at the mean in fp32
  beside the call that sampled them (services/sampling/sampler.py, `HFEngine.slot_kl`), and the rollouts carry
  the measurement to the learner. `observe` collects it from each step's batch; when the learner
  publishes, `plan` sets the new version's scale from the newest version measured since the last
  plan (feedback: `feedback_scale`, the median over its slots of the scale each implies by the
  quadratic law, the whole step down, half of it up: `_FEEDBACK_GAIN`) and gives each slot a fresh
  seed — no forward in the
  learner. A measurement reaches the learner when its rollouts are consumed, one to three versions
  after the version it measured: the scale follows a policy whose sensitivity to the noise changes
  with that lag. The KL gate is the samplers' (a slot over `noise.gate` × target where it is first
  served is redrawn there).
- **In the learner** (engines that cannot measure: vLLM, SGLang): `plan` measures each new slot's KL
  on a probe (`noise.probe_rows` rollouts of the latest step, their first `_POSITIONS` predicted tokens,
  in runs of rows of one prompt whose prompt is computed once), exactly over the vocabulary at the
  sampler's temperature, with the slot built as the engines will serve it (σ zero outside the noise
  mask, times c). A slot over `noise.gate` × target is redrawn with the next seed
  (`exploration.noise_seed`), up to `_REDRAWS` times, the closest draw kept if none passes. The version
  serves its slots at the scale just measured; the median KL of the first draws sets the next version's
  scale (`next_noise_scale`, gain `_GAIN`).
The median, not the mean: a slot's KL is heavy-tailed in z (on the embedded model at twice the
target's scale, one draw in eight measured 25x the others' KL, a draw that breaks the policy), which is
the gate's business, not the scale's.

Either way, before the first version is served, with no rollouts yet, the scale is calibrated in the
learner on the prompts it was given, on the first `_CALIBRATION_SLOTS` slots, in up to `_CALIBRATION`
rounds (the quadratic law's step, then bisection once the target is bracketed). The scale stays at most
`_MAX_SCALE`: where the noise cannot reach the target (a masked model's KL saturates) it stops there
rather than growing without bound.

The metrics (every step logs the latest version's): noise_scale (c of the version published last),
noise_kl (the median KL: on the samplers, of the newest version's measured slots; in the learner, of
the version's first draws), noise_kl_served_max (the largest KL among those slots), noise_redraws
(slots redrawn by the gate among them).
"""

from __future__ import annotations

import math
import statistics

import torch

from threepo.algorithms.exploration import noise_seed
from threepo.algorithms.noise_mask import NoiseConfig
from threepo.algorithms.noise_scale import feedback_scale, next_noise_scale, policy_kl
from threepo.services.model.prefix_forward import position_logits

_POSITIONS = 64  # predicted tokens of each probe row
_ROWS = 4  # probe rows per forward (a chunk's logits: rows × 64 × V floats)
_REDRAWS = 3  # most new seeds for a slot over the gate
_CALIBRATION = 8  # most measurements to set the first version's scale
_CALIBRATION_SLOTS = 8  # slots measured per calibration round
CALIBRATION_PROMPTS = 16  # training prompts the calibration measures on (deploy/actors.py noise_prompts)
_CLOSE = math.log(1.25)  # calibration stops within a factor 1.25 of the target
_GAIN = 0.5  # share of the quadratic law's step in log c per version (a probe's KL is noisy)
# the samplers' measurements: half the step up to the newest version's median implied scale, the whole step
# down (feedback_scale). A slot's KL at a given scale moved 3.5x between SmolLM2's first two versions, which
# a half step down lags behind by versions; on the embedded model a whole step up reached scales where the
# KL jumps 20x for 1.5x more scale (0.0045 at c = 3.0, 0.096 at 4.4)
_FEEDBACK_GAIN = 0.5
_MAX_SCALE = 10.0  # a target the noise cannot reach (the KL saturates) leaves c here, not growing forever


class NoiseControl:
    """Seeds and σ scale of each published version's slots (module docstring)."""

    def __init__(self, cfg: NoiseConfig, *, n_slots: int, base_seed: int, temperature: float,
                 prompts: list[list[int]] | None = None, device: torch.device | str = "cpu",
                 measured_by_samplers: bool = False) -> None:
        self.cfg, self.n_slots, self.base_seed, self.temperature = cfg, n_slots, base_seed, temperature
        self.scale, self.calibrated, self.latest = 1.0, False, {}
        self.device = torch.device(device)
        self.probe = _prompt_probe(prompts, self.device) if prompts else None
        self.measured_by_samplers = measured_by_samplers
        # (published step, seed, scale) -> [Σ KL, positions, redrawn] of the slots measured since the last plan
        self.served: dict[tuple, list] = {}
        self.freshest = -1  # the published step of the version the scale was last set from

    def observe(self, batch, group: int = 0) -> None:
        """A step's rollouts (a TrainBatch). Measured by the samplers: their rows' measurements, summed
        per served slot (seed, scale). Else about `probe_rows` rows of the batch, evenly spread, become
        the probe (their first predicted tokens: `batch.mask` [B, L-1] marks where position t predicts
        a completion token); with `group` > 1 the batch's rows come in consecutive groups of that many
        sharing a prompt: the probe then takes runs of rows of one group (two from each of
        `probe_rows` / 2 groups, more from each where there are fewer groups), and each run's prompt is
        computed once (prefix_forward)."""
        if self.measured_by_samplers:
            size = batch.rewards.shape[1]
            for r in batch.slot_kl_positions.nonzero()[0].tolist():
                version = int(batch.published_steps[r // size])  # the learner step that published it
                if version < self.freshest:
                    continue  # older than the version the scale was last set from
                slot = self.served.setdefault((version, batch.slot_seeds[r], batch.slot_scales[r]), [0.0, 0, False])
                slot[0] += float(batch.slot_kl[r])
                slot[1] += int(batch.slot_kl_positions[r])
                slot[2] = slot[2] or bool(batch.slot_draws[r])
            return
        input_ids, attn, mask = batch.input_ids, batch.attn, batch.mask
        groups = len(input_ids) // group if group > 1 and self.cfg.probe_rows > 1 else 0
        if groups:
            used = min(groups, self.cfg.probe_rows // 2)
            run = min(group, self.cfg.probe_rows // used)
            firsts = torch.linspace(0, groups - 1, used).round().long() * group
            rows = (firsts[:, None] + torch.arange(run)).flatten()
        else:
            run, rows = 0, torch.linspace(0, len(input_ids) - 1, min(self.cfg.probe_rows, len(input_ids))).round().long()
        where = mask[rows].bool() & (mask[rows].cumsum(1) <= _POSITIONS)
        self.probe = (input_ids[rows].detach(), attn[rows].detach(), where, mask[rows].detach(), run)

    def plan(self, model, optimizer, step: int) -> list[tuple[int, float]] | None:
        """(seed, scale) of each slot of the version published at learner step `step`; where the learner
        measures, None without a probe (the posterior server then plans its own seeds at scale 1). The
        learner measures in fp32 whatever its mixed precision: a KL of 0.01 is below bf16's rounding of
        the logits. Without prompts to calibrate on, the samplers' measurements start from c = 1."""
        if self.measured_by_samplers and self.probe is None:
            self.calibrated = True
            return self._from_samplers(step)
        if self.probe is None:
            return None
        with torch.no_grad(), torch.autocast(self.probe[0].device.type, enabled=False):
            if not self.calibrated:
                self._calibrate(model, optimizer, step, self.logits(model))  # between updates the model holds m
            if self.measured_by_samplers:
                return self._from_samplers(step)
            return self._probed(model, optimizer, step, self.logits(model))

    def _from_samplers(self, step: int) -> list[tuple[int, float]]:
        """Each slot's own seed at the scale that the newest version measured since the last plan asks
        for (`feedback_scale` at gain `_FEEDBACK_GAIN`); the gate was the samplers'."""
        if self.served:
            self.freshest = max(version for version, _, _ in self.served)
            newest = [(scale, kl / n, redrawn) for (version, _, scale), (kl, n, redrawn) in self.served.items()
                      if version == self.freshest and n]
            if self.cfg.controlled:
                self.scale = min(feedback_scale(self.scale, [(c, k) for c, k, _ in newest], self.cfg.target_kl,
                                                gain=_FEEDBACK_GAIN), _MAX_SCALE)
            kls = [k for _, k, _ in newest]
            self.latest = {"noise_kl": statistics.median(kls), "noise_kl_served_max": max(kls),
                           "noise_redraws": float(sum(redrawn for *_, redrawn in newest))}
        self.latest = {**self.latest, "noise_scale": self.scale}  # nothing measured since: the figures stand
        self.served = {}
        return [(noise_seed(self.base_seed, step, i, 0), self.scale) for i in range(self.n_slots)]

    def _probed(self, model, optimizer, step: int, mean: list[torch.Tensor]) -> list[tuple[int, float]]:
        """Each slot measured on the probe, redrawn by the gate; the next version's scale from the first draws."""
        firsts, slots, redraws, served = [], [], 0, []
        bound = self.cfg.gate_kl
        for i in range(self.n_slots):
            tried = []
            for draw in range(_REDRAWS + 1 if bound < math.inf else 1):
                seed = noise_seed(self.base_seed, step, i, draw)
                tried.append((self._kl(model, optimizer, seed, mean), seed))
                if tried[-1][0] <= bound:
                    break
            firsts.append(tried[0][0])
            redraws += len(tried) - 1
            kl, seed = min(tried)
            served.append(kl)
            slots.append((seed, self.scale))
        measured = statistics.median(firsts)
        self.latest = {"noise_scale": self.scale, "noise_kl": measured, "noise_kl_served_max": max(served),
                       "noise_redraws": float(redraws)}
        if self.cfg.controlled:
            self.scale = min(next_noise_scale(self.scale, measured, self.cfg.target_kl, gain=_GAIN), _MAX_SCALE)
        return slots

    def _calibrate(self, model, optimizer, step: int, mean: list[torch.Tensor]) -> None:
        """Set the scale before the first version is served: measure, take the quadratic law's step, and
        once a scale below and one above the target are known, bisect between them in log c (a real
        policy's KL grows faster than c² past a point, where the quadratic step overshoots)."""
        self.calibrated = True
        if not self.cfg.controlled:
            return
        below, above = 0.0, math.inf
        for _ in range(_CALIBRATION):
            measured = statistics.median(self._kl(model, optimizer, noise_seed(self.base_seed, step, i, 0), mean)
                                         for i in range(min(self.n_slots, _CALIBRATION_SLOTS)))
            self.latest = {"noise_kl": measured, "noise_kl_served_max": measured, "noise_redraws": 0.0}
            if measured > 0 and abs(math.log(measured / self.cfg.target_kl)) < _CLOSE:
                return
            below, above = (max(below, self.scale), above) if measured < self.cfg.target_kl else (below, min(above, self.scale))
            step_to = next_noise_scale(self.scale, measured, self.cfg.target_kl, max_factor=10.0)
            self.scale = min(math.sqrt(below * above) if below and above < math.inf else step_to, _MAX_SCALE)

    @torch.no_grad()
    def _kl(self, model, optimizer, seed: int, mean: list[torch.Tensor]) -> float:
        """Mean per-token KL(π_θ̂ ‖ π_m) over the probe, θ̂ the slot `seed` at the current scale, served."""
        total, count = 0.0, 0
        with optimizer.at(seed, train=False, scale=self.scale, served=True):
            for rows, at_mean in zip(self._chunks(), mean):
                kl = policy_kl(self._chunk_logits(model, rows), at_mean, self.temperature)
                total, count = total + float(kl.sum()), count + len(kl)
        return total / max(count, 1)

    @torch.no_grad()
    def logits(self, model) -> list[torch.Tensor]:
        """Logits [P_i, V] at the probe's positions, per chunk of rows (`_chunks`)."""
        return [self._chunk_logits(model, rows) for rows in self._chunks()]

    def _chunks(self) -> list[slice]:
        """About `_ROWS` rows per chunk, whole runs of a shared prompt."""
        run = self.probe[-1]
        size = max(1, _ROWS // run) * run if run else _ROWS
        return [slice(r, r + size) for r in range(0, len(self.probe[0]), size)]

    def _chunk_logits(self, model, rows: slice) -> torch.Tensor:
        """The logits where the probe's `rows` predict a token (`prefix_forward.position_logits`)."""
        *tensors, run = self.probe
        return position_logits(model, *(t[rows] for t in tensors), run=run)

    def state(self) -> dict:
        return {"noise_scale": self.scale, "noise_calibrated": self.calibrated}  # `served`: one step's, let go

    def load_state(self, meta: dict) -> None:
        self.scale = float(meta.get("noise_scale", 1.0))
        self.calibrated = bool(meta.get("noise_calibrated", False))


def _prompt_probe(prompts: list[list[int]], device: torch.device):
    """Prompts as probe rows (right-padded): every position that predicts a prompt token, the first
    `_POSITIONS` of each."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
        attn[r, :len(p)] = 1
    where = attn[:, 1:].bool() & (attn[:, 1:].cumsum(1) <= _POSITIONS)
    return ids, attn, where, where, 0


class FixedNoise:
    """No control: the posterior server draws the seeds of its plan and serves σ as IVON learned it
    (noise.target_kl = "off"), or there is no noise to control (exploration none, AdamW)."""

    latest: dict = {}

    def observe(self, batch, group: int = 0) -> None:
        pass

    def plan(self, model, optimizer, step: int) -> None:
        return None

    def state(self) -> dict:
        return {}

    def load_state(self, meta: dict) -> None:
        pass


def make_noise_control(cfg: NoiseConfig, *, serves_noise: bool, n_slots: int, base_seed: int, temperature: float,
                       prompts: list[list[int]] | None = None, device: torch.device | str = "cpu",
                       measured_by_samplers: bool = False):
    """`NoiseControl` where slots serve noise (`serves_noise`: a posterior and a 3PO exploration) and
    a noise.target_kl, fed by the samplers' measurements where `measured_by_samplers`; `FixedNoise`
    otherwise."""
    if serves_noise and cfg.controlled:
        return NoiseControl(cfg, n_slots=n_slots, base_seed=base_seed, temperature=temperature, prompts=prompts,
                            device=device, measured_by_samplers=measured_by_samplers)
    return FixedNoise()
