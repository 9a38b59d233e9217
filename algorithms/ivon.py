"""IVON, the diagonal Gaussian posterior q(θ) = N(m, σ²) over the weights (algorithms.md §1).

What this is: `IVON`, a torch optimizer built on the update of §1.2, re-derived from its formulas as pure
tensor functions in ivon_update.py (ivon-opt is GPL-3.0; nothing here is copied from it or imports it). Its state (fp32
mean m, Hessian h, momentum g_m; the step count t in the param group) is keyed by parameter name and exports
to the layout of §1.6. A sample θ̂ = m + σ ⊙ z is written with `param_noise.load_perturbed`, so the θ̂ of a
seed is exactly the one a sampler engine builds.

What this is not: no collectives (a data-parallel learner sums the gradients over its ranks before each sample
is folded in and steps only the tensors it owns: ivon_shard.py), no schedule (set `param_groups[0]["lr"]`), no
file I/O (`export_state` returns tensors and a JSON-able dict), no closure-driven MC loop.

Departures from ivon-opt 0.1.3 (§1.5), each deliberate:
- gradients are zeroed between MC samples (§1.5 item 10 [OURS]); a `.grad` of None counts as zeros (unrouted
  MoE experts, §1.5 item 1);
- state and the mean are fp32 whatever the parameter dtype; m lives in the state and p.data is a copy of it,
  restored with `copy_` in a `finally` (never rebound, never by subtracting noise);
- z is drawn per tensor from (seed, name) on the parameter's device (`param_noise.noise_like`), not one flat
  randn, and drawn again when the sample is folded in rather than kept (§1.5 item 5, §1.6);
- a training sample with `seed=None` has ε = 0, so its Price Hessian estimate is exactly 0;
- the step count lives in the param group, so `state_dict()` and `export_state()` both carry it;
- constructor defaults are the project's system defaults (§7, the 3PO values), not ivon-opt's;
- `load_exported_state` takes the hyperparameters from the constructor (the config owns them); the exported
  ones are informational, for the posterior server."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch

from threepo.algorithms.ivon_update import (gradsq_hessian_estimate, hessian_update, mean_step, momentum_update,
                                            price_hessian_estimate)
from threepo.algorithms.param_noise import SigmaView, load_perturbed, noise_like, posterior_sigma

HESS_APPROX = ("price", "gradsq")
_SECOND = {"price": "nxg", "gradsq": "gsq"}  # the accumulated second moment of each hess_approx
_STATE_KINDS = ("mean", "hess", "momentum")
_STEP_CHUNK = 1 << 22  # elements of a tensor `IVON.step` updates at once (16 MB in fp32)
_HYPER = ("lr", "ess", "hess_init", "beta1", "beta2", "weight_decay", "clip_radius", "rescale_lr",
          "debias", "hess_approx")


def _check_hyper(lr, ess, hess_init, beta1, beta2, weight_decay, clip_radius, hess_approx) -> None:
    checks = [("lr", lr, lr >= 0), ("ess", ess, ess > 0),
              ("hess_init", hess_init, hess_init >= 0 and hess_init + weight_decay > 0),
              ("beta1", beta1, 0 <= beta1 < 1), ("beta2", beta2, 0 <= beta2 <= 1),
              ("weight_decay", weight_decay, weight_decay >= 0),
              ("clip_radius", clip_radius, clip_radius > 0),
              ("hess_approx", hess_approx, hess_approx in HESS_APPROX)]
    for name, value, ok in checks:
        if not ok:
            raise ValueError(f"IVON: invalid {name}={value!r}")


class IVON(torch.optim.Optimizer):
    """IVON as a torch optimizer over named parameters; state keyed by name (§1.2, §1.6). Use: for
    each of K samples, `with opt.sampled_params(seed): loss.backward()`; then `opt.step()`."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *, lr: float, ess: float,
                 hess_init: float = 1e-3, beta1: float = 0.9, beta2: float = 0.9999,
                 weight_decay: float = 1e-6, clip_radius: float = 1e-3, rescale_lr: bool = True,
                 debias: bool = True, hess_approx: str = "price") -> None:
        _check_hyper(lr, ess, hess_init, beta1, beta2, weight_decay, clip_radius, hess_approx)
        named_params = list(named_params)
        names = [name for name, _ in named_params]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"IVON needs at least one parameter and unique names, got {names[:8]}")
        defaults = dict(lr=lr, ess=ess, hess_init=hess_init, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, clip_radius=clip_radius, rescale_lr=rescale_lr,
                        debias=debias, hess_approx=hess_approx, step=0)
        super().__init__(named_params, defaults)
        for name, p in self._named():
            mean = p.detach().to(torch.float32, copy=True)
            self.state[name] = {"mean": mean, "hess": torch.full_like(mean, hess_init),
                                "momentum": torch.zeros_like(mean)}
        self._reset_samples()

    def _named(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert len(self.param_groups) == 1, "IVON keeps one parameter group (λ and δ are global)"
        group = self.param_groups[0]
        return zip(group["param_names"], group["params"])

    def _reset_samples(self) -> None:
        self._count = 0
        self._avg: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def sampled_params(self, seed: int | None, train: bool = True, scale: float = 1.0,
                       sigma: Mapping[str, torch.Tensor] | None = None, rank: int = 0) -> Iterator[None]:
        """Write θ̂ = m + c · σ ⊙ z(seed, name) into p.data (cast to its dtype), yield, restore m.
        With train=True (z drawn once) the gradients left by the body are folded into the running (Welford)
        means ḡ = mean_k ĝ_k and mean_k ε_k ⊙ ĝ_k (or ĝ_k²), then zeroed (§1.2). If the body
        raises, nothing is accumulated; p.data is restored from the fp32 mean in every case.
        `scale` (c, a slot's σ multiplier) rebuilds a scaled slot for evaluation only: the Price
        estimate assumes ε ~ N(0, σ²), so a training sample must have c = 1. `sigma` replaces the
        posterior's σ to rebuild a served slot (e.g. zero outside a noise mask), and `rank` > 0 draws
        its z of that rank per matrix (`param_noise.low_rank_noise`), never to train."""
        if train and (scale != 1.0 or sigma is not None or rank):
            raise ValueError(f"sampled_params: a training sample needs scale 1, full-rank noise and the posterior's "
                             f"own σ (ε ~ N(0, σ²)), got scale {scale}, rank {rank}"
                             f"{' and another σ' if sigma is not None else ''}")
        try:
            load_perturbed(self._named(), self.mean_by_name(), self.sigma_by_name() if sigma is None else sigma,
                           seed, scale, rank)
            yield
            if train:
                self._accumulate(seed)
                self.zero_grad(set_to_none=True)
        finally:
            with torch.no_grad():
                for name, p in self._named():
                    p.copy_(self.state[name]["mean"])

    @torch.no_grad()
    def _accumulate(self, seed: int | None) -> None:
        # z is drawn again from (seed, name), tensor by tensor, rather than held through the backward:
        # a whole copy of the model less at the learner's peak, for one more draw per update
        self._count += 1
        second = _SECOND[self.param_groups[0]["hess_approx"]]
        sigmas = self.sigma_by_name()
        for name, p in self._named():
            mean = self.state[name]["mean"]
            grad = torch.zeros_like(mean) if p.grad is None else p.grad.detach().to(torch.float32)
            if second == "gsq":
                moment = grad * grad
            elif seed is None:
                moment = torch.zeros_like(mean)
            else:
                moment = noise_like(seed, name, mean.shape, mean.device).mul_(sigmas[name]).mul_(grad)
            if self._count == 1:  # the first sample is its own mean (Welford from 0, exactly); the
                self._avg[name] = {"grad": grad, second: moment}  # caller drops p.grad right after
                continue
            avg = self._avg[name]  # Welford running mean: avg += (x - avg) / k, exact for any K
            avg["grad"].add_(grad - avg["grad"], alpha=1.0 / self._count)
            avg[second].add_(moment - avg[second], alpha=1.0 / self._count)

    def sample_averages(self) -> dict[str, torch.Tensor]:
        """The live K-sample means, {'grad/<name>', 'nxg/<name>' or 'gsq/<name>'}: fp32 [shape].
        Among data-parallel ranks they are already global: each sample's gradients are summed over
        the ranks before they are folded in (algorithms/ivon_shard.py)."""
        return {f"{kind}/{name}": t for name, avg in self._avg.items() for kind, t in avg.items()}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """One posterior update from the accumulated samples (§1.2), then reset the accumulators:
        t ← t+1; g_m ← momentum_update; h ← hessian_update(ĥ); m ← mean_step; p.data ← m."""
        if closure is not None:
            raise ValueError("IVON.step takes no closure: run each sample inside sampled_params()")
        if self._count == 0:
            raise RuntimeError("IVON.step() without a gradient sample: backward inside sampled_params(seed)")
        group = self.param_groups[0]
        group["step"] += 1
        hyper = {k: group[k] for k in ("lr", "step", "beta1", "weight_decay", "hess_init", "clip_radius",
                                       "rescale_lr", "debias")}
        for name, p in self._named():
            st, avg = self.state[name], self._avg.pop(name)
            # new values copied into the state's own tensors (long-lived buffers never move: a 135M model's step
            # peaked 0.9 GB higher otherwise), a flat piece at a time: each operation is elementwise (the same
            # values), and the temporaries are a few pieces, not a few copies of a 113 MB embedding
            m, h, g_m = (st[k].view(-1) for k in _STATE_KINDS)
            second = _SECOND[group["hess_approx"]]
            grad, moment = avg["grad"].reshape(-1), avg[second].reshape(-1)
            for at in (slice(a, a + _STEP_CHUNK) for a in range(0, m.numel(), _STEP_CHUNK)):
                g_m[at] = momentum_update(g_m[at], grad[at], group["beta1"])
                est = (price_hessian_estimate(moment[at], h[at], group["ess"], group["weight_decay"])
                       if second == "nxg" else gradsq_hessian_estimate(moment[at], group["ess"]))
                h[at] = hessian_update(h[at], est, group["beta2"], group["weight_decay"])
                m[at] = mean_step(m[at], g_m[at], h[at], **hyper)
            del avg, grad, moment  # this tensor's accumulators are spent
            p.copy_(st["mean"])
        self._reset_samples()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, then p.data ← the loaded fp32 mean and the accumulators reset."""
        super().load_state_dict(state_dict)
        self._reset_samples()
        with torch.no_grad():
            for name, p in self._named():
                p.copy_(self.state[name]["mean"])

    def sigma_by_name(self) -> Mapping[str, torch.Tensor]:
        """σ = 1 / sqrt(λ (h + δ)) per parameter (§1.1): {name: fp32 [shape]}, each tensor computed
        when it is read (a fresh tensor per read; iterate once rather than index repeatedly)."""
        group = self.param_groups[0]
        return SigmaView(self.hess_by_name(), group["ess"], group["weight_decay"])

    def mean_by_name(self) -> dict[str, torch.Tensor]:
        """The fp32 master mean m per parameter: live state tensors, do not modify."""
        return {name: self.state[name]["mean"] for name, _ in self._named()}

    def hess_by_name(self) -> dict[str, torch.Tensor]:
        """The fp32 Hessian estimate h per parameter: live state tensors, do not modify."""
        return {name: self.state[name]["hess"] for name, _ in self._named()}

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The §1.6 layout: tensors {'mean/<name>', 'hess/<name>', 'momentum/<name>'} (fp32 on the CPU;
        the live state where it is there: write them out before the next step) and metadata
        {step_t, the hyperparameters, param_order, shapes} (JSON-able)."""
        tensors = {f"{kind}/{name}": self.state[name][kind].detach().to("cpu")
                   for name, _ in self._named() for kind in _STATE_KINDS}
        group = self.param_groups[0]
        meta = {"step_t": int(group["step"]), **{k: group[k] for k in _HYPER},
                "param_order": list(group["param_names"]),
                "shapes": {name: list(p.shape) for name, p in self._named()}}
        return tensors, meta

    @torch.no_grad()
    def load_exported_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Inverse of `export_state`: m, h, g_m and the step count t; p.data ← m. Raises
        ValueError naming the first missing, unexpected or mis-shaped parameter."""
        names = [name for name, _ in self._named()]
        missing = [n for n in names if n not in meta["param_order"]]
        extra = [n for n in meta["param_order"] if n not in names]
        if missing or extra:
            raise ValueError(f"exported IVON state does not match the parameters: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        for name, p in self._named():
            for kind in _STATE_KINDS:
                key = f"{kind}/{name}"
                if key not in tensors:
                    raise ValueError(f"exported IVON state lacks {key!r}")
                if tuple(tensors[key].shape) != tuple(p.shape):
                    raise ValueError(f"{key}: shape {tuple(tensors[key].shape)}, parameter {tuple(p.shape)}")
                self.state[name][kind] = tensors[key].to(device=p.device, dtype=torch.float32, copy=True)
            p.copy_(self.state[name]["mean"])
        self.param_groups[0]["step"] = int(meta["step_t"])
        self._reset_samples()

    @torch.no_grad()
    def sigma_points(self, max_points: int) -> tuple[torch.Tensor, float]:
        """An evenly strided subsample of σ over this optimizer's tensors (CPU fp32, at most
        ~`max_points`) and the exact max σ; several shards' are concatenated for `sigma_summary`
        (σ over all parameters, for logging the runaway-σ hazard: algorithms.md §1.3)."""
        total = sum(p.numel() for _, p in self._named())
        stride = max(1, math.ceil(total / max(max_points, 1)))
        points, top, group = [], 0.0, self.param_groups[0]
        for name, _ in self._named():  # σ falls as h grows: its max is σ at the least h
            hess = self.state[name]["hess"].flatten()
            points.append(posterior_sigma(hess[::stride], group["ess"], group["weight_decay"]).cpu())
            top = max(top, float(posterior_sigma(hess.min(), group["ess"], group["weight_decay"])))
        return torch.cat(points), top

    def sigma_summary(self, points: torch.Tensor, top: float,
                      quantiles: tuple[float, ...] = (0.01, 0.5, 0.99)) -> dict[str, float]:
        """From σ `points` and their max `top`: {'p1', 'p50', 'p99' (per `quantiles`), 'max',
        'max_over_init' = max σ / σ0} with σ0 = 1/sqrt(λ(h0+δ))."""
        group = self.param_groups[0]
        quant = torch.quantile(points.double(), torch.tensor(quantiles, dtype=torch.float64))
        sigma0 = 1.0 / math.sqrt(group["ess"] * (group["hess_init"] + group["weight_decay"]))
        out = {f"p{100 * q:g}": float(v) for q, v in zip(quantiles, quant)}
        return {**out, "max": top, "max_over_init": top / sigma0}
