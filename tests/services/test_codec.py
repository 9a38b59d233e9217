"""msgpack codec: every message round-trips exactly, version and type mismatches are refused, and a
rollout log survives a torn last record."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math

import msgpack
import numpy as np
import pytest

from threepo.services.wire import codec, messages
from threepo.services.wire.batching import batches_from_groups, report_of
from threepo.services.wire.codec import RolloutLog, decode, encode
from threepo.services.wire.messages import (SCHEMA_VERSION, Completion, ConsumedStep, GeneratedSample, Group, NoiseSpec,
                                            PublishedVersion, RolloutRequest, SamplingParams, ScoredCompletion,
                                            TaskItem, VerifyRequest, VerifyResult, VerifyStatus)

ITEM = TaskItem(uid="arith-00042", prompt="Q: 17+25=?\nA:", answer="42", verifier="math",
                solution="17+25=42", family="arith", difficulty=2)
CODE_ITEM = TaskItem(uid="code-7", prompt="def f(x):", answer="3\n", verifier="code_tests",
                     tests=("assert f(1) == 2", "assert f(2) == 3"), family="code")
COUNTDOWN = TaskItem(uid="cd-3", prompt="Reach 24 with 3 4 8", answer="24", verifier="countdown",
                     numbers=(3, 4, 8), family="countdown", difficulty=1)


def _completion(seq_no: int, slot_seed: int | None) -> Completion:
    return Completion(
        completion_id=f"g7/s1/r{seq_no}", request_id="g7/s1", group_id="g7", slot=1, prompt_uid=ITEM.uid,
        engine_id=1, seq_no=seq_no, policy_version=3, slot_seed=slot_seed, mean_checksum="9f3a0c21", weights_verified=True,
        prompt_ids=(5, 17, 22, 3), token_ids=(40, 41, 2), logprobs=(-0.125, -1.5, -0.0078125),
        finish_reason="stop", text="42",
    )


SCORED = ScoredCompletion(_completion(0, 2**63 - 1), VerifyResult(VerifyStatus.OK, 1.0, "exact", 0.004))
INFRA = ScoredCompletion(_completion(1, None), VerifyResult(VerifyStatus.INFRA_ERROR, math.nan, "sandbox down"))
rng = np.random.default_rng(0)
SAMPLES = [
    ITEM, CODE_ITEM, COUNTDOWN,
    VerifyRequest(item=ITEM, completion="42", finish_reason="length"),
    VerifyResult(VerifyStatus.WRONG, 0.0, "got 41", 0.25),
    INFRA.result,
    SamplingParams(temperature=0.7, top_p=0.95, top_k=50, max_new_tokens=64, n=4),
    NoiseSpec(posterior_version=5, seed=123456789),
    NoiseSpec(posterior_version=0, seed=None),
    RolloutRequest(request_id="g7/s1", group_id="g7", item=COUNTDOWN, policy_version=3, slot=1,
                   slot_seed=987, n=4),
    _completion(0, 11),
    SCORED,
    Group(group_id="g7", item=ITEM, policy_version=3, published_step=12, completions=(SCORED, INFRA)),
    PublishedVersion(learner_step=13, reason="budget",
                     mean={"model.embed.weight": rng.standard_normal((3, 5)).astype(np.float32),
                           "lm_head.bias": np.arange(4, dtype=np.float32)},
                     sigma={"model.embed.weight": np.full((3, 5), 1e-3, np.float32),
                            "lm_head.bias": np.zeros(4, np.float32)[::2]}, mean_checksum="0badc0de"),
    PublishedVersion(learner_step=0, reason="init", mean={"w": np.float32(2.5)}, sigma=None,
                     mean_checksum="5eed"),
]
_SPECS, _BATCHES, _SCORES = batches_from_groups([Group("g7", ITEM, 3, 12, (SCORED, SCORED))])
SAMPLES += [_SPECS[0], _BATCHES[0], _SCORES[0], report_of(_BATCHES[0]),
            ConsumedStep(5, tuple(_SPECS), tuple(_BATCHES), tuple(_SCORES)),
            GeneratedSample(token_ids=(40, 41, 2), logprobs=(-0.125, -1.5, -0.0078125), finish_reason="stop", text="42")]


def assert_same(a, b, where="msg"):
    """Exact equality including types: tuples stay tuples, arrays keep dtype/shape/bytes, NaN == NaN."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray | np.generic):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_samples_cover_every_message_type():
    message_types = {n for n, c in vars(messages).items()
                     if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == messages.__name__}
    assert message_types <= {type(s).__name__ for s in SAMPLES}, "add a sample for each new message"


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    assert_same(msg, decode(data))


