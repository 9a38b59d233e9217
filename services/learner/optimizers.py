"""The learner's optimizer, chosen once where the learner is built (`make_optimizer`): one object that
owns its state and answers everything the step asks of an optimizer, whichever it is.

- `IVONPosterior` (optim.name=ivon): a variational posterior N(m, σ²) over the weights
  (algorithms/ivon.py). Gradients are taken at posterior samples θ̂ = m + c · σ ⊙ z(seed) (`at`),
  each step updates (m, h, g_m) from the samples' gradients, and a version publishes (m, σ) with σ
  zero outside the noise mask (`[noise]`, algorithms/noise_mask.py), which is what the engines serve
  and what `at(..., served=True)` rebuilds a served slot with. Among R ranks each tensor's state
  lives with its owner (services/learner/ranks.py).
- `AdamW` (optim.name=adamw, the GRPO baseline): the weights themselves; `at` leaves them as they
  are, a version publishes the mean alone; gradients are summed over ranks and clipped.
- `ZeroAdamW` (adamw with learner.deepspeed_stage ≥ 0): AdamW placed by DeepSpeed at a ZeRO stage
  (services/learner/zero.py): DeepSpeed reduces, clips and steps its partition.
- `LoRAAdamW` (adamw with lora.rank > 0): AdamW on the adapters alone (services/model/lora.py), the base
  frozen; a version publishes the adapters alone with `adapter` = (r, α) where the engines serve
  adapters over their base (every engine, in a run), else the model with the adapters merged, under its
  own parameter names.
- `LoRAIVONPosterior` (ivon with lora.rank > 0): IVON's posterior over the adapters alone, the base
  frozen: slots and gradient points are adapter samples (Â, B̂), and a version publishes the
  adapters' (m, σ) with `adapter` = (r, α), which every engine serves over the base it loaded once.

The interface (what services/learner/core.py calls): `variational`, `at(seed, train, scale, served)`,
`backward(loss)`, `step()`, `expert_grads()` (what VP2O transforms), `whole()`, `published()`,
`served_posterior()`, `state()`/`load_state()`, `save_files()`/`load_files()`, `wants(key)`,
`state_bytes()`, `metrics()`, `adapter` ((r, α) when a version is an adapter posterior, else None).
"""

from __future__ import annotations

import contextlib
import math

import torch

from threepo.algorithms.ivon import IVON
from threepo.algorithms.noise_mask import MaskedSigma, NoiseConfig, noised_names
from threepo.services.learner.optim_config import OptimConfig
from threepo.services.learner.zero import DeepSpeedAdamW
from threepo.services.model.lora import LoRAConfig, merged_weights

_IVON_KINDS = ("mean", "hess", "momentum")


def make_optimizer(model: torch.nn.Module, named: list, optim: OptimConfig, ranks, deepspeed_stage: int,
                   noise: NoiseConfig = NoiseConfig(), lora: LoRAConfig = LoRAConfig(), adapter_versions: bool = False):
    """The optimizer object of `optim.name`, placed on `ranks` (DeepSpeed at `deepspeed_stage` ≥ 0);
    a posterior serves noise on the weights `noise` selects; `lora.rank` > 0: `named` are the adapters
    of `model` (services/model/lora.py), and AdamW's versions are the adapters alone where
    `adapter_versions` (the engines serve adapters over their base), else the merged model."""
    match optim.name, deepspeed_stage >= 0, lora.rank > 0:
        case "ivon", False, False:
            return IVONPosterior(named, optim, ranks, noise)
        case "adamw", False, False:
            return AdamW(named, optim, ranks)
        case "adamw", True, False:
            return ZeroAdamW(model, named, optim, ranks, deepspeed_stage)
        case "adamw", False, True:
            return LoRAAdamW(model, named, optim, ranks, lora, adapter_versions)
        case "ivon", False, True:
            return LoRAIVONPosterior(named, optim, ranks, noise, lora)
    raise ValueError(f"optim.name={optim.name} with learner.deepspeed_stage={deepspeed_stage} and lora.rank="
                     f"{lora.rank}: only adamw trains through DeepSpeed, and LoRA adapters train without it")


def _squared_norm(tensors) -> float:
    return sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in tensors)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


