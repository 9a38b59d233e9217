"""Parameter-space noise from a seed: the perturbed policy θ̂ = m + σ ⊙ z (algorithms.md §1.6).

Any consumer of a slot (a sampler engine, or the learner drawing θ̂′) regenerates z itself from
(seed, parameter name), so a version costs each engine one transfer of (m, σ) whatever the number
of slots. z is drawn per tensor on the device that holds the weights by a counter-based generator
(`counter_normal`: integer hashing and a table, the same bits on a CPU and a GPU), keyed by a stable
hash of the seed and the name (blake2b; never Python's per-process `hash`), which makes the draw
independent of parameter order, sharding, process and device. θ̂ is composed of single correctly
rounded fp32 operations in a fixed order, so it is bit-identical wherever it is built; the first
draw on each device is checked against `NOISE_SIGNATURE` and a device that differs is refused. The
clean mean is never recovered by subtracting noise (not bit-exact in fp32, §1.6):
callers keep m and rebuild θ̂ from it.

How much of θ̂ − m survives serving in a lower precision is here too (`served_noise_ratio`).

Not here: how σ is learned (algorithms/ivon.py), which seeds a version uses (exploration.py), or the
checks that an engine serves what was published (weight_checks.py).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping

import torch

from threepo.algorithms.counter_normal import levels, standard_normal, standard_normal_at
from threepo.algorithms.weight_checks import value_fingerprint, weights_checksum

# weights_checksum of the levels of z and of the first 2^17 elements of the draw for key 0x5EED:
# what every device must reproduce before it serves or learns from noise (`check_noise_device`)
NOISE_SIGNATURE = "4461a226ccafcd83"


def tensor_seed(seed: int, name: str) -> int:
    """Stable 63-bit seed for one tensor: blake2b(seed, name). Same in every process and machine."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def noise_signature(device: torch.device | str = "cpu") -> str:
    """`weights_checksum` of z's levels and of the first 2^17 draws for key 0x5EED, drawn on `device`."""
    device = torch.device(device)
    return weights_checksum([("levels", levels(device)), ("draw", standard_normal(0x5EED, 1 << 17, device=device))])


@functools.cache
def check_noise_device(device: torch.device) -> None:
    """Raise unless `device` draws z bit-identical to `NOISE_SIGNATURE` (once per device and process):
    a learner and an engine whose θ̂ of one seed could differ are refused rather than mismatched."""
    found = noise_signature(device)
    if found != NOISE_SIGNATURE:
        raise RuntimeError(f"threepo: parameter noise drawn on {device} has signature {found}, expected "
                           f"{NOISE_SIGNATURE}: this device (or torch build) would build different θ̂ "
                           "from the same seed than the other roles; it cannot serve or learn from noise")


