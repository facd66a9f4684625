"""The Rank admission limiter as a pure object: calls weighed by their predicted cost, driven by
a fake clock (no timing assertions). Costs come from a fit to synthetic measured batches."""

from __future__ import annotations

import dataclasses

import pytest

from services.ranker.admission import AdmissionConfig, AdmissionLimiter, Admitted, Refusal
from services.ranker.call_cost import CallWork, CostPrior
from services.ranker.config import RankerConfig
from shared.config import ConfigError, load_config

# Measured costs the limiter is taught (the shape of the tiny preset on this CPU).
BATCH_S, TOKEN_S, PAIR_S = 2e-3, 5e-6, 100e-9
HIT = CallWork.of(4096, 48, against_psi=True)  # ~2 ms
SHORT_FULL = CallWork.of(300, 48, against_psi=False)  # ~14 ms
LONG_FULL = CallWork.of(4096, 48, against_psi=False)  # ~1.72 s


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def seconds(work: CallWork) -> float:
    return BATCH_S + TOKEN_S * work.tokens + PAIR_S * work.pairs


def limiter(measured: bool = True, **overrides: object) -> tuple[AdmissionLimiter, FakeClock]:
    """A limiter; `measured`: it has seen batches timed exactly by the costs above."""
    clock = FakeClock()
    lim = AdmissionLimiter(AdmissionConfig(**overrides), clock)  # type: ignore[arg-type]
    if measured:
        for prefix in (0, 200, 800, 1600, 3200, 6400) * 20:
            work = CallWork.of(prefix, 64, against_psi=prefix == 0)
            lim.costs.observe(work.tokens, work.pairs, seconds(work))
    return lim, clock


def admit(lim: AdmissionLimiter, work: CallWork, remaining_s: float | None = None) -> Admitted:
    decision = lim.try_acquire(work, remaining_s)
    assert isinstance(decision, Admitted), decision
    return decision


def refuse(lim: AdmissionLimiter, work: CallWork, remaining_s: float | None = None) -> Refusal:
    decision = lim.try_acquire(work, remaining_s)
    assert isinstance(decision, Refusal), decision
    return decision


def test_the_limiter_predicts_from_the_measured_costs():
    lim, _ = limiter()
    # The prior (1 ms a batch) still weighs a little against 120 measured batches.
    for work in (HIT, SHORT_FULL, LONG_FULL):
        assert lim.costs.seconds(work) == pytest.approx(seconds(work), rel=0.1)


def test_cheap_calls_are_admitted_where_an_expensive_one_is_refused():
    lim, _ = limiter(deadline_fraction=0.5)
    admit(lim, SHORT_FULL, remaining_s=1.0)
    refusal = refuse(lim, LONG_FULL, remaining_s=1.0)  # ~1.7 s of work for 0.5 s of budget
    assert refusal.kind == "deadline"
    assert "this call's 4144 tokens in full" in refusal.reason
    assert "1000 ms left" in refusal.reason
    for _ in range(20):  # the same deadline fits calls against psi and short recomputes
        admit(lim, HIT, remaining_s=1.0)
        admit(lim, SHORT_FULL, remaining_s=1.0)
    assert lim.inflight == 41
    assert lim.inflight_work_s == pytest.approx(21 * seconds(SHORT_FULL) + 20 * seconds(HIT), rel=0.1)
    assert lim.refused == {"limit": 0, "work": 0, "deadline": 1, "late": 0}


def test_work_in_flight_counts_against_a_call_s_deadline():
    lim, _ = limiter(deadline_fraction=0.5)
    mid = CallWork.of(1500, 48, against_psi=False)  # ~0.24 s
    admit(lim, mid, remaining_s=1.0)
    admit(lim, mid, remaining_s=1.0)  # ~0.48 s of work: within half of 1 s
    refusal = refuse(lim, mid, remaining_s=1.0)  # ~0.72 s
    assert "2 ranking calls in flight (48" in refusal.reason
    admit(lim, mid, remaining_s=2.0)  # a caller who waits longer is admitted
    admit(lim, HIT, remaining_s=None)  # no deadline: only the work bound applies