class IVONPosterior:
    """IVON's posterior over this rank's tensors (all of them alone); `ivon` is the torch optimizer."""

    variational = True  # gradient points are posterior samples; the drift is measured at slot weights
    adapter = None  # a version is the whole model's posterior

    def __init__(self, named: list, optim: OptimConfig, ranks, noise: NoiseConfig = NoiseConfig()) -> None:
        self.named, self.ranks = named, ranks
        self.noised = noised_names([n for n, _ in named], noise.modules, noise.layers)  # what slots perturb
        self.noise_rank = noise.slot_rank  # z's rank per matrix in a served slot (0: full)
        if not self.noised:
            raise ValueError(f"noise.modules={noise.modules}, noise.layers={list(noise.layers)}: no parameter of this "
                             "model matches, so no slot would be perturbed; widen noise.layers or set "
                             "noise.modules=everything")
        self.ivon = IVON(ranks.own(named), lr=optim.lr, ess=optim.ess, hess_init=optim.hess_init,
                         beta1=optim.beta1, beta2=optim.beta2, weight_decay=optim.weight_decay,
                         clip_radius=optim.clip_radius, rescale_lr=optim.rescale_lr)
        self._grad_sq: list[float] = []  # ‖ḡ‖² of this rank's tensors, per update since the last metrics()

    def at(self, seed: int | None, train: bool = True, scale: float = 1.0, served: bool = False):
        """Every rank's model at θ̂ = m + c · σ ⊙ z(seed), c = `scale` (≠ 1 only to rebuild a scaled
        slot, never to train); `served`: a served slot, σ zero outside the noise mask (never to
        train; its z of rank `noise.rank`); with train=True the body's gradients are folded into IVON's samples."""
        sigma = MaskedSigma(self.ivon.sigma_by_name(), self.noised) if served else None
        return self.ranks.sampled(self.ivon, self.named, seed, train, scale, sigma, self.noise_rank if served else 0)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self._grad_sq.append(_squared_norm(t for k, t in self.ivon.sample_averages().items() if k.startswith("grad/")))
        self.ivon.step()
        self.ivon.zero_grad(set_to_none=True)
        self.ranks.broadcast_from_owners(self.named)  # every rank's model at the owners' new means

    def expert_grads(self):
        """The K-sample mean gradients (IVON folded `.grad` into them) and how to write a corrected
        weight back into IVON's fp32 master mean."""
        grads = {k[5:]: t for k, t in self.ivon.sample_averages().items() if k.startswith("grad/")}
        return grads, lambda name, t: self.ivon.state[name]["mean"].copy_(t)

    def whole(self):
        return contextlib.nullcontext()

    def served_posterior(self):
        """(m, σ) of this rank's tensors by name as slots are served: σ of the noised tensors alone
        (`MaskedSigma`; live m: do not modify)."""
        return self.ivon.mean_by_name(), MaskedSigma(self.ivon.sigma_by_name(), self.noised)

    def published(self) -> tuple[dict, dict] | None:
        """(m, σ) as fp32 numpy on rank 0, gathered from the owners: m whole, σ of the noised tensors
        only (what every engine serves; a tensor σ leaves out serves m in every slot); None on the
        other ranks."""
        mean, sigma = self.served_posterior()
        mean = self.ranks.gather_first([mean], self.named)
        sigma = self.ranks.gather_first([sigma], [(n, p) for n, p in self.named if n in self.noised])
        if mean is None:
            return None
        # m is live state: a copy; σ is made afresh when h changes
        return {n: t.cpu().numpy().copy() for n, t in mean[0].items()}, {n: t.cpu().numpy() for n, t in sigma[0].items()}

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """m, h and g_m of this rank's tensors; the metadata names the whole model's parameter order."""
        tensors, meta = self.ivon.export_state()
        meta.update(param_order=[n for n, _ in self.named], shapes={n: list(p.shape) for n, p in self.named})
        lora = self._lora()
        return tensors, {"optim": "ivon", "ivon": meta, **({"lora": lora} if lora else {})}

    def _lora(self) -> list | None:
        """What the posterior of `state` is over: None, the model's own weights; [rank, alpha, targets]: adapters."""
        return None

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        _check_trained(meta.get("lora"), self._lora())
        known = {n for n, _ in self.named}  # names this model lacks stay, for IVON's check
        order = [n for n in meta["ivon"]["param_order"] if n in self.ivon.state or n not in known]
        self.ivon.load_exported_state(tensors, {**meta["ivon"], "param_order": order})
        self.ranks.broadcast_from_owners(self.named)

    def save_files(self, directory: str) -> None:
        pass  # everything is in state()

    def load_files(self, directory: str) -> None:
        pass

    def wants(self, key: str) -> bool:
        """Whether checkpoint tensor `key` is this rank's to load: only the tensors it owns."""
        kind, _, name = key.partition("/")
        return kind not in _IVON_KINDS or name in self.ivon.state

    def state_bytes(self) -> int:
        """m, h and g_m of this rank's tensors."""
        return _tensor_bytes(t for st in self.ivon.state.values() for t in st.values())

    def metrics(self) -> dict[str, float]:
        """σ percentiles over all ranks' tensors (sigma_p1, _p50, _p99, _max, _max_over_init) and the
        step's mean gradient norm ‖ḡ‖ over the updates (grad_norm: the K-sample mean IVON steps with)."""
        # a 4k-point strided sample is plenty for logged percentiles (p1: the ~41st smallest) and costs
        # ~0.5 ms, not ~25 ms per step for all of σ (16k points: ~1.3 ms)
        parts = self.ranks.gather_objects((*self.ivon.sigma_points(max_points=(1 << 12) // self.ranks.world),
                                           self._grad_sq))
        summary = self.ivon.sigma_summary(torch.cat([p for p, _, _ in parts]), max(top for _, top, _ in parts))
        norms = [math.sqrt(sum(update)) for update in zip(*(sq for _, _, sq in parts))]
        self._grad_sq = []
        return {f"sigma_{k}": float(v) for k, v in summary.items()} | (
            {"grad_norm": sum(norms) / len(norms)} if norms else {})


class AdamW:
    """torch's AdamW on the model's parameters, every rank holding its state whole; `torch` is it."""

    variational = False  # gradients at the weights themselves; the drift is update 0's own forward
    noise_rank = 0  # no slot noise
    adapter = None  # a version is the whole model

    def __init__(self, named: list, optim: OptimConfig, ranks) -> None:
        self.named, self.ranks, self.grad_clip = named, ranks, optim.grad_clip
        self.torch = self._make(optim)
        self._grad_norms: list[float] = []  # before the clip, per update since the last metrics()

    def _make(self, optim: OptimConfig):
        return torch.optim.AdamW([p for _, p in self.named], lr=optim.lr, betas=(optim.beta1, optim.beta2),
                                 weight_decay=optim.weight_decay)

    def at(self, seed: int | None, train: bool = True, scale: float = 1.0, served: bool = False):
        return contextlib.nullcontext()  # there is one policy: the weights

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.ranks.all_reduce_grads(self.named)
        self._grad_norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.grad_clip)))
        self.torch.step()
        self.torch.zero_grad(set_to_none=True)

    def expert_grads(self):
        return None, None  # VP2O transforms `.grad` in place, AdamW steps the weights themselves

    def whole(self):
        """A context in which every parameter is whole."""
        return contextlib.nullcontext()

    def served_posterior(self):
        raise TypeError("AdamW holds no posterior (optim.name=ivon does)")

    def published(self) -> tuple[dict, None] | None:
        """(the weights as fp32 numpy, no σ) on rank 0; None on the other ranks."""
        with self.whole():
            mean = {n: p.detach().float().cpu().numpy().copy() for n, p in self.named}
        return (mean, None) if self.ranks.first else None

    def _weights(self) -> dict[str, torch.Tensor]:
        with self.whole():
            return {f"param/{n}": p.detach().cpu().clone() for n, p in self.named} if self.ranks.first else {}

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The weights and the moments, written by rank 0 (every rank holds them whole)."""
        tensors = self._weights()
        if self.ranks.first:
            for i, st in self.torch.state_dict()["state"].items():
                for k, v in st.items():
                    tensors[f"adamw/{i}/{k}"] = v.cpu().clone() if torch.is_tensor(v) else torch.tensor(v)
        lora = self._lora()
        return tensors, {"optim": "adamw", **({"lora": lora} if lora else {})}

    def _lora(self) -> list | None:
        """What the weights of `state` are: None, the model's own; [rank, alpha, targets]: adapters."""
        return None

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """The weights, and the moments where the checkpoint has them (a ZeroAdamW's has none: fresh)."""
        _check_trained(meta.get("lora"), self._lora())
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(tensors[f"param/{n}"])
        state = {"state": {}, "param_groups": self.torch.state_dict()["param_groups"]}
        for key, v in tensors.items():
            if key.startswith("adamw/"):
                _, i, k = key.split("/")
                state["state"].setdefault(int(i), {})[k] = v
        self.torch.load_state_dict(state)

    def save_files(self, directory: str) -> None:
        pass

    def load_files(self, directory: str) -> None:
        pass

    def wants(self, key: str) -> bool:
        return True

    def state_bytes(self) -> int:
        """AdamW's moments."""
        return _tensor_bytes(t for st in self.torch.state.values() for t in st.values())

    def metrics(self) -> dict[str, float]:
        """The step's mean gradient norm over its updates, before the clip (grad_norm)."""
        norms, self._grad_norms = self._grad_norms, []
        return {"grad_norm": sum(norms) / len(norms)} if norms else {}


