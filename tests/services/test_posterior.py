"""PosteriorServer: plans per kind, strictly increasing versions, refcounted lifetime, the mean checksum
every engine checks, checkpoint round trip, per-engine transfer size independent of the number of slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threepo.algorithms.weight_checks import weights_checksum
from threepo.services.posterior import PosteriorConfig, PosteriorServer
from threepo.services.sampling.engines.base import SamplerConfig, WeightsMismatch
from threepo.services.sampling.engines.hf import HFEngine
from threepo.services.wire.messages import NoiseSpec, PublishedVersion


def _pv(version, scale=0.01, sigma=True, shapes=None):
    """The learner's publication of its `version`-th version (seeded by it; learner step 10·version)."""
    shapes = shapes or {"w": (3, 4), "b": (4,)}
    rng = np.random.default_rng(version)
    mean = {n: rng.standard_normal(s) for n, s in shapes.items()}  # fp64 on purpose: stored as fp32
    sig = {n: np.full(s, scale) for n, s in shapes.items()} if sigma else None
    checksum = weights_checksum((n, torch.from_numpy(a.astype(np.float32))) for n, a in mean.items())
    return PublishedVersion(learner_step=10 * version, reason="test", mean=mean, sigma=sig, mean_checksum=checksum)


def _plan(kind, n_slots, group_size=8, equal_compute=True, base_seed=0):
    return PosteriorConfig(kind=kind, group_size=group_size, n_slots=n_slots, equal_compute=equal_compute,
                           base_seed=base_seed)


def _server(cfg, upto, **pv):
    """A server that has published versions 0..upto."""
    server = PosteriorServer(cfg)
    for v in range(upto + 1):
        server.publish(_pv(v, **pv))
    return server


@pytest.mark.parametrize("kind,n_slots,expect_slots,expect_groups", [
    ("none", 1, 1, 1), ("b3po", 1, 1, 1), ("m3po", 2, 2, 2), ("c3po", 4, 4, 1)])
def test_publish_makes_the_plan_of_each_kind(kind, n_slots, expect_slots, expect_groups):
    server = _server(_plan(kind, n_slots, group_size=8, base_seed=5), upto=0)
    published = server.publish(_pv(1))
    plan = published.plan
    assert published.version == 1 and published.learner_step == 10 and published.reason == "test"
    assert published.mean_checksum == _pv(1).mean_checksum and server.version_plan(1) == published
    assert server.current_version() == 1 and server.version_plan(1).plan == plan
    assert plan.kind == kind and plan.version == 1
    assert len(plan.slots) == expect_slots and plan.groups_per_prompt == expect_groups
    seeds = [s.seed for s in plan.slots]
    assert (seeds == [None]) if kind == "none" else (len(set(seeds)) == n_slots and None not in seeds)
    # a new version draws new seeds; the same config in a fresh server draws the same ones
    other = _server(_plan(kind, n_slots, group_size=8, base_seed=5), upto=0)
    assert other.publish(_pv(1)).plan == plan
    if kind != "none":
        assert server.publish(_pv(2)).plan.slots[0].seed != plan.slots[0].seed


def test_weights_are_read_only_fp32_copies_and_the_server_numbers_versions():
    server = _server(_plan("b3po", 1), upto=2)
    pv = _pv(3)
    assert server.publish(pv).version == 3
    mean, sigma, checksum = server.weights(3)
    assert checksum == pv.mean_checksum == server.version_plan(3).mean_checksum
    assert mean["w"].dtype == np.float32 and sigma["b"].dtype == np.float32
    np.testing.assert_array_equal(mean["w"], pv.mean["w"].astype(np.float32))
    pv.mean["w"][0, 0] = 123.0  # the publisher's buffer changes later: the version must not
    assert mean["w"][0, 0] != 123.0
    with pytest.raises(ValueError):
        mean["w"][0, 0] = 1.0
    assert server.version_plan(3).learner_step == 30 and server.publish(_pv(9)).version == 4


