"""Experiment trackers: every metrics.jsonl row also goes to TensorBoard and/or Weights & Biases
(`runtime.trackers`), owned by the driver's RunLog (deploy/outputs.py).

A row is a training step's (keyed by `step`) or a held-out evaluation's (`heldout_pass1` of the mean
published at `step`, which arrives while later steps are already logged). Only numbers are logged,
each under its metrics.jsonl name. TensorBoard takes any step order; W&B needs a monotone step of its
own, so the rows carry the learner step as the metric `learner_step`, which every other metric is
plotted against (`define_metric`), and W&B's own step simply counts the rows.

A resumed run (`threepo train --resume`) appends to the same TensorBoard directory and continues the
same W&B run (its id is derived from the run directory's name).
"""

from __future__ import annotations

import hashlib
import math
import os


def _numbers(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step"}


class TensorBoardTracker:
    """Scalars in TensorBoard event files under <run dir>/tensorboard."""

    def __init__(self, run_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))

    def log(self, row: dict) -> None:
        for key, value in _numbers(row).items():
            self.writer.add_scalar(key, value, global_step=int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run (offline by default) whose config is the run's resolved config."""

    def __init__(self, run_dir: str, project: str, mode: str, config: dict) -> None:
        import wandb

        name = os.path.basename(os.path.normpath(run_dir))
        run_id = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
        quiet = wandb.Settings(console="off", silent=True, disable_git=True, save_code=False)
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=run_dir, mode=mode,
                              config=config, settings=quiet)
        self.run.define_metric("learner_step")
        self.run.define_metric("*", step_metric="learner_step")

    def log(self, row: dict) -> None:
        self.run.log({**_numbers(row), "learner_step": int(row["step"])})

    def close(self) -> None:
        self.run.finish()


def make_trackers(names: tuple[str, ...], run_dir: str, *, project: str, mode: str, config: dict) -> list:
    """The trackers `runtime.trackers` names, in that order."""
    made = []
    for name in names:
        match name:
            case "tensorboard":
                made.append(TensorBoardTracker(run_dir))
            case "wandb":
                made.append(WandbTracker(run_dir, project, mode, config))
            case _:
                raise ValueError(f"runtime.trackers: expected tensorboard or wandb, got {name!r}")
    return made
