"""Ray actor wiring: each role's service class becomes a long-lived actor, with resources and
restart policies from config (never from decorators).

Restart policy per role (operations.md §4.1):
- samplers and verifiers are cattle: `max_restarts=-1`; a restarted sampler holds no version until
  the driver pushes one, and the driver re-issues whatever a dead one had in flight;
- the learner and the posterior server hold state: they are restored from the run's latest
  checkpoint by the driver (`threepo train --resume`), not restarted silently mid-run.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from threepo.deploy.config import RunConfig
from threepo.services.engines.base import SamplerConfig
from threepo.services.learner import Learner
from threepo.services.posterior import PosteriorConfig, PosteriorServer
from threepo.services.verifier_pool import VerifierConfig, VerifierPool, auth_token

ACTOR_ENV = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class SamplerActor:
    """One engine behind the Sampler service; `incarnation` changes when Ray restarts the actor."""

    def __init__(self, model_path: str, cfg: SamplerConfig, engine_id: int, dtype: str) -> None:
        from threepo.deploy.metrics import RayMetrics
        from threepo.services.sampler import Sampler

        self.incarnation = uuid.uuid4().hex[:8]
        self.sampler = Sampler(make_engine(model_path, cfg, engine_id, dtype), engine_id, cfg,
                               metrics=RayMetrics())

    def update(self, version: int, weights: tuple[dict, dict | None, str]) -> int:
        mean, sigma, mean_checksum = weights
        self.sampler.update(version, mean, sigma, mean_checksum)
        return version

    def generate(self, requests: list) -> tuple[str, list]:
        return self.incarnation, self.sampler.generate(requests)

    def stats(self) -> dict:
        return {**self.sampler.stats(), "incarnation": self.incarnation, "pid": os.getpid()}


def make_engine(model_path: str, cfg: SamplerConfig, engine_id: int, dtype: str):
    """The engine of `sampler.backend`; vLLM and SGLang are imported only here, inside the actor."""
    match cfg.backend:
        case "hf":
            from threepo.services.engines.hf import HFEngine

            return HFEngine(model_path, cfg, engine_id=engine_id, dtype=dtype)
        case "vllm":
            from threepo.services.engines.vllm_engine import VLLMEngine

            return VLLMEngine(model_path, cfg, engine_id=engine_id, dtype=dtype)
        case "sglang":
            from threepo.services.engines.sglang_engine import SGLangEngine

            return SGLangEngine(model_path, cfg, engine_id=engine_id, dtype=dtype)
    raise ValueError(f"sampler.backend: expected hf, vllm or sglang, got {cfg.backend!r}")


class PosteriorActor(PosteriorServer):
    """The posterior server plus its Prometheus metrics: current version and publishes by reason."""

    def publish(self, pv):
        from threepo.deploy.metrics import RayMetrics
        from threepo.services.metrics import register_catalogue

        plan = super().publish(pv)
        if "_metrics" not in self.__dict__:
            self._metrics = register_catalogue(RayMetrics())
        self._metrics["threepo_policy_version"].set(pv.version)
        self._metrics["threepo_sync_events_total"].inc(1, reason=pv.reason or "start")
        return plan


class VerifierActor:
    """The verifier pool behind synchronous methods only: Ray turns an actor with any `async def`
    method into an async actor, whose methods leave the main thread (math-verify's SIGALRM needs it).
    `remote_sandbox` is built from `[verifier]` with the `token` the driver read from
    `verifier.auth_env`, and holds a permit of the cluster-wide limiter for each request.
    `verify_batch` raises `VerifierOutage` (services/verifiers/base.py) when every sandbox endpoint
    is down past `verifier.outage_s`."""

    def __init__(self, cfg: VerifierConfig, token: str = "") -> None:
        from threepo.deploy.metrics import RayMetrics

        def remote_sandbox(config, **options):
            from threepo.deploy.limiter import ClusterLimiter
            from threepo.services.verifiers.remote import RemoteSandboxVerifier

            limiter = (ClusterLimiter(cfg.limiter_name, cfg.cluster_concurrency)
                       if cfg.cluster_concurrency else None)
            return RemoteSandboxVerifier(config, limiter, **options)

        self.pool = VerifierPool(cfg.pool_config(token), factories={"remote_sandbox": remote_sandbox},
                                 metrics=RayMetrics())

    def verify_batch(self, requests: list) -> list:
        return self.pool.verify_batch(requests)

    def stats(self) -> dict:
        return self.pool.stats()


class LearnerActor(Learner):
    """The learner service plus its Prometheus metrics and two driver conveniences that need its
    model: held-out evaluation and writing the current mean as an HF checkpoint."""

    def step(self, groups: list):
        from threepo.deploy.metrics import RayMetrics
        from threepo.services.metrics import register_catalogue

        result = super().step(groups)
        if "_metrics" not in self.__dict__:
            self._metrics = register_catalogue(RayMetrics())
        record_learner_metrics(self._metrics, result, groups, self.algo.exploration)
        return result

    def evaluate_heldout(self, items: list, max_new_tokens: int) -> float:
        from threepo.services.evaluation import model_pass_at_1
        from threepo.services.modeling import load_tokenizer

        return model_pass_at_1(self.model, load_tokenizer(self.model_path), items,
                               temperature=self.temperature, max_new_tokens=max_new_tokens)

    def save_hf(self, directory: str) -> str:
        """The current mean (IVON keeps p.data at m outside sampled_params) as an HF checkpoint."""
        from threepo.services.modeling import load_tokenizer

        self.model.save_pretrained(directory)
        load_tokenizer(self.model_path).save_pretrained(directory)
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
    handles["threepo_learner_step_seconds"].observe(m["step_time_s"], **label)
    handles["threepo_learner_step"].set(result.step)
    for g in groups:
        handles["threepo_staleness_steps"].observe(result.step - 1 - g.published_step, **label)


@dataclass
class Roles:
    posterior: Any
    samplers: list
    verifiers: list
    learner: Any


def start_roles(cfg: RunConfig, policy_path: str, run_id: str, posterior_state: dict | None = None) -> Roles:
    """Create every role as an actor named `<run_id>-<role>[-i]`; resources and restart policies come
    from `cfg.runtime`. `posterior_state` restores the posterior server from a checkpoint."""
    rt = cfg.runtime
    env = {"env_vars": ACTOR_ENV}
    posterior = ray.remote(PosteriorActor).options(num_cpus=0, runtime_env=env, name=f"{run_id}-posterior").remote(
        posterior_config(cfg), state=posterior_state)
    sampler_cfg = cfg.sampler
    samplers = [
        ray.remote(SamplerActor).options(num_cpus=rt.sampler_cpus, max_restarts=-1, max_task_retries=0,
                                         runtime_env=env, name=f"{run_id}-sampler-{i}")
        .remote(policy_path, sampler_cfg, i, cfg.model.dtype)
        for i in range(rt.num_samplers)
    ]
    # synchronous actors (max_concurrency=1) run on their main thread: math-verify's SIGALRM works
    verifiers = [
        ray.remote(VerifierActor).options(num_cpus=rt.verifier_cpus, max_restarts=-1, max_task_retries=-1,
                                         max_concurrency=1, runtime_env=env, name=f"{run_id}-verifier-{i}")
        .remote(cfg.verifier, auth_token(cfg.verifier.auth_env))
        for i in range(rt.num_verifiers)
    ]
    learner = ray.remote(LearnerActor).options(num_cpus=rt.learner_cpus, runtime_env=env,
                                               name=f"{run_id}-learner").remote(
        policy_path, cfg.algo, cfg.optim, cfg.sync, temperature=cfg.sampler.temperature,
        max_new_tokens=cfg.sampler.max_new_tokens, threads=max(1, int(rt.learner_cpus)), vp2o=cfg.vp2o)
    return Roles(posterior, samplers, verifiers, learner)


def stop_roles(roles: Roles) -> None:
    for actor in [roles.posterior, roles.learner, *roles.samplers, *roles.verifiers]:
        ray.kill(actor, no_restart=True)


def posterior_config(cfg: RunConfig) -> PosteriorConfig:
    """The posterior server plans versions with the algorithm's own settings (one source of truth)."""
    return PosteriorConfig(kind=cfg.algo.exploration, group_size=cfg.algo.group_size, n_slots=cfg.algo.n_slots,
                           equal_compute=cfg.algo.equal_compute, base_seed=cfg.seed)


def init_ray(cfg: RunConfig) -> None:
    """Join `runtime.ray_address` or start a local cluster sized to this machine, its metrics port
    (`runtime.metrics_port`, a free one if that is taken) on `runtime.metrics_host`."""
    if ray.is_initialized():
        return
    for key, value in ACTOR_ENV.items():
        os.environ.setdefault(key, value)
    if cfg.runtime.ray_address:
        ray.init(address=cfg.runtime.ray_address, runtime_env={"env_vars": ACTOR_ENV})
        return
    rt, extra = cfg.runtime, {}
    if rt.metrics_port and _port_free(rt.metrics_host, rt.metrics_port):
        extra["_metrics_export_port"] = rt.metrics_port
    if rt.metrics_host == "127.0.0.1":
        _local_node_on_loopback()
    ray.init(num_cpus=max(os.cpu_count() or 2, _cpus_needed(cfg)), include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": ACTOR_ENV}, **extra)
    port = ray.nodes()[0]["MetricsExportPort"]
    taken = f" (runtime.metrics_port={rt.metrics_port} was taken)" if rt.metrics_port not in (0, port) else ""
    print(f"threepo: Prometheus metrics at http://{rt.metrics_host}:{port}/metrics{taken}")


def _local_node_on_loopback() -> None:
    """Make the local node's address 127.0.0.1, so Ray's metrics agent (and the rest of the node)
    listens on loopback only. Ray turns `_node_ip_address="127.0.0.1"` into the outward address;
    its one switch for a loopback node is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is
    imported: set for the node's processes, and on the already imported constant for this one."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _cpus_needed(cfg: RunConfig) -> int:
    rt = cfg.runtime
    return int(rt.num_samplers * rt.sampler_cpus + rt.num_verifiers * rt.verifier_cpus + rt.learner_cpus + 0.999)
