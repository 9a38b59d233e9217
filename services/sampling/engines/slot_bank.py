"""The hf engine's weight sets: the served mean and the perturbed slots of one version, in flat buffers.

The model's own parameters are views of one flat weight set (`lean_decoder.bind`): the mean, in the
served dtype, held once. Each slot θ̂ = m + c · σ ⊙ z(seed) that the engine serves is built into one
row of a bank [K, numel] (`SlotBank`), in the same layout, so a decoder over any run of consecutive
rows reads them in place (no stacked copies), and the rows a call does not need stay built for the
next call. The bank is bounded in bytes (`sampler.slot_cache_mb`): K = that budget over the bytes of
one weight set (at least one row), grown as slots are asked for; a slot not asked for the longest
is overwritten first. A new version empties it.

The weight check per row: the fingerprint of the values written (θ̂ cast to the served dtype, as
computed) against the row after writing (`loaded`), and against the row after each call (`holds`).

A LoRA version (`Adapters`) is decoded over the base set with each slot's adapter sample stacked
beside it (`Adapters.slot_terms`, adapter-sized: no weight set per slot); its merged weights W0 + s ·
B̂ Â (`Adapters.weight`) are what a slot serves on the engine's other path (transformers' forward) and
what `served` reports.

Not here: drawing z (algorithms/param_noise.py), decoding (lean_decoder.py), sampling (hf.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch

from threepo.algorithms import param_noise, weight_checks
from threepo.services.sampling.engines.lean_decoder import WeightLayout

Key = tuple  # (seed, σ multiplier) of a slot


class SlotBank:
    """Perturbed weight sets of one version, one per row (see the module docstring)."""

    def __init__(self, layout: WeightLayout, dtype: torch.dtype, budget_bytes: int,
                 device: torch.device | str = "cpu") -> None:
        self.layout, self.dtype, self.device = layout, dtype, torch.device(device)
        self.set_bytes = layout.numel * torch.empty(0, dtype=dtype).element_size()
        self.capacity = max(1, budget_bytes // max(self.set_bytes, 1))
        self.rows = torch.empty(0, layout.numel, dtype=dtype, device=self.device)
        self._at: OrderedDict[Key, int] = OrderedDict()  # slot -> row, least recently used first
        self._checks: dict[int, tuple[tuple[int, int], bool, float]] = {}  # row -> (fingerprint fed, loaded, ratio)

    def clear(self) -> None:
        """Forget every slot (a new version); the rows are kept for reuse."""
        self._at.clear()
        self._checks.clear()

    def place(self, keys: Sequence[Key], build: Callable[[Key, dict[str, torch.Tensor]], float]) -> list[int]:
        """Rows holding the slots `keys` (at most `capacity`), consecutive where they can be: a slot
        not resident is built by `build(key, views of its row by name)`, which writes θ̂ and returns
        its served-noise ratio."""
        if len(keys) > self.capacity:
            raise ValueError(f"{len(keys)} slots asked for at once, the bank holds {self.capacity}")
        self._grow(min(self.capacity, len(self._at) + sum(k not in self._at for k in keys)))
        for key in keys:
            if key in self._at:
                self._at.move_to_end(key)
                continue
            free = sorted(set(range(len(self.rows))) - set(self._at.values()))
            row = free[0] if free else self._evict(keys)
            self._at[key] = row
            self._checks[row] = self._build(key, row, build)
        return [self._at[k] for k in keys]

    def sets(self, rows: Sequence[int]) -> torch.Tensor:
        """Weight sets [S, numel] of `rows` in that order: a view where they are consecutive."""
        first = rows[0]
        if list(rows) == list(range(first, first + len(rows))):
            return self.rows[first:first + len(rows)]
        return self.rows[torch.tensor(list(rows), device=self.device)]  # a copy, for this call only

    def loaded(self, row: int) -> bool:
        return self._checks[row][1]

    def ratio(self, row: int) -> float:
        return self._checks[row][2]

    def holds(self, row: int) -> bool:
        """Does `row` still hold exactly the values written into it?"""
        return _fingerprint(self.rows[row]) == self._checks[row][0]

    def forget(self, key: Key) -> None:
        """Drop slot `key` (a failed check): it is built afresh when asked for again."""
        row = self._at.pop(key, None)
        self._checks.pop(row, None)

    def _grow(self, size: int) -> None:
        if size > len(self.rows):
            grown = torch.empty(size, self.layout.numel, dtype=self.dtype, device=self.device)
            grown[:len(self.rows)] = self.rows
            self.rows = grown

    def _evict(self, keep: Sequence[Key]) -> int:
        victim = next(k for k in self._at if k not in keep)
        row = self._at.pop(victim)
        self._checks.pop(row, None)
        return row

    def _build(self, key: Key, row: int, build) -> tuple[tuple[int, int], bool, float]:
        views = self.layout.views(self.rows[row])
        ratio, fed = build(key, views)
        return fed, _fingerprint(self.rows[row]) == fed, ratio


def _fingerprint(row: torch.Tensor) -> tuple[int, int]:
    """`value_fingerprint` of a flat weight set in pieces of 2^22 values (the same value: it is a sum;
    its int32 working copies stay 16 MB instead of twice the set's size)."""
    return weight_checks.value_fingerprint(row.split(1 << 22))


def write_slot(views: Mapping[str, torch.Tensor], mean: Mapping[str, torch.Tensor],
               sigma: Mapping[str, torch.Tensor], seed: int | None, scale: float,
               rank: int = 0, adapters: Adapters | None = None) -> tuple[float, tuple[int, int]]:
    """θ̂ = m + c · σ ⊙ z(seed) (the mean for seed None; z of rank `rank` per matrix when > 0) written
    into `views` (by name, in their dtype); a layer `adapters` adapt gets W0 + s · B̂ Â instead, its
    adapter drawn at (seed, c) (`Adapters.weight`). Returns the served-noise ratio and the
    fingerprint of the values written."""
    served, intended, parts = 0.0, 0.0, []
    for name, view in views.items():
        if adapters is not None and name in adapters.pairs:
            theta = adapters.weight(name, seed, scale, rank)
            reference = adapters.weight(name, None) if seed is not None else None
        elif seed is not None and name in sigma:
            theta = param_noise.perturbed(mean[name], sigma[name], seed, name, scale, rank=rank)
            reference = mean[name]
        else:
            theta, reference = mean[name].detach().float(), None
        cast = theta.to(view.dtype)
        view.copy_(cast)
        parts.append(weight_checks.value_fingerprint([cast]))  # not the tensors: no second copy of θ̂ held
        if reference is not None and view.dtype != torch.float32:
            a, b = param_noise.served_noise_ratio(reference, theta, view.dtype)
            served, intended = served + a, intended + b
    ratio = (served / intended) ** 0.5 if intended else 1.0
    return ratio, weight_checks.combined_fingerprint(parts)


class Adapters:
    """A LoRA version as an engine holds it (services/model/lora.py publishes it): the base weights W0 as
    the engine loaded them, and the adapter posterior — m and σ of each `<layer>.lora_A.<x>.weight`
    [r, in] and `<layer>.lora_B.<x>.weight` [out, r] under the learner's names — scaled by s = α / r.
    The layer `<layer>.weight` is served as W0 + s · B̂ Â (`param_noise.lora_perturbed`)."""

    def __init__(self, base: Mapping[str, torch.Tensor], mean: Mapping[str, torch.Tensor],
                 sigma: Mapping[str, torch.Tensor] | None, scaling: float) -> None:
        self.base, self.mean, self.sigma, self.scaling = base, mean, sigma, scaling
        self.pairs: dict[str, tuple[str, str]] = {}  # layer weight -> (A name, B name)
        for a_name in mean:
            if ".lora_A." not in a_name:
                continue
            layer = a_name.split(".lora_A.")[0] + ".weight"
            b_name = a_name.replace(".lora_A.", ".lora_B.")
            if layer not in base or b_name not in mean:
                raise KeyError(f"adapter {a_name}: expected the layer {layer} in the model and {b_name} beside it")
            self.pairs[layer] = (a_name, b_name)
        unpaired = sorted(set(mean) - {n for pair in self.pairs.values() for n in pair})
        if unpaired or not self.pairs:
            raise KeyError(f"a LoRA version's tensors must be lora_A/lora_B pairs of the model's layers; "
                           f"got {unpaired[:3] or 'none'}")

    def slot_terms(self, keys: Sequence[Key], dtype: torch.dtype, rank: int = 0
                   ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[tuple[int, int]], list[float]]:
        """The adapter samples of slots `keys` ((seed, c) each; seed None: the means) stacked for a
        decoder over the shared base (lean_decoder.py): {layer: (Â [S, r, in], B̂ [S, out, r])} in
        `dtype`; each slot's fingerprint of the values written; each slot's served-noise ratio of its
        adapter factors in `dtype` (1 for the means)."""
        built: dict[str, list] = {}
        fed, ratios = [], []
        for seed, scale in keys:
            values = param_noise.perturbed_state(self.mean, self.sigma or {}, seed, scale, rank)
            cast = {n: v.to(dtype) for n, v in values.items()}
            for n, t in cast.items():
                built.setdefault(n, []).append(t)
            fed.append(weight_checks.value_fingerprint(cast.values()))
            ratios.append(param_noise.served_noise_ratio_of(self.mean, values, dtype))
        terms = {layer: (torch.stack(built[a]), torch.stack(built[b])) for layer, (a, b) in self.pairs.items()}
        return terms, fed, ratios

    def held(self, terms: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, int]]:
        """Each slot's fingerprint of the adapter values `terms` hold now (as `slot_terms` computed them)."""
        n_slots = next(iter(terms.values()))[0].shape[0]
        return [weight_checks.value_fingerprint(t[s] for pair in terms.values() for t in pair) for s in range(n_slots)]

    def weight(self, layer: str, seed: int | None, scale: float = 1.0, rank: int = 0) -> torch.Tensor:
        """W0 + s · B̂ Â of `layer` in fp32 (the adapter means for seed None)."""
        a, b = self.pairs[layer]
        sigma = self.sigma or {}
        return param_noise.lora_perturbed(self.base[layer], self.mean[a], sigma.get(a), self.mean[b], sigma.get(b),
                                          seed, a, b, self.scaling, scale, rank)