def test_bad_publications_are_rejected_with_the_field():
    server = PosteriorServer(_plan("c3po", 2, group_size=4))
    with pytest.raises(ValueError, match="sigma is None"):
        server.publish(_pv(1, sigma=False))
    bad = _pv(1)
    bad.sigma["w"] = np.ones((4, 3))
    with pytest.raises(ValueError, match=r"sigma\['w'\]"):
        server.publish(bad)
    with pytest.raises(LookupError, match="no posterior version"):
        server.current_version()
    with pytest.raises(ValueError, match="kind must be one of"):
        PosteriorServer(_plan("ppo", 1)).publish(_pv(0))


def test_a_held_version_outlives_newer_publishes_until_its_holder_lets_go():
    # the driver publishes with a hold and releases the previous version only once it has adopted the
    # new one: admissions it sends in between still name the previous version and must find it
    server = PosteriorServer(_plan("b3po", 1))
    server.publish(_pv(0), hold=True)
    server.publish(_pv(1), hold=True)
    server.publish(_pv(2), hold=True)  # published before the driver took in version 1
    server.acquire(0, n=2)  # admissions at the version the driver still admits at
    assert sorted(_refcounts(server)) == [0, 1, 2] and _refcounts(server)[1] == 1
    server.release(0)  # the driver adopts 1, letting go of 0
    server.release(0, n=2)
    server.release(1)  # ... then 2
    assert sorted(_refcounts(server)) == [2] and _refcounts(server)[2] == 1


def test_a_referenced_old_version_stays_until_released():
    server = _server(_plan("b3po", 1), upto=1)
    server.acquire(1, n=3)
    server.publish(_pv(2))
    server.publish(_pv(3))
    assert sorted(_refcounts(server)) == [1, 3]  # 2 was never referenced and is not the current one
    with pytest.raises(KeyError, match="version 2"):
        server.weights(2)
    server.release(1, n=2)
    assert server.version_plan(1).plan.version == 1 and _refcounts(server)[1] == 1
    server.release(1)
    assert sorted(_refcounts(server)) == [3]
    with pytest.raises(KeyError, match="version 1"):
        server.version_plan(1).plan
    # the current version survives without references; over-release is an error
    with pytest.raises(ValueError, match="release n"):
        server.release(3)
    server.acquire(3)
    server.release(3)
    assert sorted(_refcounts(server)) == [3]


def test_an_engine_takes_the_published_mean_and_refuses_another(tiny_dense_path):
    engine = HFEngine(tiny_dense_path, SamplerConfig(seed=1))
    shapes = {n: tuple(p.shape) for n, p in engine._params.items()}
    server = _server(_plan("c3po", 2, group_size=4, base_seed=9), upto=4, scale=0.02,
                     shapes=shapes)
    plan = server.version_plan(4).plan
    engine.load_version(4, *server.weights(4))
    assert engine.serve(NoiseSpec(4, plan.slots[0].seed)).mean_checksum == server.version_plan(4).mean_checksum
    mean, sigma, checksum = server.weights(4)
    tampered = dict(mean, **{"model.norm.weight": mean["model.norm.weight"] + 1e-3})
    with pytest.raises(WeightsMismatch, match="checksum"):
        engine.load_version(5, tampered, sigma, checksum)
    assert engine.version == 4  # the refused version left the engine as it was


def test_state_round_trip_restores_versions_plans_and_refcounts():
    cfg = _plan("c3po", 4, group_size=8, base_seed=3)
    server = _server(cfg, upto=1)
    server.acquire(1, n=2)
    server.publish(_pv(2))
    state = server.state()
    assert _plain(state), "state must hold numpy arrays and plain values only"
    restored = PosteriorServer.from_state(state)
    assert sorted(_refcounts(restored)) == [1, 2] and restored.current_version() == 2
    assert restored.version_plan(1).plan == server.version_plan(1).plan and restored.version_plan(2).plan == server.version_plan(2).plan
    assert _refcounts(restored)[1] == 2 and _refcounts(restored)[2] == 0
    for v in (1, 2):
        for a, b in zip(server.weights(v)[:2], restored.weights(v)[:2]):
            assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    assert restored.version_plan(1).mean_checksum == server.version_plan(1).mean_checksum
    # a restored plan stays as saved even if the config for future versions changes
    moved = PosteriorServer.from_state(state, _plan("c3po", 2, group_size=8, base_seed=4))
    assert moved.version_plan(1).plan == server.version_plan(1).plan and len(moved.publish(_pv(3)).plan.slots) == 2
    restored.release(1, n=2)
    assert sorted(_refcounts(restored)) == [2] and restored.publish(_pv(3)).version == 3


