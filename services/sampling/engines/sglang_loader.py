"""Custom weight loaders SGLang runs inside every tensor-parallel worker (engines/sglang_engine.py).

SGLang 0.5.23 calls `loader(model, named_tensors)` for `Engine.update_weights_from_tensor(...,
load_format="threepo.services.sampling.engines.sglang_loader.<op>")` once the engine was started with those
names in `custom_weight_loader`; the tensors are already on the worker's device. State per served
model lives in `_STATE` (one SGLang worker process serves one model).

A loader never raises: in 0.5.23 an exception in a loader is an exception in the scheduler's event
loop, which ends the scheduler process and signals the engine's process to quit. Each call instead
writes its outcome, `{"call": n, "ok": ..., "message": ...}`, to `rank<r>.json` in the directory named
by the `THREEPO_SGLANG_STATUS` environment variable (the adapter sets it before SGLang spawns its
workers, which inherit it; r is the worker's torch.distributed rank), and the adapter reads every
rank's file after the call.

- `store`: `__threepo__/path` (the UTF-8 bytes of a staged (m, σ) file, engines/staging.py),
  `__threepo__/version`, `__threepo__/checksum`: map the file (host memory shared by the node's ranks;
  nothing of m or σ goes to the device), check the mean's exact checksum, serve the mean;
- `serve`: `__threepo__/seed` (empty: the mean) and `__threepo__/scale` (float64, the slot's σ
  multiplier c): build θ̂ = m + c · σ ⊙ z(seed, name) in fp32 on the model's device tensor by tensor,
  cast to the model's dtype and stream it into `model.load_weights`, then compare the
  layout-invariant fingerprint of the model's parameters with the fed tensors (single-rank only:
  tensor-parallel ranks hold shards);
- `hold`: take the fingerprint of the weights as loaded (a LoRA run serves the base it loaded);
- `verify`: the served weights are still those loaded.
Every call carries `__threepo__/call`, the number its outcome is written under.

Not runnable where SGLang does not install (the CPU machines this project is built on): the logic is
tested against a fake of the 0.5.23 engine and a plain torch module standing in for SGLang's model
(tests/engines/fake_sglang.py).
"""

from __future__ import annotations

import json
import os

import torch

from threepo.algorithms import param_noise, weight_checks
from threepo.services.sampling.engines.staging import mapped_safetensors

_STATE: dict[int, dict] = {}
_CONTROL = "__threepo__/"
STATUS_ENV = "THREEPO_SGLANG_STATUS"


def _reported(op):
    """`op` run so that its outcome is written to this rank's status file, never raised."""
    def loader(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        tensors = dict(named_tensors)
        call = int(tensors[_CONTROL + "call"][0]) if _CONTROL + "call" in tensors else -1
        try:
            op(model, tensors)
            ok, message = True, ""
        except Exception as err:  # noqa: BLE001 (an exception here would end SGLang's scheduler)
            ok, message = False, f"{type(err).__name__}: {err}"
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        directory = os.environ.get(STATUS_ENV)
        if directory:
            path = os.path.join(directory, f"rank{rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"call": call, "ok": ok, "message": message}, f)
            os.replace(path + ".tmp", path)
    loader.__name__ = loader.__qualname__ = op.__name__.lstrip("_")
    loader.__doc__ = op.__doc__
    return loader


def _store(model: torch.nn.Module, tensors: dict) -> None:
    staged = mapped_safetensors(bytes(tensors[_CONTROL + "path"].cpu().tolist()).decode())
    mean = {n[2:]: t for n, t in staged.items() if n.startswith("m/")}
    sigma = {n[2:]: t for n, t in staged.items() if n.startswith("s/")}
    words = tensors[_CONTROL + "checksum"].tolist()
    expected = "".join(f"{w:08x}" for w in words)
    received = weight_checks.weights_checksum(mean.items())
    if received != expected:
        raise RuntimeError(f"threepo: the received mean has checksum {received}, the learner published {expected}")
    _STATE[id(model)] = {"mean": mean, "sigma": sigma or None, "version": int(tensors[_CONTROL + "version"][0]),
                         "rank": int(tensors[_CONTROL + "rank"][0]) if _CONTROL + "rank" in tensors else 0}
    _serve(model, {_CONTROL + "seed": torch.zeros(0, dtype=torch.int64), _CONTROL + "scale": torch.ones(1, dtype=torch.float64)})


def _serve(model: torch.nn.Module, tensors: dict) -> None:
    state = _STATE[id(model)]
    seeds = tensors[_CONTROL + "seed"].tolist()
    seed = int(seeds[0]) if seeds else None
    scale = float(tensors[_CONTROL + "scale"][0])
    if seed is not None and state["sigma"] is None:
        raise RuntimeError(f"threepo: version {state['version']} has no σ, so seed {seed} cannot be served")
    first, fed = next(model.parameters()), []
    state["loaded"] = None  # until the load below has completed
    model.load_weights(param_noise.iter_served(state["mean"], state["sigma"] or {}, seed, scale, first.device,
                                               first.dtype, fed, rank=state["rank"]))
    state["loaded"] = _fingerprint(model)
    single_rank = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
    if single_rank and state["loaded"] != weight_checks.combined_fingerprint(fed):
        raise RuntimeError(f"threepo: after loading seed {seed} the model holds other values than were fed")


def _hold(model: torch.nn.Module, tensors: dict) -> None:
    """The weights as loaded are what is served (a LoRA run: the base, never reloaded; its adapters
    live in SGLang's LoRA memory pool, not in the model's parameters): `verify` compares with them."""
    _STATE[id(model)] = {"loaded": _fingerprint(model)}


def _verify(model: torch.nn.Module, tensors: dict) -> None:
    if _fingerprint(model) != _STATE[id(model)]["loaded"]:
        raise RuntimeError("threepo: the served weights changed since they were loaded")


store, serve, hold, verify = _reported(_store), _reported(_serve), _reported(_hold), _reported(_verify)


def _fingerprint(model: torch.nn.Module) -> tuple[int, int]:
    return weight_checks.value_fingerprint(p for _, p in model.named_parameters())