def test_an_idle_instance_refuses_a_call_that_alone_would_outlive_its_deadline():
    lim, _ = limiter(deadline_fraction=0.5)
    refusal = refuse(lim, LONG_FULL, remaining_s=1.0)
    assert refusal.kind == "deadline"
    assert refusal.reason.startswith("overloaded: 0 ranking calls in flight (0 ms of predicted work)")
    assert lim.inflight == 0
    admit(lim, LONG_FULL, remaining_s=4.0)  # its own deadline leaves room for it


def test_before_any_measurement_the_prior_admits_long_calls_to_measure_them():
    lim, _ = limiter(measured=False, prior=CostPrior(per_batch_s=1e-3, per_token_s=10e-6))
    assert lim.costs.measured == 0
    decision = admit(lim, LONG_FULL, remaining_s=1.0)  # no quadratic cost in the prior
    assert decision.work_s == pytest.approx(1e-3 + 4144 * 10e-6, rel=1e-3)
    lim.release(decision, served=True)
    lim.costs.observe(LONG_FULL.tokens, LONG_FULL.pairs, seconds(LONG_FULL))  # the engine's batch
    lim.costs.observe(HIT.tokens, HIT.pairs, seconds(HIT))
    assert refuse(lim, LONG_FULL, remaining_s=1.0).kind == "deadline"  # now it knows
    admit(lim, HIT, remaining_s=1.0)


def test_work_bound_refuses_beyond_target_but_not_below_min_limit():
    lim, _ = limiter(target_s=1.0, min_limit=2)
    admit(lim, LONG_FULL)  # 1.7 s > 1 s, but below min_limit calls in flight
    admit(lim, HIT)
    refusal = refuse(lim, HIT)
    assert refusal.kind == "work"
    assert "exceed the bound of 1000 ms" in refusal.reason
    assert lim.refused["work"] == 1


def test_the_work_bound_fits_many_cheap_calls_or_few_expensive_ones():
    cheap, _ = limiter(target_s=0.5, min_limit=1)
    n_cheap = 0
    while isinstance(cheap.try_acquire(SHORT_FULL), Admitted):
        n_cheap += 1
    assert n_cheap == pytest.approx(0.5 / seconds(SHORT_FULL), abs=2)  # ~35
    dear, _ = limiter(target_s=0.5, min_limit=1)
    mid = CallWork.of(1500, 48, against_psi=False)
    n_dear = 0
    while isinstance(dear.try_acquire(mid), Admitted):
        n_dear += 1
    assert n_dear == 2


def test_release_returns_the_call_s_work_and_zero_when_empty():
    lim, _ = limiter()
    a, b = admit(lim, SHORT_FULL), admit(lim, HIT)
    lim.release(a, served=True)
    assert lim.inflight == 1
    assert lim.inflight_work_s == pytest.approx(b.work_s)
    lim.release(b, served=False)
    assert lim.inflight == 0
    assert lim.inflight_work_s == 0.0
    with pytest.raises(RuntimeError):
        lim.release(b, served=True)


def test_the_hard_cap_holds_whatever_the_cost():
    lim, _ = limiter(max_limit=3, min_limit=1)
    for _ in range(3):
        admit(lim, HIT)
    refusal = refuse(lim, HIT)
    assert refusal.kind == "limit"
    assert refusal.reason == "overloaded: 3 ranking calls in flight, limit 3"
    assert lim.limit == 3


def test_target_zero_keeps_only_the_hard_cap():
    lim, _ = limiter(target_s=0.0, max_limit=5, min_limit=1)
    for _ in range(5):
        admit(lim, LONG_FULL, remaining_s=0.001)  # no deadline check either
    assert refuse(lim, HIT).kind == "limit"


def test_idle_time_is_not_read_as_low_throughput():
    lim, clock = limiter(window_s=0.5)
    assert lim.throughput is None
    for _ in range(200):  # one call every second, each served in 10 ms
        decision = admit(lim, HIT)
        clock.advance(0.01)
        lim.release(decision, served=True)
        clock.advance(0.99)
    assert lim.throughput == pytest.approx(100.0, rel=0.02)  # not 1 call/s (EW: ~1% high)


