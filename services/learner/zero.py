"""AdamW through a DeepSpeed engine (ZeRO stage 0-3) for the learner's model: `learner.deepspeed_stage`.

The learner keeps its loss, its rows and its collectives for the loss denominators and start
log-probs (services/learner/ranks.py); DeepSpeed takes over what ZeRO shards: the gradient
reduction (ZeRO-2 reduce-scatters into each rank's partition), gradient clipping, the AdamW step
on the rank's partition of the fp32 master weights and moments (ZeRO-1/2), and at stage 3 the
parameters themselves, gathered around each forward by DeepSpeed's hooks on the model. DeepSpeed
averages gradients over the R ranks; the learner's partial losses (global denominators) sum to
the batch's loss, so `backward` scales them by R and the step is the one learner's.

On CPU DeepSpeed would JIT-compile its shared-memory all-reduce kernel (deepspeed_shm_comm, ~2.5
min of g++ on first use); it is marked unavailable so that gloo reduces instead — the same sum.
Checkpoints: DeepSpeed's own per-rank files (`deepspeed/` in the checkpoint directory), resumed
with the same number of ranks; rank 0 also writes the whole weights as `param/<name>` (what one
learner without DeepSpeed loads: the model, with fresh AdamW moments).

IVON never goes through here (services/learner/config.py `LearnerConfig.deepspeed_stage` says why);
services/learner/optimizers.py `ZeroAdamW` is the optimizer object the learner holds around it.
"""

from __future__ import annotations

import contextlib
import os

import torch

from threepo.services.learner.optim_config import OptimConfig

TAG = "deepspeed"


class DeepSpeedAdamW:
    """The model's DeepSpeed engine with AdamW at ZeRO `stage`, rank `rank` of the process group's `world`."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, stage: int, rank: int, world: int) -> None:
        import deepspeed
        import deepspeed.ops

        # the launcher's variables, for the process group the learner ranks already share: each rank
        # sees one device (Ray's GPU per actor, or the CPU), its local rank 0
        os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))
        if deepspeed.accelerator.get_accelerator().device_name() == "cpu":
            deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm": False}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": optim.lr, "betas": [optim.beta1, optim.beta2],
                                                            "weight_decay": optim.weight_decay, "torch_adam": True}},
                  "gradient_clipping": optim.grad_clip, "zero_optimization": {"stage": stage},
                  "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
        self.stage, self.world = stage, world
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.world)  # DeepSpeed averages over ranks: ×R gives the sum

    def step(self) -> None:
        self.engine.step()  # clip, AdamW on this rank's partition, zero the gradients

    def gathered(self, params: list):
        """A context in which ZeRO-3's partitioned parameters are whole (others: nothing to do)."""
        if self.stage < 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds: AdamW's moments and, at ZeRO ≥ 1, the fp32
        master partition it steps."""
        inner = self.optimizer.optimizer if self.stage else self.optimizer
        masters = ([] if not self.stage else self.optimizer.fp32_partitioned_groups_flat if self.stage == 3
                   else self.optimizer.single_partition_of_fp32_groups)
        tensors = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t)] + list(masters)
        return sum(t.numel() * t.element_size() for t in tensors)

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory, tag=TAG, save_latest=False)

    def load(self, directory: str) -> None:
        if not os.path.isdir(os.path.join(directory, TAG)):
            raise ValueError(f"{directory}: no {TAG}/ part; learner.deepspeed_stage resumes only a DeepSpeed "
                             "checkpoint of the same number of ranks")
        self.engine.load_checkpoint(directory, tag=TAG)
