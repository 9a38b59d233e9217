"""VP2O inside the learner: hooks that apply the pure VP2O functions (algorithms/svgd.py, moe.py,
vp2o.py; algorithms.md §3) to a transformers MoE during training.

The learner's contract, in the order of one step (§3.8):
    with hooks.capture(mask):  out = model(...)          # routing + unweighted expert outputs
    loss = pg_loss + hooks.extra_loss()[0];  loss.backward()
    hooks.transform_grads()                              # EMA, prototypes, attraction, repulsion
    prev = hooks.snapshot();  opt.step();  hooks.after_step(prev, write_back)   # anchor budget
    ... hooks.on_sync() when a version is published     # new anchors
An MoE layer is any module with fused `.experts.gate_up_proj` [E, 2I, H], `.experts.down_proj`
[E, H, I] and a router `.gate` returning (logits, top-k weights, top-k indices), the transformers
≥5 layout of Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE. Shared experts and the router are not particles.

Not here: the formulas (algorithms/), the optimizer, the all-reduce of gradients, when to sync.

Readings of the spec:
- Routing recorded by every forward inside `capture` since the last `transform_grads` forms one
  mini-batch for the co-activation statistics (several gradient points per step pool their tokens).
- `extra_loss` uses the forwards since the last `extra_loss`; L_orth and L_div are averaged over layers.
- With an optimizer that folds `.grad` into its own buffers (IVON zeroes `.grad` when a sample's
  context exits), pass those buffers to `transform_grads(grads=...)`: attraction is linear, so
  transforming the K-sample average equals averaging the transformed samples (same kernel); the
  prototypes and repulsion are then taken at the mean, and IVON's Hessian estimate still sees the
  raw per-sample gradients.
- `capture`'s mask covers the forward's input positions [B, L] (e.g. the attention mask: prompt and
  completion tokens), not the [B, L-1] mask of next-token targets.
- The drift of §3.7 is measured as one fixed function per sync interval: at a sync, v_anc is the
  warm state after `sync_power_iters` more iterations and p_anc = prototypes(W_anc, v_anc,
  power_iters); after each step Δ(W) = anchor_drift(prototypes(W, v_anc, power_iters), p_anc).
  Δ(W_anc) = 0 exactly, so the budget holds by induction; measuring with the moving per-step warm
  state instead made the estimate error alone exceed B_anc (and freeze experts at s = 0) whenever
  the top singular values of an expert are close, as in a freshly initialised model.
- Gradient checkpointing re-runs the router in backward; its second call is recorded too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from threepo.algorithms.moe import (
    coactivation_sets,
    coactivation_stats,
    expert_orthogonality_loss,
    expert_outputs,
    routing_diversification_loss,
    update_coactivation_ema,
)
from threepo.algorithms.svgd import angular_kernel, attract_expert_grads, prototypes, repulsion_energy
from threepo.algorithms.vp2o import prototype_drift_fn, shrink_to_anchor_budget
from threepo.services.learner.config import VP2OConfig


_STATE_KEYS = ("f_hat", "c_hat", "v", "anchor", "anchor_v")


@dataclass
class _Layer:
    """One MoE layer: its modules, VP2O state and what the current forward recorded."""

    name: str                                    # module path, e.g. model.layers.0.mlp
    block: torch.nn.Module
    v: torch.Tensor                              # [E, I] power-iteration warm state
    anchor: torch.Tensor                         # [E, H] anchor prototypes p_anc
    anchor_v: torch.Tensor                       # [E, I] warm state v_anc the drift is measured from
    f_hat: torch.Tensor | None = None            # [E] load EMA
    c_hat: torch.Tensor | None = None            # [E, E] co-activation EMA
    routing: list[torch.Tensor] = field(default_factory=list)   # detached top-k [T_valid, K] per forward
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (y [T,K,H], π [T,E])

    @property
    def params(self) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        experts = self.block.experts
        return experts.gate_up_proj, experts.down_proj

    @property
    def param_names(self) -> tuple[str, str]:
        return f"{self.name}.experts.gate_up_proj", f"{self.name}.experts.down_proj"


def _is_moe_block(module: torch.nn.Module) -> bool:
    experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
    down, gate_up = getattr(experts, "down_proj", None), getattr(experts, "gate_up_proj", None)
    return (isinstance(gate, torch.nn.Module) and isinstance(down, torch.nn.Parameter)
            and isinstance(gate_up, torch.nn.Parameter) and down.dim() == 3 and gate_up.dim() == 3)


class VP2OHooks:
    """VP2O over every MoE layer of a transformers model (algorithms.md §3.8); see the module doc."""

    def __init__(self, model: torch.nn.Module, config: VP2OConfig = VP2OConfig()) -> None:
        self.config = config
        blocks = [(name, m) for name, m in model.named_modules() if _is_moe_block(m)]
        if not blocks:
            raise ValueError(
                "model: no MoE layer found; VP2O needs modules with fused `.experts.gate_up_proj` "
                "[E, 2I, H], `.experts.down_proj` [E, H, I] and a router `.gate` (transformers "
                "Qwen2-MoE / Qwen3-MoE / Mixtral / OLMoE layout; set model.kind=moe)")
        self._layers: list[_Layer] = []
        for i, (name, block) in enumerate(blocks):
            gen = torch.Generator().manual_seed(config.seed + i)
            v, anchor = self._anchor(block.experts.down_proj, None, gen)
            self._layers.append(_Layer(name=name, block=block, v=v, anchor=anchor, anchor_v=v))

    def _anchor(self, down: torch.Tensor, v: torch.Tensor | None,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # (v_anc, p_anc): converge the warm state, then the prototype exactly as the drift measures it
        with torch.no_grad():
            _, v_anc = prototypes(down, v, n_iter=self.config.sync_power_iters, generator=generator)
            p_anc, _ = prototypes(down, v_anc, n_iter=self.config.power_iters)
        return v_anc, p_anc

    @property
    def layer_names(self) -> list[str]:
        """Module paths of the MoE layers found, in model order."""
        return [layer.name for layer in self._layers]

    # ---- forward: routing and expert outputs ---------------------------------------------------
    @contextlib.contextmanager
    def capture(self, mask: torch.Tensor) -> Iterator[None]:
        """Record, for every MoE forward in the body, the router's top-k choices and softmax
        probabilities and the unweighted expert outputs over the valid tokens.
        Args: mask [B, L] (or [B·L]) of valid positions of the forward's input, bool or 0/1."""
        valid = mask.reshape(-1).bool()
        if not bool(valid.any()):
            raise ValueError("mask: selects no tokens; expected at least one valid position")
        for layer in self._layers:
            layer.pending.clear()  # outputs of a forward whose extra_loss was never taken
        handles = [layer.block.gate.register_forward_hook(self._route_hook(layer, valid))
                   for layer in self._layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _route_hook(self, layer: _Layer, valid: torch.Tensor) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output) -> None:
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(f"{layer.name}.gate: expected (logits, top-k weights, top-k indices) "
                                f"as returned by transformers ≥5 routers, got {type(output).__name__}")
            logits, _, topk_idx = output
            hidden = args[0].reshape(-1, args[0].shape[-1])  # the experts' input, [T, H]
            if hidden.shape[0] != valid.numel():
                raise ValueError(f"mask: expected {hidden.shape[0]} positions (the [B, L] of the forward's "
                                 f"input), got {valid.numel()}")
            keep = valid.to(hidden.device)
            idx = topk_idx.reshape(hidden.shape[0], -1)[keep]
            experts = layer.block.experts
            y = expert_outputs(hidden[keep], experts.gate_up_proj, experts.down_proj, idx,
                               getattr(experts, "act_fn", torch.nn.functional.silu))
            probs = logits.reshape(hidden.shape[0], -1)[keep].float().softmax(dim=-1)
            layer.routing.append(idx.detach())
            layer.pending.append((y, probs))

        return hook

    def extra_loss(self) -> tuple[torch.Tensor, dict[str, float]]:
        """λ_orth·L_orth + λ_div·L_div (§3.6), each averaged over layers (and over the forwards
        since the last call), to add to the policy loss before backward. Returns (scalar, metrics)."""
        orth, div = [], []
        for layer in self._layers:
            for y, probs in layer.pending:
                orth.append(expert_orthogonality_loss(y).float())
                div.append(routing_diversification_loss(probs))
            layer.pending.clear()
        if not orth:
            raise RuntimeError("extra_loss: nothing recorded; run the forward inside hooks.capture(mask) first")
        l_orth, l_div = torch.stack(orth).mean(), torch.stack(div).mean()
        loss = self.config.lambda_orth * l_orth + self.config.lambda_div * l_div
        return loss, {"vp2o_l_orth": float(l_orth.detach()), "vp2o_l_div": float(l_div.detach())}

    # ---- after backward: the Stein transport field -----------------------------------------------
    def transform_grads(self, grads: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Replace every layer's expert grads by the attraction average and add γ_rep·∇L_rep to
        down_proj's (§3.4, §3.5), after updating the co-activation EMAs from the recorded routing.
        Args: grads None to use (and set) `param.grad` (None counts as zeros), or a mapping from
        parameter name to a gradient tensor to transform in place (e.g. an optimizer's buffer).
        Returns metrics: mean kernel bandwidth, attraction/repulsion pair counts, L_rep."""
        cfg, bandwidths, n_att, n_rep, l_rep = self.config, [], 0, 0, []
        for layer in self._layers:
            if not layer.routing:
                raise RuntimeError(f"transform_grads: no routing recorded for {layer.name} since the last "
                                   "call; run the forward inside hooks.capture(mask) first")
            gate_up, down = layer.params
            routing = torch.cat(layer.routing)
            f, c = coactivation_stats(routing, down.shape[0])
            layer.routing.clear()
            layer.f_hat, layer.c_hat = update_coactivation_ema(layer.f_hat, layer.c_hat, f, c, cfg.beta_co)
            attract, repel = coactivation_sets(layer.f_hat, layer.c_hat, lift_hi=cfg.lift_hi, lift_lo=cfg.lift_lo,
                                               top_k=routing.shape[1])  # thresholds relative to chance
            with torch.enable_grad():
                p, layer.v = prototypes(down, layer.v, n_iter=cfg.power_iters)
                kernel, bandwidth = angular_kernel(p, h_min=cfg.h_min)
                energy = repulsion_energy(p, bandwidth, repel)
                rep_grad = torch.autograd.grad(cfg.gamma_rep * energy, down)[0] if cfg.gamma_rep else None
            for param, name in zip(layer.params, layer.param_names):
                new = attract_expert_grads(self._grad_of(param, name, grads), kernel, attract, alpha_att=cfg.alpha_att)
                if param is down and rep_grad is not None:
                    new = new + rep_grad.to(new.dtype)
                self._set_grad(param, name, grads, new)
            bandwidths.append(bandwidth)
            n_att += int(torch.triu(attract, diagonal=1).sum())
            n_rep += int(torch.triu(repel | repel.T, diagonal=1).sum())
            l_rep.append(float(energy.detach()))
        return {"vp2o_bandwidth_mean": sum(bandwidths) / len(bandwidths), "vp2o_attract_pairs": float(n_att),
                "vp2o_repel_pairs": float(n_rep), "vp2o_l_rep": sum(l_rep) / len(l_rep)}

    @staticmethod
    def _grad_of(param: torch.nn.Parameter, name: str, grads: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        if grads is not None:
            if name not in grads:
                raise KeyError(f"grads: expected an entry for {name!r}")
            return grads[name]
        return torch.zeros_like(param) if param.grad is None else param.grad

    @staticmethod
    def _set_grad(param: torch.nn.Parameter, name: str, grads: Mapping[str, torch.Tensor] | None,
                  new: torch.Tensor) -> None:
        with torch.no_grad():
            if grads is not None:
                grads[name].copy_(new)
            elif param.grad is None:
                param.grad = new.to(param.dtype)
            else:
                param.grad.copy_(new)

    # ---- around the optimizer step: anchor prototype budget --------------------------------------
    def snapshot(self) -> list[list[torch.Tensor]]:
        """Copies of every layer's (gate_up_proj, down_proj) before the optimizer step."""
        return [[t.detach().clone() for t in layer.params] for layer in self._layers]

    def after_step(self, prev: Sequence[Sequence[torch.Tensor]],
                   write_back: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, float]:
        """Shrink each expert's step so its prototype drift from the anchor stays ≤ B_anc (§3.7).
        Writes the shrunk blocks into the parameters in place and, for an optimizer with its own
        master copy (IVON's fp32 mean), calls write_back(parameter name, new tensor) for each
        parameter that changed. Args: prev from `snapshot()` before the step.
        Returns metrics: fraction of clamped experts over all layers."""
        if len(prev) != len(self._layers):
            raise ValueError(f"prev: expected {len(self._layers)} layers from snapshot(), got {len(prev)}")
        clamped, total = 0.0, 0
        for layer, blocks in zip(self._layers, prev):
            params = layer.params
            drift = prototype_drift_fn(layer.anchor, layer.anchor_v, down_index=1, n_iter=self.config.power_iters)
            new, _, frac = shrink_to_anchor_budget(list(blocks), [p.detach() for p in params], drift,
                                                   self.config.anchor_budget, n_bisect=self.config.n_bisect)
            n_exp = params[1].shape[0]
            clamped, total = clamped + frac * n_exp, total + n_exp
            if frac == 0.0:
                continue
            with torch.no_grad():
                for param, name, tensor in zip(params, layer.param_names, new):
                    param.copy_(tensor)
                    if write_back is not None:
                        write_back(name, tensor)
        return {"vp2o_clamped_frac": clamped / total}

    def on_sync(self) -> None:
        """A version was published: the anchors become the current prototypes (§3.7)."""
        for layer in self._layers:
            layer.anchor_v, layer.anchor = self._anchor(layer.params[1], layer.v)
            layer.v = layer.anchor_v

    # ---- checkpoints ------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """CPU copies of the EMAs, warm-start vectors and anchors, keyed '<layer>/<what>'."""
        out = {}
        for layer in self._layers:
            for key in _STATE_KEYS:
                value = getattr(layer, key)
                if value is not None:
                    out[f"{layer.name}/{key}"] = value.detach().to("cpu", copy=True)
        return out

    def load_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore `state()`; every key must name a layer of this model with a matching shape."""
        known = {layer.name: layer for layer in self._layers}
        for key in tensors:
            layer_name, _, what = key.rpartition("/")
            if layer_name not in known or what not in _STATE_KEYS:
                raise ValueError(f"vp2o state: unexpected key {key!r}; layers are {sorted(known)}")
        for layer in self._layers:
            _, down = layer.params
            n_exp, hid, inter = down.shape
            shapes = {"f_hat": (n_exp,), "c_hat": (n_exp, n_exp), "v": (n_exp, inter), "anchor": (n_exp, hid),
                      "anchor_v": (n_exp, inter)}
            got = {what: tensors.get(f"{layer.name}/{what}") for what in shapes}
            missing = any(got[k] is None for k in ("v", "anchor", "anchor_v"))
            if missing or (got["f_hat"] is None) != (got["c_hat"] is None):
                raise ValueError(f"vp2o state: {layer.name} needs v, anchor and anchor_v, and f_hat and c_hat together")
            for what, value in got.items():
                if value is not None and tuple(value.shape) != shapes[what]:
                    raise ValueError(f"vp2o state: {layer.name}/{what} expected shape {shapes[what]}, "
                                     f"got {tuple(value.shape)}")
                setattr(layer, what, None if value is None else value.to(device=down.device, copy=True))
