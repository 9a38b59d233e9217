"""Custom weight loaders SGLang runs inside every tensor-parallel worker (engines/sglang_engine.py).

SGLang calls `loader(model, named_tensors)` for `Engine.update_weights_from_tensor(...,
load_format="threepo.services.engines.sglang_loader.<op>")` once the engine was started with those
names in `custom_weight_loader`; the tensors are already on the worker's device. State per served
model lives in `_STATE` (one SGLang worker process serves one model). A failed check raises, which
the adapter treats as a failed update.

- `store`: tensors `m/<name>`, `s/<name>`, `__threepo__/version`, `__threepo__/checksum`: check the
  mean's exact checksum, keep fp32 (m, σ) and serve the mean;
- `serve`: `__threepo__/seed` (empty: the mean) and `__threepo__/scale` (float64, the slot's σ
  multiplier c): build θ̂ = m + c · σ ⊙ z(seed, name) in fp32, cast to the model's dtype, `model.load_weights`, and compare the layout-invariant fingerprint of the model's
  parameters with the fed tensors (single-rank only: tensor-parallel ranks hold shards);
- `verify`: the served weights are still those loaded.

Not runnable where SGLang does not install (the CPU machines this project is built on): the logic is
tested against a plain torch module standing in for SGLang's model (tests/engines/test_sglang_adapter.py).
"""

from __future__ import annotations

import torch

from threepo.algorithms import param_noise

_STATE: dict[int, dict] = {}
_CONTROL = "__threepo__/"


def store(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    tensors = dict(named_tensors)
    mean = {n[2:]: t.float() for n, t in tensors.items() if n.startswith("m/")}
    sigma = {n[2:]: t.float() for n, t in tensors.items() if n.startswith("s/")}
    words = tensors[_CONTROL + "checksum"].tolist()
    expected = "".join(f"{w:08x}" for w in words)
    received = param_noise.weights_checksum(mean.items())
    if received != expected:
        raise RuntimeError(f"threepo: the received mean has checksum {received}, the learner published {expected}")
    _STATE[id(model)] = {"mean": mean, "sigma": sigma or None, "version": int(tensors[_CONTROL + "version"][0])}
    serve(model, [(_CONTROL + "seed", torch.zeros(0, dtype=torch.int64)),
                  (_CONTROL + "scale", torch.ones(1, dtype=torch.float64))])


def serve(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    state, tensors = _STATE[id(model)], dict(named_tensors)
    seeds = tensors[_CONTROL + "seed"].tolist()
    seed = int(seeds[0]) if seeds else None
    scale = float(tensors[_CONTROL + "scale"][0])
    if seed is not None and state["sigma"] is None:
        raise RuntimeError(f"threepo: version {state['version']} has no σ, so seed {seed} cannot be served")
    dtype = next(model.parameters()).dtype
    theta = param_noise.perturbed_state(state["mean"], state["sigma"] or {}, seed, scale)
    served = [(n, t.to(dtype)) for n, t in theta.items()]
    model.load_weights(served)
    state["loaded"] = _fingerprint(model)
    single_rank = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    if single_rank and state["loaded"] != param_noise.value_fingerprint(t for _, t in served):
        raise RuntimeError(f"threepo: after loading seed {seed} the model holds other values than were fed")


def verify(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    if _fingerprint(model) != _STATE[id(model)]["loaded"]:
        raise RuntimeError("threepo: the served weights changed since they were loaded")


def _fingerprint(model: torch.nn.Module) -> tuple[int, int]:
    return param_noise.value_fingerprint(p for _, p in model.named_parameters())
