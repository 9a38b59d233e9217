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

from threepo.services.checkpoint import save_tensors


def save_learner(learner, directory: str) -> None:
    """Write `learner`'s training state (services/learner/core.py `Learner.state`: model mean, IVON
    Hessian and momentum or AdamW state, VP2O's state) into a checkpoint directory:
    learner.safetensors, or rank r of R > 1 its own shard learner-rank<r>.safetensors (AdamW: rank 0
    alone), DeepSpeed its own files, and rank 0 learner.json (step counters, the optimizer's metadata)."""
    tensors, meta = learner.state()
    r = learner.ranks
    if r.world == 1 or tensors:
        save_tensors(os.path.join(directory, "learner.safetensors" if r.world == 1 else f"learner-rank{r.rank}.safetensors"),
                     tensors)
    learner.optimizer.save_files(directory)
    if r.first:
        with open(os.path.join(directory, "learner.json"), "w") as f:
            json.dump({**meta, "ranks": r.world}, f)


def load_learner(learner, directory: str) -> None:
    """Put `learner` back into the state `save_learner` wrote, whatever the number of ranks that
    wrote it and that read it: each reads its own tensors (`optimizer.wants`) from every shard."""
    from safetensors import safe_open

    with open(os.path.join(directory, "learner.json")) as f:
        meta = json.load(f)
    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "learner*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if learner.optimizer.wants(k)})
    learner.optimizer.load_files(directory)
    learner.load_state(tensors, meta)
