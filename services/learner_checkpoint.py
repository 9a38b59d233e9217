"""Learner checkpoints: what `Learner.state` holds, written into (and read from) the checkpoint
directory each role writes its part of (deploy/checkpoints.py).

One learner writes learner.safetensors; rank r of R > 1 writes its own shard,
learner-rank<r>.safetensors (IVON: m, h and g_m of the tensors it owns; AdamW, whose state every
rank holds whole: rank 0 alone). Rank 0 writes learner.json (step counters, the optimizer's
metadata with the whole model's parameter order, and how many ranks wrote). Any number of ranks,
one included, reads it back: each takes the tensors it owns from whichever shard holds them.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from threepo.services.learner import Learner


def save_learner(learner: Learner, directory: str) -> None:
    """Write the learner's training state into a checkpoint directory (learner.safetensors: model
    mean, IVON Hessian and momentum or AdamW state; learner.json: step counters). Rank r of R > 1
    writes its own shard, learner-rank<r>.safetensors (AdamW: rank 0 alone), rank 0 the json."""
    from threepo.services.checkpoint import save_tensors

    tensors, meta = learner.state()
    r = learner.ranks
    if r.world == 1 or tensors:
        save_tensors(os.path.join(directory, "learner.safetensors" if r.world == 1 else f"learner-rank{r.rank}.safetensors"),
                     tensors)
    if learner.engine:
        learner.engine.save(directory)  # DeepSpeed's own per-rank files (a collective)
    if r.first:
        with open(os.path.join(directory, "learner.json"), "w") as f:
            json.dump({**meta, "ranks": r.world}, f)


def load_learner(learner: Learner, directory: str) -> None:
    """Put `learner` back into the state `save_learner` wrote, whatever the number of ranks that
    wrote it and that read it: each reads its own tensors (`Learner.wants`) from every shard."""
    from safetensors import safe_open

    with open(os.path.join(directory, "learner.json")) as f:
        meta = json.load(f)
    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "learner*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if learner.wants(k)})
    if learner.engine:
        learner.engine.load(directory)
    learner.load_state(tensors, meta)


def learner_state(learner: Learner) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and metadata of everything needed to continue exactly: step counters, IVON's state of
    this rank's tensors (with the whole model's parameter order) or the parameters and AdamW moments."""
    meta = {"step": learner.step_count, "steps_since_sync": learner.steps_since_sync, "optim": learner.optim_cfg.name}
    vp2o = {f"vp2o/{k}": v for k, v in learner.vp2o.state().items()} if learner.vp2o else {}
    if learner.optim_cfg.name == "ivon":  # this rank's tensors; the metadata names the whole model's
        tensors, ivon_meta = learner.opt.export_state()
        ivon_meta.update(param_order=[n for n, _ in learner.named], shapes={n: list(p.shape) for n, p in learner.named})
        return {**tensors, **vp2o}, {**meta, "ivon": ivon_meta}
    with learner.whole_parameters():
        tensors = {f"param/{n}": p.detach().cpu().clone() for n, p in learner.named} if learner.ranks.first else {}
    tensors |= vp2o
    if learner.engine or not learner.ranks.first:  # DeepSpeed writes its own part; else rank 0 writes the whole
        return tensors, {**meta, "deepspeed": bool(learner.engine)}
    opt_state = learner.opt.state_dict()
    for i, st in opt_state["state"].items():
        for k, v in st.items():
            tensors[f"adamw/{i}/{k}"] = v.cpu().clone() if torch.is_tensor(v) else torch.tensor(v)
    return tensors, meta


def load_learner_state(learner: Learner, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Put `learner` back into the state `learner_state` described."""
    learner.step_count, learner.steps_since_sync = meta["step"], meta["steps_since_sync"]
    if learner.vp2o:
        learner.vp2o.load_state({k[5:]: v for k, v in tensors.items() if k.startswith("vp2o/")})
    tensors = {k: v for k, v in tensors.items() if not k.startswith("vp2o/")}
    if learner.engine:
        return  # the engine loaded its own part (learner_checkpoint.load_learner)
    if learner.optim_cfg.name == "ivon":  # this rank's tensors (unknown names stay, for IVON's check)
        known = {n for n, _ in learner.named}
        order = [n for n in meta["ivon"]["param_order"] if n in learner.opt.state or n not in known]
        learner.opt.load_exported_state(tensors, {**meta["ivon"], "param_order": order})
        learner.ranks.broadcast_from_owners(learner.named)
        return
    with torch.no_grad():
        for n, p in learner.named:
            p.copy_(tensors[f"param/{n}"])
    state = {"state": {}, "param_groups": learner.opt.state_dict()["param_groups"]}
    for key, v in tensors.items():
        if key.startswith("adamw/"):
            _, i, k = key.split("/")
            state["state"].setdefault(int(i), {})[k] = v
    learner.opt.load_state_dict(state)