def noise_like(seed: int, name: str, shape: Iterable[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """z ~ N(0, I) of `shape` (`counter_normal`'s quantized normal), fp32 on `device`, determined by
    (seed, name) only: the same bits on every device."""
    shape = tuple(shape)
    check_noise_device(torch.device(device))
    return standard_normal(tensor_seed(seed, name), math.prod(shape), device=device).view(shape)


def low_rank_noise(seed: int, name: str, shape: Iterable[int], rank: int, out: torch.Tensor) -> torch.Tensor:
    """Rank-r noise z = (Σ_k u_k v_kᵀ) · r^(-1/2) of `shape` written into `out` (contiguous fp32, on
    its device) and returned: u_k ~ N(0, I) over the first axis and v_k over the rest flattened, drawn
    from (seed, name + "/u") and (seed, name + "/v"), so each element has variance 1 like full noise
    with (rows + cols) · r draws instead of rows · cols (a 1-D tensor gets full noise). The sum is
    taken k by k, each product and addition one correctly rounded fp32 operation: the same bits on
    every device, as for full noise."""
    shape = tuple(shape)
    if len(shape) < 2:
        return standard_normal(tensor_seed(seed, name), out.numel(), out=out)
    rows, cols = shape[0], math.prod(shape[1:])
    u = standard_normal(tensor_seed(seed, name + "/u"), rank * rows, device=out.device).view(rank, rows, 1)
    v, flat = standard_normal(tensor_seed(seed, name + "/v"), rank * cols, device=out.device).view(rank, 1, cols), out.view(rows, cols)
    torch.mul(u[0], v[0], out=flat)
    for k in range(1, rank):
        flat.add_(u[k] * v[k])
    return out.mul_(torch.tensor(1.0 / math.sqrt(rank), dtype=torch.float32, device=out.device))


def noise_at(seed: int, name: str, index: torch.Tensor) -> torch.Tensor:
    """z of (seed, name) at the flat element indices `index`: `noise_like(...).flatten()[index]`
    without drawing the rest (a strided sample, a tensor-parallel shard)."""
    check_noise_device(index.device)
    return standard_normal_at(tensor_seed(seed, name), index)


def posterior_sigma(hess: torch.Tensor, ess: float, weight_decay: float) -> torch.Tensor:
    """σ = 1 / sqrt(λ (h + δ))   (algorithms.md §1.1). Shapes: hess [*] -> [*], fp32 (one new tensor)."""
    return (hess.float() + weight_decay).mul_(ess).rsqrt_()


class SigmaView(Mapping):
    """σ of each named tensor, computed from its h (`posterior_sigma`) when read, none kept: a
    posterior's σ without a second fp32 copy of the model (a fresh tensor per read)."""

    def __init__(self, hess: Mapping[str, torch.Tensor], ess: float, weight_decay: float) -> None:
        self.hess, self.ess, self.weight_decay = hess, ess, weight_decay

    def __getitem__(self, name: str) -> torch.Tensor:
        return posterior_sigma(self.hess[name], self.ess, self.weight_decay)

    def __contains__(self, name) -> bool:  # without computing σ (Mapping's default reads the item)
        return name in self.hess

    def __iter__(self) -> Iterator[str]:
        return iter(self.hess)

    def __len__(self) -> int:
        return len(self.hess)


def perturbed(mean: torch.Tensor, sigma: torch.Tensor, seed: int | None, name: str,
              scale: float = 1.0, out: torch.Tensor | None = None, rank: int = 0) -> torch.Tensor:
    """θ̂ = m + (σ ⊙ z(seed, name)) · c in fp32 on m's device, c = `scale` (a slot's σ multiplier;
    1 = the posterior sample itself), each of ⊙, · and + one correctly rounded fp32 operation in
    this order, so θ̂ is bit-identical on every device; `seed=None` returns a fp32 copy of m (the
    clean mean; `scale` must then be 1). `out`, when given, is a contiguous fp32 tensor of m's shape,
    not m itself, that receives θ̂ (and is returned); z is drawn into it, none held apart. `rank` > 0
    draws z of rank `rank` per matrix (`low_rank_noise`; a served slot's option, never IVON's
    training sample)."""
    assert mean.shape == sigma.shape, f"{name}: mean {tuple(mean.shape)} vs sigma {tuple(sigma.shape)}"
    assert scale > 0 and (seed is not None or scale == 1.0), f"{name}: scale {scale} with seed {seed}"
    mean = mean.detach()
    if seed is None:
        return mean.float().clone() if out is None else out.copy_(mean)
    if out is None:
        out = torch.empty(mean.shape, dtype=torch.float32, device=mean.device)
    assert out.dtype == torch.float32 and out.shape == mean.shape and out.data_ptr() != mean.data_ptr(), name
    check_noise_device(out.device)
    if rank:
        low_rank_noise(seed, name, mean.shape, rank, out)
    else:
        standard_normal(tensor_seed(seed, name), out.numel(), out=out)
    out.mul_(sigma.to(out.device, torch.float32))
    if scale != 1.0:
        out.mul_(scale)
    return out.add_(mean.to(out.device, torch.float32))


def lora_perturbed(base: torch.Tensor, a_mean: torch.Tensor, a_sigma: torch.Tensor | None, b_mean: torch.Tensor,
                   b_sigma: torch.Tensor | None, seed: int | None, a_name: str, b_name: str, scaling: float,
                   scale: float = 1.0, rank: int = 0) -> torch.Tensor:
    """W = W0 + s · B̂ Â in fp32 on W0's device: a layer's weight under a posterior sample of its LoRA
    adapter (Hu et al. 2021, "LoRA", eq. 3: W0 x + s · B A x, s = α / r), Â = m_A + c · σ_A ⊙ z(seed,
    `a_name`) and B̂ likewise (`perturbed`: the same Â, B̂ the learner's adapters hold at that seed;
    `seed=None` or σ None: the means). Shapes: W0 [out, in], A [r, in], B [out, r] -> [out, in].
    Unlike θ̂ itself the product B̂ Â is a matmul, rounded as the device's BLAS sums (not bit-identical
    across devices); the adapters it is built from are."""
    noisy = seed is not None
    a = perturbed(a_mean, a_sigma, seed, a_name, scale, rank=rank) if noisy and a_sigma is not None else a_mean.float()
    b = perturbed(b_mean, b_sigma, seed, b_name, scale, rank=rank) if noisy and b_sigma is not None else b_mean.float()
    device = base.device
    return torch.addmm(base.float(), b.to(device), a.to(device), alpha=scaling)


@torch.no_grad()
def load_perturbed(params: Iterable[tuple[str, torch.Tensor]], means: Mapping[str, torch.Tensor],
                   sigmas: Mapping[str, torch.Tensor], seed: int | None, scale: float = 1.0, rank: int = 0) -> None:
    """p ← θ̂ = m + c · σ ⊙ z(seed, name) for every (name, p) of `params`, in p's dtype (fp32
    parameters written in place, no copy; z drawn tensor by tensor, none held; of rank `rank` > 0 per
    matrix: `perturbed`); p ← m where `sigmas` lacks the name (no noise there, none drawn)."""
    for name, p in params:
        if name not in sigmas:
            p.copy_(means[name])
        elif p.dtype == torch.float32:
            perturbed(means[name], sigmas[name], seed, name, scale, out=p.data, rank=rank)
        else:
            p.copy_(perturbed(means[name], sigmas[name], seed, name, scale, rank=rank))


def iter_perturbed(means: Mapping[str, torch.Tensor], sigmas: Mapping[str, torch.Tensor], seed: int | None,
                   scale: float = 1.0, device: torch.device | str | None = None, rank: int = 0
                   ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, m, θ̂) for every named tensor, one at a time (none held between items), both on `device`
    (default: each m's own): θ̂ = m + (σ ⊙ z(seed, name)) · c, c = `scale` (z of rank `rank` > 0 per
    matrix: `perturbed`); a fp32 copy of m where `seed` is None or `sigmas` lacks the name (buffers,
    frozen parameters)."""
    for name, m in means.items():
        m = m.detach().to(m.device if device is None else device)
        if seed is not None and name in sigmas:
            yield name, m, perturbed(m, sigmas[name].to(m.device), seed, name, scale, rank=rank)
        else:
            yield name, m, m.float().clone()


def iter_served(means: Mapping[str, torch.Tensor], sigmas: Mapping[str, torch.Tensor], seed: int | None,
                scale: float, device: torch.device | str, dtype: torch.dtype, fed: list,
                energy: list | None = None, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, θ̂ cast to `dtype`) one tensor at a time on `device`, for a backend's own loader
    (`iter_perturbed`): appends each cast tensor's `value_fingerprint` to `fed` (their
    `combined_fingerprint` is what the backend must hold once loaded) and, given `energy` = [a, b],
    adds each tensor's `served_noise_ratio` to it; `rank` as for `perturbed`."""
    for name, m, theta in iter_perturbed(means, sigmas, seed, scale, device, rank):
        cast = theta.to(dtype)
        fed.append(value_fingerprint([cast]))
        if energy is not None:
            a, b = served_noise_ratio(m, theta, dtype)
            energy[0], energy[1] = energy[0] + a, energy[1] + b
        yield name, cast


def perturbed_state(
    means: Mapping[str, torch.Tensor], sigmas: Mapping[str, torch.Tensor], seed: int | None, scale: float = 1.0,
    rank: int = 0) -> dict[str, torch.Tensor]:
    """θ̂ for every named tensor: {name: m + c · σ ⊙ z(seed, name)} (`iter_perturbed`, held whole)."""
    return {name: theta for name, _, theta in iter_perturbed(means, sigmas, seed, scale, rank=rank)}


def served_noise_ratio(mean: torch.Tensor, theta: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """How much of the perturbation survives serving in `dtype`: (‖cast(θ̂) − cast(m)‖², ‖θ̂ − m‖²),
    both in fp32, so that summing over tensors and taking sqrt(a / b) gives the served-noise ratio
    ‖θ̂_served − m_served‖ / ‖σ ⊙ z‖ (1 in fp32; near 0 when σ is below the dtype's spacing)."""
    intended = float((theta.float() - mean.float()).square().sum())
    if dtype == torch.float32:  # fp32 serves θ̂ exactly
        return intended, intended
    served = theta.to(dtype).float() - mean.to(dtype).float()
    return float(served.square().sum()), intended


def served_noise_ratio_of(means: Mapping[str, torch.Tensor], thetas: Mapping[str, torch.Tensor],
                          dtype: torch.dtype) -> float:
    """The served-noise ratio sqrt(Σ a / Σ b) over the tensors of `thetas` (`served_noise_ratio`'s
    (a, b) per tensor; m from `means`): 1 in fp32 without a pass over the weights, since fp32
    serves θ̂ exactly; 1 when nothing is perturbed."""
    if dtype == torch.float32:
        return 1.0
    parts = [served_noise_ratio(means[n], theta, dtype) for n, theta in thetas.items()]
    intended = sum(b for _, b in parts)
    return (sum(a for a, _ in parts) / intended) ** 0.5 if intended else 1.0


def estimated_noise_ratio(means: Mapping, sigmas: Mapping, dtype: str, *, seed: int,
                          max_points: int = 1 << 16) -> float:
    """The served-noise ratio of `served_noise_ratio`, estimated from up to `max_points` strided
    elements per tensor with z drawn for those elements only (for engines whose workers hold m and
    σ out of reach). Inputs: fp32 arrays or tensors by name; `dtype` a torch dtype name."""
    points, thetas = {}, {}
    for name, sigma in sigmas.items():
        m = torch.as_tensor(means[name]).float().flatten()
        s = torch.as_tensor(sigma).float().flatten()
        stride = max(1, m.numel() // max_points)
        index = torch.arange(0, m.numel(), stride)
        points[name] = m[index]
        thetas[name] = points[name] + s[index] * noise_at(seed, name, index)
    return served_noise_ratio_of(points, thetas, getattr(torch, dtype))