def test_a_version_serves_the_slots_the_learner_chose_and_keeps_them_through_a_checkpoint(tmp_path):
    import dataclasses

    from threepo.services.posterior import load_posterior, save_posterior

    server = PosteriorServer(_plan("c3po", 4, group_size=8, base_seed=3))
    assert {s.scale for s in server.publish(_pv(0)).plan.slots} == {1.0}  # the server's own seeds
    chosen = ((11, 0.5), (12, 0.5), (13, 0.5), (14, 0.5))
    plan = server.publish(dataclasses.replace(_pv(1), slots=chosen)).plan
    assert [(s.seed, s.scale) for s in plan.slots] == list(chosen) and plan.group_size == 8
    save_posterior(server, str(tmp_path))
    assert load_posterior(str(tmp_path)).version_plan(1).plan == plan
    with pytest.raises(ValueError, match="2 .seed, scale. pairs for a plan of 4 slots"):
        server.publish(dataclasses.replace(_pv(2), slots=chosen[:2]))


def test_a_version_is_read_back_as_the_learner_published_it_through_a_checkpoint(tmp_path):
    import dataclasses

    from threepo.services.posterior import load_posterior, save_posterior

    server = PosteriorServer(_plan("c3po", 4, group_size=8, base_seed=3))
    sent = dataclasses.replace(_pv(7), reason="kl", noise_rank=2, lora=(8, 16.0))  # (r, α) of an adapter posterior
    server.publish(sent)
    save_posterior(server, str(tmp_path))
    for got in (server.published(0), load_posterior(str(tmp_path)).published(0)):
        assert (got.learner_step, got.reason, got.mean_checksum, got.noise_rank) == (70, "kl", sent.mean_checksum, 2)
        assert got.lora == (8, 16.0)
        assert all(np.array_equal(got.mean[n], sent.mean[n].astype(np.float32)) and
                   np.array_equal(got.sigma[n], sent.sigma[n].astype(np.float32)) for n in sent.mean)


def test_a_sigma_of_the_noised_tensors_alone_round_trips_through_a_checkpoint(tmp_path):
    import dataclasses

    from threepo.services.posterior import load_posterior, save_posterior

    server = PosteriorServer(_plan("c3po", 4, group_size=8, base_seed=3))
    full = _pv(3)
    sent = dataclasses.replace(full, sigma={"w": full.sigma["w"]})  # "b" is outside the noise mask
    server.publish(sent)
    save_posterior(server, str(tmp_path))
    got = load_posterior(str(tmp_path)).published(0)
    assert set(got.mean) == {"w", "b"} and set(got.sigma) == {"w"}
    assert np.array_equal(got.sigma["w"], sent.sigma["w"].astype(np.float32))


def test_checkpoint_files_round_trip_with_references_dropped(tmp_path):
    from threepo.services.posterior import load_posterior, save_posterior

    server = _server(_plan("c3po", 4, group_size=8, base_seed=3), upto=1)
    server.acquire(1)  # an older version kept by a reference
    server.publish(_pv(2))
    server.acquire(2, n=5)
    save_posterior(server, str(tmp_path))
    restored = load_posterior(str(tmp_path))
    assert sorted(_refcounts(restored)) == sorted(_refcounts(server)) and restored.current_version() == 2
    assert all(restored.version_plan(v) == server.version_plan(v) for v in sorted(_refcounts(server)))
    assert _refcounts(restored)[2] == 0  # what was in flight is regenerated on resume
    assert np.array_equal(restored.weights(1)[1]["w"], server.weights(1)[1]["w"])


def _refcounts(server: PosteriorServer) -> dict[int, int]:
    """The versions the server holds now and the references each holds (from its checkpoint state)."""
    return {v["version"]: v["refcount"] for v in server.state()["versions"]}


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, np.ndarray))


def test_bytes_per_engine_do_not_depend_on_the_number_of_slots():
    sizes = []
    for n_slots in (1, 2, 4, 8):
        server = _server(_plan("c3po", n_slots, group_size=8), upto=1)
        sizes.append(server.bytes_of(1))
    assert sizes == [2 * 4 * (12 + 4)] * 4  # mean + σ, fp32, 16 numbers each
