"""The learner role as one Ray actor: `LearnerActor` wraps the learner service
(services/learner/core.py) and adds what needs Ray or the run directory: restoring from a
checkpoint, its metrics through Ray's agent, the rollout log of consumed groups, its own part of
checkpoints and the HF export of the mean. deploy/actors.py starts it alone; deploy/learner_group.py
holds one per rank.
"""

from __future__ import annotations

import os

import ray

from threepo.deploy.metrics import peak_rss, return_free_memory
from threepo.services.learner.core import Learner


class LearnerActor:
    """The learner service, restored from `checkpoint` when given, plus its metrics, the rollout log
    of consumed groups, its own part of checkpoints and the HF export of the mean."""

    def __init__(self, model_path: str, *args, checkpoint: str | None = None, rollout_log: str = "",
                 **kwargs) -> None:
        from threepo.deploy.metrics import RayMetrics
        from threepo.services.learner.checkpoint import load_learner
        from threepo.services.metrics import register_catalogue

        self.model_path = model_path
        self.learner = Learner(model_path, *args, **kwargs)
        self._metrics = register_catalogue(RayMetrics())
        self.log, log_bytes = None, 0
        if checkpoint:
            load_learner(self.learner, checkpoint)
            log_bytes = _read_json(os.path.join(checkpoint, "rollouts.json")).get("bytes", 0)
        if rollout_log:
            from threepo.services.wire.codec import LogWriter, RolloutLog

            if os.path.exists(rollout_log):  # a resumed run: drop what was logged after the checkpoint
                os.truncate(rollout_log, log_bytes)
            self.log = LogWriter(RolloutLog(rollout_log))

    def process_id(self) -> int:
        return os.getpid()

    def peak_memory(self) -> int:
        return peak_rss()

    @ray.method(num_returns=2)
    def step(self, groups: list, n_batches: int, *arrays):
        """One learner step; `arrays` are the step's CompletionBatches then their ScoreBatches,
        resolved by Ray from the samplers' and verifiers' objects. Returns the StepResult and, when
        the step publishes, the new version's PublishedVersion (else None): the driver passes that
        second reference on to the posterior server, so a publish is no call of its own on the
        learner and holds exactly the state after this step, whatever is queued behind it. The heap
        the step freed goes back to the OS before the next (`return_free_memory`), the published
        arrays' copies (serialized after this returns) at the next step's start."""
        return_free_memory()
        batches, scores = arrays[:n_batches], arrays[n_batches:]
        result = self.learner.step(groups, batches, scores)
        return_free_memory()
        result.metrics["learner_peak_mib"] = round(peak_rss() / 2**20, 1)
        if self.learner.ranks.first:  # one of R ranks: rank 0 speaks for the group
            record_learner_metrics(self._metrics, result, groups, self.learner.algo.exploration)
        if self.log:
            self.log.put(groups, batches, scores, result.step)
        version = self.learner.published(result.publish_reason) if result.publish else None
        result.metrics.update(self.learner.clock.take())  # the publish's phase, counted to this step
        return result, version

    def published(self, reason: str = ""):
        return self.learner.published(reason)

    def save_checkpoint(self, directory: str) -> str:
        import json

        from threepo.services.learner.checkpoint import save_learner

        save_learner(self.learner, directory)
        if self.learner.ranks.first:
            size = self.log.size() if self.log else 0
            with open(os.path.join(directory, "rollouts.json"), "w") as f:
                json.dump({"bytes": size}, f)
        return "learner"

    def save_hf(self, directory: str) -> str:
        """The current policy as an HF checkpoint with its tokenizer (`Learner.save_pretrained`; with
        LoRA also the PEFT adapter directory `directory`/adapter)."""
        from threepo.services.model.modeling import load_tokenizer

        self.learner.save_pretrained(directory)
        load_tokenizer(self.model_path).save_pretrained(directory)
        if self.log:
            self.log.close()
        return directory


def record_learner_metrics(handles: dict, result, groups: list, algorithm: str) -> None:
    """The learner's step metrics into the Prometheus catalogue (labels stay bounded: algorithm)."""
    m, label = result.metrics, {"algorithm": algorithm}
    handles["threepo_reward_mean"].set(m["reward_mean"], **label)
    handles["threepo_kl"].set(m["kl_k3"], **label)
    handles["threepo_ess_ratio"].set(m["ess_frac"], **label)
    handles["threepo_zero_advantage_groups_ratio"].set(m["zero_adv_frac"], **label)
    handles["threepo_malformed_rollouts_ratio"].set(m["malformed_rate"], **label)
    handles["threepo_rescued_groups_total"].inc(m["rescued_groups"], **label)
    if "noise_scale" in m:  # the noise control's latest version (services/learner/noise_control.py)
        handles["threepo_noise_scale"].set(m["noise_scale"], **label)
        handles["threepo_noise_kl"].set(m["noise_kl"], **label)
        if result.publish:
            handles["threepo_noise_redraws_total"].inc(m["noise_redraws"], **label)
    handles["threepo_learner_step_seconds"].observe(m["step_time_s"], **label)
    handles["threepo_learner_step"].set(result.step)
    for g in groups:
        handles["threepo_staleness_steps"].observe(result.step - 1 - g.published_step, **label)


def _read_json(path: str) -> dict:
    import json

    with open(path) as f:
        return json.load(f)