def test_unserved_calls_take_busy_time_but_add_no_throughput():
    lim, clock = limiter()
    for served in (True,) * 20 + (False,) * 10:
        decision = admit(lim, HIT)
        clock.advance(0.01 if served else 0.1)
        lim.release(decision, served=served)
    assert lim.throughput is not None
    assert lim.throughput < 50.0


def test_shedding_holds_for_shed_s_after_a_refusal():
    lim, clock = limiter(shed_s=1.0, max_limit=1, min_limit=1)
    assert not lim.shedding()
    admit(lim, HIT)
    assert not lim.shedding()  # admissions do not shed
    refuse(lim, HIT)
    assert lim.shedding()
    clock.advance(0.9)
    assert lim.shedding()
    clock.advance(0.2)
    assert not lim.shedding()
    never, _ = limiter(shed_s=0.0, max_limit=1, min_limit=1)
    admit(never, HIT)
    refuse(never, HIT)
    assert not never.shedding()


@pytest.mark.parametrize(
    "overrides",
    [
        {"target_s": -1.0},
        {"deadline_fraction": 0.0},
        {"deadline_fraction": 1.5},
        {"min_limit": 0},
        {"min_limit": 9, "max_limit": 8},
        {"window_s": 0.0},
        {"prior_s": -1.0},
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
            "RELAYGR_RANKER_ADMISSION_WINDOW_S": "0.5",
            "RELAYGR_RANKER_ADMISSION_DEADLINE_FRACTION": "0.8",
            "RELAYGR_RANKER_ADMISSION_SHED_PREINFER_MS": "0",
            "RELAYGR_RANKER_ADMISSION_PRIOR_BATCH_MS": "3",
            "RELAYGR_RANKER_ADMISSION_PRIOR_TOKEN_US": "20",
        },
    )
    assert config.admission == AdmissionConfig(
        target_s=0.1,
        deadline_fraction=0.8,
        min_limit=2,
        max_limit=64,
        window_s=0.5,
        shed_s=0.0,
        prior=CostPrior(per_batch_s=3e-3, per_token_s=20e-6),
    )
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
        ["--admission-prior-batch-ms", "-1"],
        ["--admission-prior-token-us", "-1"],
        ["--admission-prior-batch-ms", "0", "--admission-prior-token-us", "0"],
        ["--admission-shed-preinfer-ms", "-1"],
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


def test_calls_abandoned_by_their_callers_raise_the_drain_factor_and_refusals_follow():
    lim, clock = limiter(deadline_fraction=0.5, window_s=1.0)
    mid = CallWork.of(1500, 48, against_psi=False)  # ~0.24 s predicted
    assert lim.drain_factor == pytest.approx(1.0)
    for _ in range(10):  # each takes 3 x its prediction and its caller gives up
        decision = admit(lim, mid)
        clock.advance(3 * decision.work_s)
        lim.release(decision, served=False)
    assert lim.drain_factor > 10.0  # busy time, nothing delivered
    # Idle, the factor still holds right after the busy spell, and fades with the idle time.
    assert refuse(lim, mid, remaining_s=1.0).kind == "deadline"
    clock.advance(10 * lim.config.window_s)
    first = admit(lim, mid, remaining_s=1.0)  # no lock-out: the next call measures again
    refusal = refuse(lim, mid, remaining_s=1.0)  # one ahead: ~0.48 s x the drain factor
    assert "drained at x" in refusal.reason
    clock.advance(first.work_s)
    lim.release(first, served=True)
    for _ in range(40):  # the instance recovers: calls take what was predicted, and are served
        decision = admit(lim, mid)
        clock.advance(decision.work_s)
        lim.release(decision, served=True)
    # Completions are counted when they happen, busy time as it passes: with exponential weighting
    # the factor reads low by about exp(-service_s / (2 x window_s)), ~0.89 here.
    assert lim.drain_factor == pytest.approx(1.0, rel=0.15)
    admit(lim, mid, remaining_s=1.0)
    admit(lim, mid, remaining_s=1.0)


