"""What the learner's step runs around each forward and each optimizer step, chosen once
(`make_around`): nothing (`PlainStep`) or VP2O's hooks on a mixture-of-experts model (`VP2OStep`,
algorithms.md §3.8; services/learner/vp2o.py).

The interface: `whole_update` (the forward must see an update's rows together, in one plain
forward: VP2O's hooks count the tokens they route and its terms couple all of them), `capture(attn)`
around a forward, `extra_loss()` after it, `step()` in place of the optimizer's, `on_sync()` when a
version is published, `state()`/`load_state()` for checkpoints.
"""

from __future__ import annotations

import contextlib

import torch

from threepo.services.learner.config import VP2OConfig
from threepo.services.learner.vp2o import VP2OHooks


def make_around(model: torch.nn.Module, optimizer, vp2o: VP2OConfig | None):
    """VP2O's step around `optimizer` when `vp2o` is given, else the optimizer's step alone."""
    return VP2OStep(model, vp2o, optimizer) if vp2o is not None else PlainStep(optimizer)


class PlainStep:
    """The optimizer's step, nothing around it."""

    whole_update = False

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def capture(self, attn: torch.Tensor):
        return contextlib.nullcontext()

    def extra_loss(self) -> tuple[float, dict]:
        return 0.0, {}

    def step(self) -> dict[str, float]:
        self.optimizer.step()
        return {}

    def on_sync(self) -> None:
        pass

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


class VP2OStep:
    """VP2O around the optimizer step (algorithms.md §3.5, §3.7): routing captured by each forward,
    its spectral losses added, Stein transport of the expert gradients (IVON: on its K-sample mean
    gradient, `optimizer.expert_grads`), the step, then the anchor prototype budget; new anchors when
    a version is published."""

    whole_update = True

    def __init__(self, model: torch.nn.Module, config: VP2OConfig, optimizer) -> None:
        self.hooks, self.optimizer = VP2OHooks(model, config), optimizer

    def capture(self, attn: torch.Tensor):
        return self.hooks.capture(attn)

    def extra_loss(self) -> tuple[torch.Tensor, dict]:
        return self.hooks.extra_loss()

    def step(self) -> dict[str, float]:
        grads, write_back = self.optimizer.expert_grads()
        metrics = self.hooks.transform_grads(grads)
        prev = self.hooks.snapshot()
        self.optimizer.step()
        return {**metrics, **self.hooks.after_step(prev, write_back=write_back)}

    def on_sync(self) -> None:
        self.hooks.on_sync()  # the anchor of the prototype budget moves with the behaviour policy

    def state(self) -> dict[str, torch.Tensor]:
        return {f"vp2o/{k}": v for k, v in self.hooks.state().items()}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.hooks.load_state({k[5:]: v for k, v in tensors.items() if k.startswith("vp2o/")})
