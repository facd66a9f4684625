"""The Rank admission limiter as a pure object, driven by a fake clock (no timing assertions).

Completions are counted when they happen and busy time as it passes, so with exponential
weighting the estimate reads high by about exp(service_s / (2 x window_s)): rates are compared
with a tolerance of a few percent.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.ranker.admission import AdmissionConfig, AdmissionLimiter
from services.ranker.config import RankerConfig
from shared.config import ConfigError, load_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def limiter(**overrides: float) -> tuple[AdmissionLimiter, FakeClock]:
    clock = FakeClock()
    return AdmissionLimiter(AdmissionConfig(**overrides), clock), clock  # type: ignore[arg-type]


def serve(lim: AdmissionLimiter, clock: FakeClock, calls: int, service_s: float, concurrent: int = 1) -> None:
    """`calls` served in waves of `concurrent`, each wave taking service_s: a rate of
    concurrent / service_s calls per busy second."""
    for _ in range(calls // concurrent):
        for _ in range(concurrent):
            assert lim.try_acquire() is None
        clock.advance(service_s)
        for _ in range(concurrent):
            lim.release(served=True)


def saturate(lim: AdmissionLimiter, clock: FakeClock, seconds: float, rate: float) -> None:
    """Overload: callers keep the instance at its limit, and it completes `rate` calls/s whatever
    the concurrency (CPU-bound, no batching gain). Refusals are what the limiter is for here."""
    for _ in range(int(seconds * rate)):
        while lim.try_acquire() is None:
            pass
        clock.advance(1.0 / rate)
        lim.release(served=True)


def test_the_prior_gives_the_first_limit():
    lim, _ = limiter(prior_rps=12.0, target_s=0.25)
    assert lim.throughput == pytest.approx(12.0)  # 3 calls per 0.25 s
    for _ in range(3):
        assert lim.try_acquire() is None
    refusal = lim.try_acquire()
    assert refusal is not None
    assert refusal.kind == "limit"
    assert refusal.reason == "overloaded: 3 ranking calls in flight, limit 3"
    assert lim.inflight == 3
    assert lim.refused == {"limit": 1, "deadline": 0}


def test_without_a_prior_the_prior_rate_holds_until_busy_time_is_measured():
    lim, clock = limiter(prior_rps=2.0, target_s=1.0, prior_calls=0.0)
    assert lim.throughput is None
    assert lim.limit == 2
    assert lim.try_acquire(remaining_s=1e-6) is None  # nothing measured: no deadline check
    clock.advance(0.5)
    lim.release(served=True)
    assert lim.throughput == pytest.approx(2.0, rel=0.2)


def test_an_instance_overloaded_from_the_start_still_lowers_its_limit():
    # Every admitted call outlives its caller's deadline: none is ever served. Busy time alone
    # must bring the limit down (without the prior there would never be a first measurement).
    lim, clock = limiter(prior_rps=32.0, target_s=0.25, window_s=2.0)
    for _ in range(8):
        assert lim.try_acquire() is None
    clock.advance(1.0)
    for _ in range(8):
        lim.release(served=False)
    assert lim.limit < 8
    for _ in range(lim.limit):
        assert lim.try_acquire() is None
    clock.advance(1.0)
    assert lim.try_acquire() is not None
    assert lim.limit == 1


def test_limit_is_throughput_times_target():
    lim, clock = limiter(target_s=0.25, prior_rps=32.0, window_s=1.0)
    serve(lim, clock, calls=800, service_s=0.05, concurrent=4)  # 80 calls per busy second
    assert lim.throughput == pytest.approx(80.0, rel=0.03)
    assert lim.limit == math.ceil(lim.throughput * 0.25)  # ~80/s x 0.25 s
    assert lim.limit in (20, 21)


def test_idle_time_is_not_read_as_low_capacity():
    lim, clock = limiter(target_s=0.25, window_s=0.5)
    for _ in range(200):  # one call every second, each served in 10 ms
        serve(lim, clock, calls=1, service_s=0.01)
        clock.advance(0.99)
    measured = lim.throughput
    assert measured == pytest.approx(100.0, rel=0.01)  # not 1 call/s
    assert lim.limit == math.ceil(measured * 0.25)  # ~25
    clock.advance(3600.0)  # a long idle spell keeps the estimate
    assert lim.try_acquire() is None
    assert lim.throughput == pytest.approx(measured)


def test_limit_falls_when_the_instance_slows_down_and_refuses_beyond_it():
    lim, clock = limiter(target_s=0.25, window_s=2.0)
    saturate(lim, clock, seconds=10.0, rate=80.0)
    assert lim.limit in (20, 21)  # ~80/s x 0.25 s
    saturate(lim, clock, seconds=20.0, rate=6.0)  # contention: the same calls take ~13x longer
    assert lim.throughput == pytest.approx(6.0, rel=0.05)
    assert lim.limit == 2  # ceil(~6/s x 0.25 s)
    assert lim.inflight == 1
    assert lim.try_acquire() is None
    refusal = lim.try_acquire()
    assert refusal is not None
    assert refusal.kind == "limit"
    assert "2 ranking calls in flight, limit 2" in refusal.reason


def test_limit_recovers_when_the_instance_speeds_up():
    lim, clock = limiter(target_s=0.25, window_s=1.0)
    saturate(lim, clock, seconds=5.0, rate=8.0)
    assert lim.throughput == pytest.approx(8.0, rel=0.1)
    assert lim.limit <= 3
    saturate(lim, clock, seconds=5.0, rate=80.0)
    assert lim.throughput == pytest.approx(80.0, rel=0.1)
    assert lim.limit == math.ceil(lim.throughput * 0.25)


def test_min_and_max_bound_the_limit():
    lim, clock = limiter(target_s=0.25, min_limit=3, max_limit=10, prior_rps=12.0)
    serve(lim, clock, calls=16, service_s=1.0)  # 1/s: 0.25 -> the floor
    assert lim.limit == 3
    serve(lim, clock, calls=3000, service_s=0.001, concurrent=3)  # 3000/s -> the cap
    assert lim.limit == 10


def test_target_zero_keeps_only_the_hard_cap():
    lim, clock = limiter(target_s=0.0, max_limit=5, window_s=20.0)
    serve(lim, clock, calls=16, service_s=1.0)
    assert lim.throughput == pytest.approx(1.0, rel=0.03)  # still measured
    assert lim.limit == 5
    for _ in range(5):
        assert lim.try_acquire(remaining_s=0.001) is None  # no deadline check either
    refusal = lim.try_acquire()
    assert refusal is not None
    assert refusal.kind == "limit"


def test_a_call_whose_deadline_is_too_short_for_the_queue_is_refused():
    lim, clock = limiter(target_s=1.0, prior_rps=10.0)
    serve(lim, clock, calls=40, service_s=0.1)  # 10 calls/s
    assert lim.throughput == pytest.approx(10.0, rel=0.03)
    for _ in range(4):
        assert lim.try_acquire(remaining_s=10.0) is None
    refusal = lim.try_acquire(remaining_s=0.3)  # needs (4 + 1) / 10 = 0.5 s
    assert refusal is not None
    assert refusal.kind == "deadline"
    assert "4 ranking calls in flight" in refusal.reason
    assert "300 ms left" in refusal.reason
    assert lim.try_acquire(remaining_s=0.9) is not None  # ~0.5 s is more than half of 0.9 s
    assert lim.try_acquire(remaining_s=1.2) is None
    assert lim.try_acquire(remaining_s=None) is None  # no deadline: only the limit applies
    assert lim.refused == {"limit": 0, "deadline": 2}


def test_a_burst_that_fits_its_deadlines_is_admitted_one_that_does_not_is_refused():
    lim, clock = limiter(target_s=1.0, deadline_fraction=0.5)
    saturate(lim, clock, seconds=5.0, rate=48.0)
    while lim.inflight:  # the callers gave up: no completions to count
        lim.release(served=False)
    assert lim.throughput == pytest.approx(48.0, rel=0.05)
    for _ in range(16):  # ~1/3 s of work, callers that wait 30 s
        assert lim.try_acquire(remaining_s=30.0) is None
    clock.advance(16 / 48)
    for _ in range(16):
        lim.release(served=True)
    admitted = 0
    while lim.try_acquire(remaining_s=1.0) is None:  # callers that wait 1 s: ~0.5 s of work
        admitted += 1
    assert admitted == pytest.approx(24, abs=2)


def test_an_idle_instance_admits_a_call_whatever_it_measured():
    lim, clock = limiter(target_s=0.25, window_s=1.0)
    saturate(lim, clock, seconds=10.0, rate=0.5)  # a bad spell: 2 s per call
    while lim.inflight:
        lim.release(served=False)
    assert lim.try_acquire(remaining_s=0.1) is None  # 2 s expected, 0.1 s left: admitted (idle)
    assert lim.try_acquire(remaining_s=0.1) is not None  # not when a call is ahead
    clock.advance(0.01)  # the spell is over: the probe comes back fast
    lim.release(served=True)
    for _ in range(50):
        assert lim.try_acquire(remaining_s=0.1) is None
        clock.advance(0.01)
        lim.release(served=True)
    assert lim.limit > 1


def test_unserved_calls_take_busy_time_but_add_no_throughput():
    lim, clock = limiter(target_s=0.25)
    serve(lim, clock, calls=20, service_s=0.01)
    before = lim.throughput
    assert before is not None
    for _ in range(10):  # cancelled by their callers after 100 ms each
        assert lim.try_acquire() is None
        clock.advance(0.1)
        lim.release(served=False)
    after = lim.throughput
    assert after is not None
    assert after < before / 2


def test_busy_time_accrues_while_calls_are_in_flight_even_without_completions():
    lim, clock = limiter(target_s=0.25)
    serve(lim, clock, calls=300, service_s=0.01)
    assert lim.limit > 20
    assert lim.try_acquire() is None
    clock.advance(10.0)  # a stalled call: nothing completes for 5 windows
    refusal = lim.try_acquire()  # the estimate catches up here
    throughput = lim.throughput
    assert throughput is not None
    assert throughput < 4.0
    assert lim.limit == 1  # ceil(< 4/s x 0.25 s)
    assert refusal is not None
    assert refusal.kind == "limit"


def test_shedding_holds_for_shed_s_after_a_refusal():
    lim, clock = limiter(target_s=1.0, prior_rps=1.0, shed_s=1.0)
    assert not lim.shedding()
    assert lim.try_acquire() is None
    assert not lim.shedding()  # admissions do not shed
    assert lim.try_acquire() is not None
    assert lim.shedding()
    clock.advance(0.9)
    assert lim.shedding()
    clock.advance(0.2)
    assert not lim.shedding()
    never, _ = limiter(target_s=1.0, prior_rps=1.0, shed_s=0.0)
    assert never.try_acquire() is None
    assert never.try_acquire() is not None
    assert not never.shedding()


def test_release_without_acquire_is_an_error():
    lim, _ = limiter()
    with pytest.raises(RuntimeError):
        lim.release(served=True)


@pytest.mark.parametrize(
    "overrides",
    [
        {"target_s": -1.0},
        {"deadline_fraction": 0.0},
        {"deadline_fraction": 1.5},
        {"min_limit": 0},
        {"min_limit": 9, "max_limit": 8},
        {"window_s": 0.0},
        {"prior_rps": 0.0},
        {"prior_calls": -1.0},
        {"shed_s": -1.0},
    ],
)
def test_invalid_config_is_rejected(overrides):
    with pytest.raises(ValueError, match="must be"):
        AdmissionConfig(**overrides)


def test_ranker_settings_build_the_limiter_config():
    config = load_config(
        RankerConfig,
        ["--admission-target-ms", "100", "--admission-min-limit", "2", "--max-inflight-ranks", "64"],
        env={
            "RELAYGR_ADMISSION_WINDOW_S": "0.5",
            "RELAYGR_ADMISSION_DEADLINE_FRACTION": "0.8",
            "RELAYGR_ADMISSION_SHED_PREINFER_MS": "0",
        },
    )
    assert config.admission == AdmissionConfig(
        target_s=0.1, deadline_fraction=0.8, min_limit=2, max_limit=64, window_s=0.5, shed_s=0.0
    )
    assert load_config(RankerConfig, ["--admission-prior-rps", "4"], env={}).admission.prior_rps == 4.0
    # One set of defaults, except the floor, which the ranker derives from its batch size.
    assert load_config(RankerConfig, [], env={}).admission == dataclasses.replace(
        AdmissionConfig(), min_limit=32
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--admission-target-ms", "-5"],
        ["--admission-min-limit", "-1"],
        ["--max-batch", "8", "--max-inflight-ranks", "16"],  # the default floor, 4 x max_batch, above the cap
        ["--admission-window-s", "0"],
        ["--admission-deadline-fraction", "0"],
        ["--admission-deadline-fraction", "1.5"],
        ["--admission-prior-rps", "0"],
        ["--admission-shed-preinfer-ms", "-1"],
        ["--admission-prior-rps", "-1"],
        ["--admission-min-limit", "10", "--max-inflight-ranks", "4"],
    ],
)
def test_invalid_ranker_admission_settings_fail_at_start_up(argv):
    """Each one names a setting that cannot work; start-up refuses it with a clear error."""
    with pytest.raises(ConfigError):
        load_config(RankerConfig, argv, env={})


def test_the_default_floor_is_four_batches():
    config = load_config(RankerConfig, ["--max-batch", "6"], env={})
    assert config.admission.min_limit == 24
    assert load_config(RankerConfig, ["--admission-min-limit", "3"], env={}).admission.min_limit == 3