def _spec(lora: LoRAConfig) -> list:
    return [lora.rank, lora.alpha, list(lora.target_modules)]


def _check_trained(saved: list | None, here: list | None) -> None:
    if saved != here:
        raise ValueError(f"the learner checkpoint holds {_trained(saved)}, this run trains {_trained(here)}: "
                         "resume with the [lora] settings it was written with")


def _trained(lora: list | None) -> str:
    return "every weight" if not lora else f"LoRA adapters (rank {lora[0]}, alpha {lora[1]:g}, on {', '.join(lora[2])})"


class LoRAAdamW(AdamW):
    """AdamW on the LoRA adapters of `model` (`named`), the base frozen (services/model/lora.py). A version
    is the adapters alone with `adapter` = (r, α) when `adapter_versions` (engines that serve
    adapters over the base they loaded), else the model with the adapters merged."""

    def __init__(self, model: torch.nn.Module, named: list, optim: OptimConfig, ranks, lora: LoRAConfig,
                 adapter_versions: bool = False) -> None:
        self.model, self.lora = model, lora
        self.adapter = (lora.rank, lora.alpha) if adapter_versions else None
        super().__init__(named, optim, ranks)

    def published(self) -> tuple[dict, None] | None:
        """(the adapters, or the model with its adapters merged under its own names, as fp32 numpy;
        no σ) on rank 0."""
        if not self.ranks.first:
            return None
        weights = {n: p.detach() for n, p in self.named} if self.adapter else merged_weights(self.model)
        return {n: t.float().cpu().numpy().copy() for n, t in weights.items()}, None

    def _lora(self) -> list:
        return _spec(self.lora)