def test_batching_gains_lower_the_drain_factor():
    lim, clock = limiter()
    for _ in range(400):  # four calls at a time finish together in 1.5 x one call's prediction
        batch = [admit(lim, SHORT_FULL) for _ in range(4)]
        clock.advance(1.5 * batch[0].work_s)
        for decision in batch:
            lim.release(decision, served=True)
    assert lim.drain_factor == pytest.approx(1.5 / 4, rel=0.15)


def test_an_admitted_call_s_queue_budget_keeps_its_promise():
    lim, _ = limiter(deadline_fraction=0.5)
    mid = CallWork.of(1500, 48, against_psi=False)  # ~0.24 s
    first = admit(lim, mid, remaining_s=1.0)
    assert first.queue_budget_s == pytest.approx(0.5 - first.work_s)  # idle, d = 1: 0.5 s - its own work
    second = admit(lim, HIT, remaining_s=1.0)
    # The first call's work is ahead of it: waiting for it is what the budget is for.
    assert second.queue_budget_s == pytest.approx(0.5 - second.work_s)
    assert second.queue_budget_s >= lim.drain_factor * first.work_s
    assert admit(lim, HIT, remaining_s=None).queue_budget_s is None  # no deadline, no budget
    uncapped, _ = limiter(target_s=0.0)
    assert admit(uncapped, HIT, remaining_s=1.0).queue_budget_s is None  # hard cap only


def test_the_queue_budget_shrinks_with_a_measured_drain_factor():
    lim, clock = limiter(deadline_fraction=0.5, window_s=1.0)
    for _ in range(200):  # calls take 2 x their prediction, and are served
        decision = admit(lim, SHORT_FULL)
        clock.advance(2 * decision.work_s)
        lim.release(decision, served=True)
    hold = admit(lim, SHORT_FULL)  # busy: the factor applies
    decision = admit(lim, SHORT_FULL, remaining_s=1.0)
    assert lim.drain_factor > 1.5
    assert decision.queue_budget_s == pytest.approx(0.5 - lim.drain_factor * decision.work_s, rel=1e-6)
    lim.release(hold, served=True)
    lim.release(decision, served=True)


def test_a_call_past_its_queue_budget_is_refused_late_and_sheds_pre_inference():
    lim, clock = limiter(deadline_fraction=0.5, shed_s=1.0)
    decision = admit(lim, SHORT_FULL, remaining_s=1.0)
    assert decision.queue_budget_s is not None
    assert not lim.shedding()
    clock.advance(decision.queue_budget_s + 0.1)
    refusal = lim.late(decision, waited_s=decision.queue_budget_s + 0.1)
    assert refusal.kind == "late"
    assert refusal.reason.startswith(f"overloaded: waited {(decision.queue_budget_s + 0.1) * 1e3:.0f} ms")
    assert "348 tokens in full" in refusal.reason
    assert lim.refused["late"] == 1
    assert lim.shedding()
    assert lim.inflight == 1  # still held until released, as every admitted call
    lim.release(decision, served=False)
    assert lim.inflight == 0
    assert lim.inflight_work_s == 0.0


def test_idle_drain_factor_fades_to_one_with_idle_time():
    lim, clock = limiter(window_s=1.0)
    for _ in range(20):  # 4 x slower than predicted, served
        decision = admit(lim, SHORT_FULL)
        clock.advance(4 * decision.work_s)
        lim.release(decision, served=True)
    slow = lim.drain_factor
    assert slow > 2.0
    # Idle now. A deadline that fits the call at a factor between 1 and the measured one:
    probe = CallWork.of(1500, 48, against_psi=False)
    remaining = lim.costs.seconds(probe) * (1.0 + slow)  # half of it: w x (1 + slow) / 2
    assert refuse(lim, probe, remaining_s=remaining).kind == "deadline"  # right after the busy spell
    clock.advance(5.0)  # 5 time constants idle: the factor is 1 + (slow - 1) x e^-5
    admit(lim, probe, remaining_s=remaining)
