"""The learner's phase clock: where a step's time goes (services/learner/phases.py)."""

import contextlib
import time

import pytest

from threepo.services.learner.phases import PhaseClock


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_time_inside_an_inner_phase_counts_to_it_alone():
    clock = PhaseClock()
    with clock.phase("other"):
        _busy(0.02)
        with clock.phase("forward"):
            _busy(0.05)
        _busy(0.02)
    taken = clock.take()
    assert taken["cpu/forward_s"] == pytest.approx(0.05, abs=0.01)
    assert taken["cpu/other_s"] == pytest.approx(0.04, abs=0.01)
    assert taken["time/forward_s"] >= taken["cpu/forward_s"] - 1e-3
    assert clock.take() == {}  # taken once


def test_around_times_entering_and_leaving_a_context_not_its_body():
    @contextlib.contextmanager
    def slow_context():
        _busy(0.03)
        yield
        _busy(0.03)

    clock = PhaseClock()
    with clock.phase("other"):
        with clock.around("sample", slow_context()):
            _busy(0.04)
    taken = clock.take()
    assert taken["cpu/sample_s"] == pytest.approx(0.06, abs=0.015)
    assert taken["cpu/other_s"] == pytest.approx(0.04, abs=0.015)


def test_around_passes_the_body_error_to_the_context():
    seen = []

    @contextlib.contextmanager
    def context():
        try:
            yield
        except KeyError:
            seen.append("handled")
            raise

    clock = PhaseClock()
    with pytest.raises(KeyError):
        with clock.around("sample", context()):
            raise KeyError("boom")
    assert seen == ["handled"]


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown learner phase 'sampling'"):
        with PhaseClock().phase("sampling"):
            pass
