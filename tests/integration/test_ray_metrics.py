"""RayMetrics inside a tiny Ray actor: the whole catalogue is made lazily and records without error,
and the facade's rules hold there too."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_ray_metrics_in_an_actor(ray_session):
    from threepo.deploy.metrics import RayMetrics

    # Defined here so cloudpickle ships it by value: this test module is not importable on workers.
    class Recorder:
        def __init__(self, metrics) -> None:
            self.metrics = metrics

        def record(self) -> list[str]:
            from threepo.services.metrics import register_catalogue

            handles = register_catalogue(self.metrics)
            handles["threepo_tokens_generated_total"].inc(17, engine_id=1)
            handles["threepo_tokens_generated_total"].inc(0, engine_id=1)  # Ray refuses 0; the facade skips it
            handles["threepo_sync_events_total"].inc(reason="budget")
            handles["threepo_queue_depth"].set(3, role="sampler")
            handles["threepo_staleness_steps"].observe(1, algorithm="c3po")
            assert self.metrics.counter("threepo_completions_total", "Completions streamed by a sampler engine.",
                                        ["engine_id"]) is handles["threepo_completions_total"]
            errors = []
            for bad in (lambda: handles["threepo_queue_depth"].set(1, rollout_id="r1"),
                        lambda: self.metrics.gauge("threepo_reward_mean_total", "x")):
                with pytest.raises(ValueError) as info:
                    bad()
                errors.append(str(info.value))
            return errors

    metrics = RayMetrics()  # made on the driver, pickled into the actor: no Ray metric exists yet
    actor = ray_session.remote(num_cpus=0)(Recorder).remote(metrics)
    errors = ray_session.get(actor.record.remote(), timeout=60)
    assert "expected label values for ['role'], got ['rollout_id']" in errors[0]
    assert "counters and only counters end in '_total'" in errors[1]
    ray_session.kill(actor)
