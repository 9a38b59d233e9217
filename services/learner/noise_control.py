"""The learner's noise control: the seeds and the σ scale c of the slots each version serves, so that
the per-token KL(π_θ̂ ‖ π_m) of a served slot stays at `noise.target_kl` (algorithms/noise_scale.py;
issue 25).

When the learner publishes a version, `plan` measures each slot's KL to the mean on a probe (a few
rollouts of the latest step, their first `_POSITIONS` predicted tokens, in runs of rows of one prompt
whose prompt is computed once; before the first step, the training prompts it was given), exactly over
the vocabulary at the sampler's temperature, with the slot built as the engines will serve it (σ zero
outside the noise mask, times c). A slot whose KL exceeds `noise.gate` × target is redrawn with the next
seed (`exploration.noise_seed`), up to `_REDRAWS` times, keeping the closest draw if none passes. The
version serves its slots at the scale just measured; the median KL of the first draws (of the scale, not
of the gate's choice) sets the next version's scale: half the quadratic law's step in log c (`_GAIN`:
the probe's sampling noise moves c less). The median, not the mean: a slot's KL is heavy-tailed in z (on
the embedded model at twice the target's scale, one draw in eight measured 25x the others' KL, a draw
that breaks the policy), which is the gate's business, not the scale's. At the start, with no rollouts
yet, the scale is calibrated on the prompts, on the first `_CALIBRATION_SLOTS` slots, in up to
`_CALIBRATION` rounds (the quadratic law's step, then bisection once the target is bracketed) before the
first version is served. The scale stays at most `_MAX_SCALE`: where the noise cannot reach the target
(a masked model's KL saturates) it stops there rather than growing without bound.

The metrics (every step logs the latest version's): noise_scale (c served), noise_kl (median first-draw
KL at it), noise_kl_served_max (the largest KL among the served slots), noise_redraws.
"""

from __future__ import annotations

import math
import statistics

import torch

from threepo.algorithms.exploration import noise_seed
from threepo.algorithms.noise_mask import NoiseConfig
from threepo.algorithms.noise_scale import next_noise_scale, policy_kl
from threepo.services.prefix_forward import position_logits

_POSITIONS = 64  # predicted tokens of each probe row
_ROWS = 4  # probe rows per forward (a chunk's logits: rows × 64 × V floats)
_REDRAWS = 3  # most new seeds for a slot over the gate
_CALIBRATION = 8  # most measurements to set the first version's scale
_CALIBRATION_SLOTS = 8  # slots measured per calibration round
_CLOSE = math.log(1.25)  # calibration stops within a factor 1.25 of the target
_GAIN = 0.5  # share of the quadratic law's step in log c per version (a probe's KL is noisy)
_MAX_SCALE = 10.0  # a target the noise cannot reach (the KL saturates) leaves c here, not growing forever


class NoiseControl:
    """Seeds and σ scale of each published version's slots (module docstring)."""

    def __init__(self, cfg: NoiseConfig, *, n_slots: int, base_seed: int, temperature: float,
                 prompts: list[list[int]] | None = None, device: torch.device | str = "cpu") -> None:
        self.cfg, self.n_slots, self.base_seed, self.temperature = cfg, n_slots, base_seed, temperature
        self.scale, self.calibrated, self.latest = 1.0, False, {}
        self.device = torch.device(device)
        self.probe = _prompt_probe(prompts, self.device) if prompts else None

    def observe(self, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, group: int = 0) -> None:
        """Take about `probe_rows` rows of a step's batch, evenly spread, as the probe (their first
        predicted tokens: `mask` [B, L-1] marks where position t predicts a completion token). With
        `group` > 1 the batch's rows come in consecutive groups of that many sharing a prompt: the probe
        then takes runs of rows of one group (two from each of `probe_rows` / 2 groups, more from each
        where there are fewer groups), and each run's prompt is computed once (prefix_forward)."""
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
        """(seed, scale) of each slot of the version published at learner step `step`, or None without a
        probe (the posterior server then plans its own seeds at scale 1). Measured in fp32 whatever the
        learner's mixed precision: a KL of 0.01 is below bf16's rounding of the logits."""
        if self.probe is None:
            return None
        with torch.no_grad(), torch.autocast(self.probe[0].device.type, enabled=False):
            return self._plan(model, optimizer, step)

    def _plan(self, model, optimizer, step: int) -> list[tuple[int, float]]:
        mean = self.logits(model)  # between updates the model holds m
        if not self.calibrated:
            self._calibrate(model, optimizer, step, mean)
        firsts, slots, redraws, served = [], [], 0, []
        bound = self.cfg.gate * self.cfg.target_kl if self.cfg.gate and self.cfg.target_kl else math.inf
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
        if self.cfg.target_kl:
            self.scale = min(next_noise_scale(self.scale, measured, self.cfg.target_kl, gain=_GAIN), _MAX_SCALE)
        return slots

    def _calibrate(self, model, optimizer, step: int, mean: list[torch.Tensor]) -> None:
        """Set the scale before the first version is served: measure, take the quadratic law's step, and
        once a scale below and one above the target are known, bisect between them in log c (a real
        policy's KL grows faster than c² past a point, where the quadratic step overshoots)."""
        self.calibrated = True
        if not self.cfg.target_kl:
            return
        below, above = 0.0, math.inf
        for _ in range(_CALIBRATION):
            measured = statistics.median(self._kl(model, optimizer, noise_seed(self.base_seed, step, i, 0), mean)
                                         for i in range(min(self.n_slots, _CALIBRATION_SLOTS)))
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
        return {"noise_scale": self.scale, "noise_calibrated": self.calibrated}

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
    (noise.target_kl = 0), or there is no noise to control (grpo, AdamW)."""

    latest: dict = {}

    def observe(self, input_ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor, group: int = 0) -> None:
        pass

    def plan(self, model, optimizer, step: int) -> None:
        return None

    def state(self) -> dict:
        return {}

    def load_state(self, meta: dict) -> None:
        pass


def make_noise_control(cfg: NoiseConfig, *, serves_noise: bool, n_slots: int, base_seed: int, temperature: float,
                       prompts: list[list[int]] | None = None, device: torch.device | str = "cpu"):
    """`NoiseControl` where slots serve noise (`serves_noise`: a posterior and a 3PO exploration) and
    noise.target_kl > 0; `FixedNoise` otherwise."""
    if serves_noise and cfg.target_kl:
        return NoiseControl(cfg, n_slots=n_slots, base_seed=base_seed, temperature=temperature, prompts=prompts,
                            device=device)
    return FixedNoise()