class LoRAIVONPosterior(IVONPosterior):
    """IVON's posterior over the LoRA adapters of a model (`named`: its lora_A/lora_B weights), the
    base frozen (services/model/lora.py). Everything is IVONPosterior's, over adapter tensors: a slot is
    the adapter sample Â = m_A + c · σ_A ⊙ z, B̂ likewise, under the noise mask (which matches an
    adapter by its layer's name); a version publishes the adapters' (m, σ), sized ~2 r (in + out)
    per adapted layer instead of in · out, with `adapter` = (r, α)."""

    def __init__(self, named: list, optim: OptimConfig, ranks, noise: NoiseConfig, lora: LoRAConfig) -> None:
        super().__init__(named, optim, ranks, noise)
        self.lora, self.adapter = lora, (lora.rank, lora.alpha)

    def _lora(self) -> list:
        return _spec(self.lora)


class ZeroAdamW(AdamW):
    """AdamW through a DeepSpeed engine at ZeRO `stage`: it reduces, clips and steps this rank's
    partition, and checkpoints its own per-rank files; rank 0 also writes the whole weights."""

    def __init__(self, model: torch.nn.Module, named: list, optim: OptimConfig, ranks, stage: int) -> None:
        self.engine = DeepSpeedAdamW(model, optim, stage, ranks.rank, ranks.world)
        super().__init__(named, optim, ranks)

    def _make(self, optim: OptimConfig):
        return self.engine.optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def whole(self):
        """A context in which every parameter is whole (ZeRO-3 gathers them: a collective)."""
        return self.engine.gathered([p for _, p in self.named])

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        return self._weights(), {"optim": "adamw", "deepspeed": True}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        pass  # load_files loaded DeepSpeed's own part

    def save_files(self, directory: str) -> None:
        self.engine.save(directory)  # DeepSpeed's own per-rank files (a collective)

    def load_files(self, directory: str) -> None:
        self.engine.load(directory)

    def state_bytes(self) -> int:
        return self.engine.state_bytes()
