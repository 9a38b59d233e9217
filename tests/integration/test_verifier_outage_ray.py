"""VerifierOutage crosses the Ray boundary: a verifier actor whose every sandbox endpoint is down
past `sandbox.outage_s` makes `ray.get` raise it (for the driver to stop the run cleanly), and
the actor stays up to serve again once the service is back."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.ray


def test_ray_get_raises_verifier_outage_and_the_actor_lives_on(ray_session):
    from types import SimpleNamespace

    import numpy as np
    import ray

    from threepo.deploy.actors import VerifierActor
    from threepo.services.verifiers.base import VerifierOutage
    from threepo.services.verifiers.pool import VerifierConfig
    from threepo.services.verifiers.sandbox_config import RemoteSandboxConfig
    from threepo.services.wire.messages import STATUSES, TaskItem, VerifyStatus

    def batch(item, text):  # the part of a CompletionBatch the verifier actor reads
        return SimpleNamespace(requests=(SimpleNamespace(item=item),), row_request=np.array([0]), texts=(text,),
                               finish_stop=np.array([True]))

    with socket.socket() as s:  # a port nobody listens on: every request is refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = VerifierConfig(route=(("code_output", "remote_sandbox"),), cluster_concurrency="off")
    sandbox = RemoteSandboxConfig(endpoints=(dead,), outage_s=1.0, cooldown_s=0.2, backoff_base_s=0.05, backoff_max_s=0.2)
    actor = ray.remote(VerifierActor).options(num_cpus=0, max_restarts=-1, max_task_retries=-1,
                                              max_concurrency=1).remote(cfg, sandbox)
    code = batch(TaskItem(uid="c", prompt="", answer="84", verifier="code_output"), "\\boxed{print(12*7)}")
    with pytest.raises(VerifierOutage, match="no sandbox endpoint answered"):
        ray.get(actor.score.remote(code), timeout=120)
    math = batch(TaskItem(uid="m", prompt="", answer="2"), "\\boxed{2}")
    scores = ray.get(actor.score.remote(math), timeout=120)  # same actor, not restarted
    assert [STATUSES[int(c)] for c in scores.statuses] == [VerifyStatus.OK]
    ray.kill(actor)
