"""Learners over LoRA adapters that the LoRA tests of several directories share (tests/ is on the
test path): a C3PO learner with an IVON posterior over the adapters, and adapters moved off B = 0."""

from __future__ import annotations

import torch


def nudge_adapters(model, seed: int = 0) -> None:
    """B is zero at the start (the adapted model is the base): give every adapter a non-zero term."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def ivon_lora_learner(path: str, lora, nudge_seed: int | None = None):
    """A C3PO learner (2 slots, no noise control) with IVON over `lora`'s adapters; with `nudge_seed`
    its adapters and IVON's means are moved off B = 0 (`nudge_adapters`), so slots differ in both factors."""
    from threepo.algorithms.noise_mask import NoiseConfig
    from threepo.services.learner.config import AlgoConfig
    from threepo.services.learner.optim_config import OptimConfig, SyncConfig
    from threepo.services.learner.core import Learner

    learner = Learner(path, AlgoConfig(exploration="c3po", n_slots=2, group_size=8),
                      OptimConfig(name="ivon", lr=1.0, ess=1e4, hess_init=0.1), SyncConfig(max_staleness=1),
                      temperature=1.0, max_new_tokens=10, lora=lora, noise=NoiseConfig(target_kl="off"))
    if nudge_seed is not None:
        nudge_adapters(learner.model, nudge_seed)
        with torch.no_grad():
            for n, p in learner.named:
                learner.optimizer.ivon.state[n]["mean"].copy_(p)
    return learner
