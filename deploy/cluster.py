"""The Ray cluster a run uses: `runtime.ray_address` joined, or a local one started sized to this
machine, with its metrics port on `runtime.metrics_host` (loopback by default)."""

from __future__ import annotations

import os

import ray

from threepo.deploy.actors import ACTOR_ENV
from threepo.deploy.config import RunConfig


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
    # address="local": a new cluster, never one another process on this machine started last; no
    # workers prestarted for the driver (Ray's default starts one per CPU, which no role uses: every
    # role is an actor with a worker of its own; on 2 cores they held 0.7 GiB, benchmarks/real_model.py)
    _start_local(num_cpus=max(os.cpu_count() or 2, _cpus_needed(cfg)), include_dashboard=False,
                 log_to_driver=False, runtime_env={"env_vars": ACTOR_ENV},
                 _system_config={"prestart_worker_first_driver": False}, **extra)
    port = ray.nodes()[0]["MetricsExportPort"]
    taken = f" (runtime.metrics_port={rt.metrics_port} was taken)" if rt.metrics_port not in (0, port) else ""
    print(f"threepo: Prometheus metrics at http://{rt.metrics_host}:{port}/metrics{taken}")


STARTUP_TRIES = 3


def _start_local(**init_kwargs) -> None:
    """`ray.init(address="local", ...)`, tried again when the node times out during startup: Ray
    gives its raylet a fixed 30 s to register with the GCS, which a loaded machine (a busy laptop,
    a 2-core CI runner) can miss. The half-started node's processes are stopped before the next try;
    the last try's error propagates."""
    import psutil

    for attempt in range(1, STARTUP_TRIES + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(address="local", **init_kwargs)
            return
        except Exception as error:
            if "timed out during startup" not in str(error) or attempt == STARTUP_TRIES:
                raise
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            for proc in started:
                proc.kill()
            psutil.wait_procs(started, timeout=30)
            print(f"threepo: the local Ray node did not register within Ray's 30 s (try {attempt} of "
                  f"{STARTUP_TRIES}, machine busy?); starting it again", flush=True)


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
    return int(rt.fixed_samplers * rt.sampler_cpus + rt.num_verifiers * rt.verifier_cpus + rt.eval_cpus
               + cfg.learner.ranks * rt.learner_cpus + 0.999)