def test_round_trip_keeps_nan_reward_enum_and_big_seed():
    group = decode(encode(SAMPLES[12]))
    assert group.completions[0].completion.slot_seed == 2**63 - 1
    assert group.completions[1].result.status is VerifyStatus.INFRA_ERROR
    assert math.isnan(group.completions[1].result.reward)
    assert isinstance(group.completions[0].completion.token_ids, tuple)


def test_non_contiguous_array_round_trips_as_its_values():
    sigma = decode(encode(SAMPLES[13])).sigma["lm_head.bias"]
    assert sigma.flags["C_CONTIGUOUS"] and sigma.shape == (2,)
    sigma[0] = 1.0  # decoded arrays are writable copies, not views of the input bytes


def test_wrong_schema_version_names_both_versions():
    envelope = msgpack.unpackb(encode(ITEM), raw=False, ext_hook=msgpack.ExtType)
    envelope["schema"] = SCHEMA_VERSION + 1
    data = msgpack.packb(envelope, use_bin_type=True)
    wanted = rf"TaskItem record has schema version {SCHEMA_VERSION + 1}.*reads schema version {SCHEMA_VERSION}"
    with pytest.raises(ValueError, match=wanted):
        decode(data)


def test_unknown_type_and_unknown_field_are_refused():
    envelope = msgpack.unpackb(encode(ITEM), raw=False, ext_hook=msgpack.ExtType)
    with pytest.raises(ValueError, match=r"unknown message type 'Rollout'; expected one of \[.*'TaskItem'"):
        decode(msgpack.packb({**envelope, "type": "Rollout"}, use_bin_type=True))
    envelope["fields"]["colour"] = "red"
    with pytest.raises(ValueError, match=r"TaskItem record .*unknown fields \['colour'\]"):
        decode(msgpack.packb(envelope, use_bin_type=True))
    with pytest.raises(ValueError, match="not a threepo record"):
        decode(msgpack.packb([1, 2, 3]))


def test_encode_refuses_foreign_objects():
    @dataclasses.dataclass(frozen=True)
    class Foreign:
        x: int

    with pytest.raises(ValueError, match="unknown message type 'Foreign'"):
        encode(Foreign(1))
    with pytest.raises(TypeError, match="expected a message dataclass, got dict"):
        encode({"uid": "x"})
    with pytest.raises(TypeError, match="cannot encode a value of type set"):
        encode(TaskItem(uid="u", prompt="p", answer="a", numbers={1}))

    class Colour(enum.Enum):
        RED = 1
    with pytest.raises(ValueError, match="unknown enum type 'Colour'"):
        encode(VerifyResult(Colour.RED, 0.0))


def test_rollout_log_appends_and_reads_back(tmp_path):
    path = tmp_path / "rollouts" / "log.msgpack"
    with RolloutLog(path) as log:
        for msg in SAMPLES[10:13]:
            log.append(msg)
    with RolloutLog(path) as log:  # reopening appends, it does not overwrite
        log.append(SAMPLES[0])
    got = list(RolloutLog.read(path))
    assert [type(m).__name__ for m in got] == ["Completion", "ScoredCompletion", "Group", "TaskItem"]
    assert_same(got[2], SAMPLES[12])


@pytest.mark.parametrize("cut", [1, 5, 8, 20])  # inside the header, just after it, mid-payload
def test_torn_last_record_is_reported_and_the_rest_kept(tmp_path, caplog, cut):
    path = tmp_path / "log.msgpack"
    with RolloutLog(path) as log:
        log.append(SAMPLES[10])
        log.append(SAMPLES[11])
    whole = path.read_bytes()
    last = len(whole) - (8 + len(encode(SAMPLES[11])))
    path.write_bytes(whole[: last + cut])
    with caplog.at_level(logging.WARNING, logger=codec.__name__):
        got = list(RolloutLog.read(path))
    assert len(got) == 1 and got[0].completion_id == SAMPLES[10].completion_id
    assert f"torn last record at byte {last}" in caplog.text and "keeping the 1 complete records" in caplog.text
    # Reopening cuts the torn tail, so the next record is readable after the good one.
    with RolloutLog(path) as log:
        log.append(SAMPLES[0])
    assert [type(m).__name__ for m in RolloutLog.read(path)] == ["Completion", "TaskItem"]


def test_corrupt_record_in_the_middle_raises(tmp_path):
    path = tmp_path / "log.msgpack"
    with RolloutLog(path) as log:
        log.append(SAMPLES[0])
        log.append(SAMPLES[1])
    data = bytearray(path.read_bytes())
    data[12] ^= 0xFF  # a payload byte of record 0
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="record 0 at byte 0 fails its CRC check"):
        list(RolloutLog.read(path))
