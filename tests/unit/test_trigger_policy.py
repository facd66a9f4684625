"""The trigger's latency model, admission decisions and ledger (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from services.trigger.admission import (
    Bounds,
    InstanceLedger,
    OfferedLoad,
    Policy,
    Reason,
    ReturnRate,
    adds_little_work,
    decide,
    host_has_spare,
    reuse_pays,
    risk_threshold_ms,
    spare_outweighs_waits,
    spare_shortens,
    too_late,
)
from services.trigger.latency_model import LatencyModel, Sample
from shared.modelspec import preset
from shared.wire import MAX_PREINFER_DUES

BOUNDS = Bounds(slo_ms=50.0, risk_fraction=0.5, footprint_fraction=0.9, max_backlog=2)


def test_latency_model_fits_the_rankers_measurements():
    model = LatencyModel(preset("bench"), assumed_tflops=200.0)
    assert not model.calibrated
    uncalibrated = model.full_ms(8192)
    assert uncalibrated > model.full_ms(1024) > 0
    truth = {n: 1.0 + 0.002 * n + 1e-7 * n * n for n in (512, 1024, 2048, 4096, 8192)}
    model.observe([Sample(n, ms) for n, ms in truth.items()])
    assert model.calibrated
    for n, ms in truth.items():
        assert model.full_ms(n) == pytest.approx(ms, rel=1e-6)
    assert model.predict(4096, queue_depth=2, queued_tokens=1024) == pytest.approx(
        truth[4096] + 2 * truth[1024]
    )


def test_before_calibration_the_prior_is_scaled_to_the_first_measurements():
    """Issue 14's cold start: on a CPU the FLOPs prior at the assumed rate judged a 2000-token
    request whose full ranking took 260 ms (5x a 50 ms SLO) safe; one measured full ranking (the
    ranker's warm-up reports one) must bring the prediction to the device."""
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    slow = 260.0 / model.full_ms(2000)  # how much slower the device is than the prior assumed
    model.observe([Sample(1346, slow * model.full_ms(1346))])
    assert not model.calibrated
    assert model.prior_scale == pytest.approx(slow)
    assert model.full_ms(2000) == pytest.approx(260.0)
    assert model.min_tokens_over(25.0) < 2000  # at risk against half of a 50 ms SLO
    flops_300 = model.full_ms(300) / model.prior_scale
    model.observe([Sample(300, 2 * slow * flops_300)])  # two lengths: the upper median ratio
    assert not model.calibrated
    assert model.prior_scale == pytest.approx(2 * slow)
    model.observe([Sample(5000, 900.0)])  # a third length: fitted from now on
    assert model.calibrated


def test_latency_model_never_predicts_speed_ups_at_length():
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    model.observe([Sample(n, 10.0 + n * 0.01 - n * n * 1e-7) for n in (100, 1000, 2000, 4000)])
    assert model.full_ms(100_000) > model.full_ms(4000)


def ledger(budget: int = 1000, resident: int = 0, backlog: int = 0) -> InstanceLedger:
    led = InstanceLedger()
    led.report(0.0, budget, resident, backlog, 0)
    return led


def test_decisions_in_order():
    key = (1, 1)
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0) is Reason.NOT_AT_RISK
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(), key, 1.0) is Reason.ADMITTED
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(resident=850), key, 1.0)
        is Reason.FOOTPRINT_BOUND
    )
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(backlog=2), key, 1.0) is Reason.LOAD_BOUND
    led = ledger()
    led.admit(key, 100, now=1.0, lease_deadline=3.0)
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, led, key, 2.0) is Reason.ALREADY_RESIDENT
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, led, key, 4.0) is Reason.ADMITTED  # lease over


def test_a_loaded_instance_puts_shorter_requests_at_risk():
    key = (1, 1)
    # 20 ms is safe on an idle instance (threshold 25 ms), not at 40% load (15 ms).
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0, load=0.0) is Reason.NOT_AT_RISK
    )
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0, load=0.4) is Reason.ADMITTED
    assert risk_threshold_ms(BOUNDS, 0.4) == pytest.approx(15.0)
    # Saturation still tells long requests from short ones; a nonsense load is clamped.
    assert risk_threshold_ms(BOUNDS, 5.0) == pytest.approx(2.5)
    assert risk_threshold_ms(BOUNDS, -1.0) == pytest.approx(25.0)


def test_a_prefix_that_pays_by_reuse_is_admitted_though_not_at_risk():
    key = (1, 1)
    # 5 ms is far under the 25 ms threshold: admitted only on the reuse ground ...
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 5.0, 100, ledger(), key, 1.0) is Reason.NOT_AT_RISK
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 5.0, 100, ledger(), key, 1.0, pays_by_reuse=True)
        is Reason.ADMITTED
    )
    # ... and the bounds still hold for it.
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 5.0, 100, ledger(resident=850), key, 1.0, pays_by_reuse=True)
        is Reason.FOOTPRINT_BOUND
    )
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 5.0, 100, ledger(backlog=2), key, 1.0, pays_by_reuse=True)
        is Reason.LOAD_BOUND
    )
    assert decide(Policy.OFF, BOUNDS, 5.0, 100, ledger(), key, 1.0, pays_by_reuse=True) is Reason.NOT_AT_RISK


def test_a_call_at_risk_is_not_pre_inferred_where_that_adds_device_work():
    key = (1, 1)
    at_risk = dict(load=0.9)  # 20 ms against a 2.5 ms threshold
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0, **at_risk) is Reason.ADMITTED
    assert (
        decide(
            Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0, risk_adds_little=False, **at_risk
        )
        is Reason.ADDS_WORK
    )
    # Not at risk stays NOT_AT_RISK whatever the work; reuse admits whatever the work.
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 1.0, 100, ledger(), key, 1.0, risk_adds_little=False)
        is Reason.NOT_AT_RISK
    )
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, ledger(), key, 1.0, pays_by_reuse=True,
               risk_adds_little=False, **at_risk)
        is Reason.ADMITTED
    )  # fmt: skip
    assert (
        decide(Policy.ALL, BOUNDS, 20.0, 100, ledger(), key, 1.0, risk_adds_little=False) is Reason.ADMITTED
    )


def test_a_returning_key_turned_away_gets_a_prefetch_only_signal():
    key = (7, 1)

    def d(led: InstanceLedger | None = None, **kw: bool) -> Reason:  # a 20 ms call: not at risk
        return decide(Policy.SEQUENCE_AWARE, BOUNDS, 20.0, 100, led or ledger(), key, 1.0, **kw)

    assert d(returning=True, prefetch=True) is Reason.PREFETCH  # not at risk, but coming back
    assert d(returning=False, prefetch=True) is Reason.NOT_AT_RISK  # a first visit: nothing held
    assert d(returning=True, prefetch=False) is Reason.NOT_AT_RISK  # prefetch off
    # At risk but adding work: prefetched too.
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(), key, 1.0, risk_adds_little=False,
               returning=True, prefetch=True)
        is Reason.PREFETCH
    )  # fmt: skip
    # A reload takes HBM bytes: not past the footprint bound.
    assert d(returning=True, prefetch=True, led=ledger(resident=850)) is Reason.NOT_AT_RISK
    # Admitted for pre-inference: that, not a prefetch.
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(), key, 1.0, returning=True, prefetch=True)
        is Reason.ADMITTED
    )
    assert decide(Policy.OFF, BOUNDS, 20.0, 100, ledger(), key, 1.0, returning=True, prefetch=True) is (
        Reason.NOT_AT_RISK
    )


def test_a_new_key_is_pre_inferred_off_the_critical_path_while_the_device_has_room():
    key = (9, 1)

    def d(led: InstanceLedger | None = None, predicted: float = 4.0, **kw: object) -> Reason:
        return decide(Policy.SEQUENCE_AWARE, BOUNDS, predicted, 100, led or ledger(), key, 1.0, **kw)  # type: ignore[arg-type]

    assert d() is Reason.NOT_AT_RISK  # a 4 ms call on an idle instance: not at risk
    assert d(spare=True) is Reason.ADMITTED  # ... but the device has room: off the critical path
    # Whatever the work terms say: at risk and adding work, room on the device admits it.
    assert d(predicted=30.0, load=0.9, risk_adds_little=False) is Reason.ADDS_WORK
    assert d(predicted=30.0, load=0.9, risk_adds_little=False, spare=True) is Reason.ADMITTED
    # Only a key seen for the first time: a returning one is left to the other terms (or prefetch).
    assert d(spare=True, returning=True) is Reason.NOT_AT_RISK
    assert d(spare=True, returning=True, prefetch=True) is Reason.PREFETCH
    # Still within the bounds on bytes and backlog, and never twice for one key.
    assert d(spare=True, led=ledger(resident=850)) is Reason.FOOTPRINT_BOUND
    full = ledger()
    for k in ((1, 1), (2, 1)):
        full.admit(k, 1, 0.0, 10.0)
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 4.0, 100, full, key, 1.0, spare=True) is Reason.LOAD_BOUND
    admitted = ledger()
    admitted.admit(key, 100, 0.0, 10.0)
    assert d(spare=True, led=admitted) is Reason.ALREADY_RESIDENT
    assert decide(Policy.OFF, BOUNDS, 4.0, 100, ledger(), key, 1.0, spare=True) is Reason.NOT_AT_RISK


def test_a_pre_inference_that_would_not_start_before_its_call_is_too_late():
    key = (11, 1)
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(), key, 1.0, load=0.9, late=True) is (
        Reason.TOO_LATE
    )
    # The bounds on bytes and backlog come first; a turned-away call is not "late".
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 100, ledger(backlog=2), key, 1.0, late=True) is (
        Reason.LOAD_BOUND
    )
    assert (
        decide(Policy.SEQUENCE_AWARE, BOUNDS, 1.0, 100, ledger(), key, 1.0, late=True) is Reason.NOT_AT_RISK
    )
    # 3.7 ms pre-inferences, a 50 ms signal trip: with 10 ahead it starts 87 ms from now.
    assert not too_late(lead_s=0.2, trip_s=0.05, preinfer_ms=3.7, backlog=10)
    assert too_late(lead_s=0.08, trip_s=0.05, preinfer_ms=3.7, backlog=10)
    assert not too_late(lead_s=0.06, trip_s=0.05, preinfer_ms=3.7, backlog=0)  # nothing ahead
    assert too_late(lead_s=0.02, trip_s=0.05, preinfer_ms=3.7, backlog=0)  # the call comes first


def test_the_spare_term_wants_the_call_against_psi_to_be_at_most_half_the_full_ranking():
    assert spare_shortens(full_ms=4.4, cached_ms=1.8)  # 4096 tokens on an H100
    assert spare_shortens(full_ms=4.0, cached_ms=2.0)
    assert not spare_shortens(full_ms=2.2, cached_ms=1.8)  # a short prefix: fixed costs dominate both


def test_the_spare_term_wants_a_saving_that_counts_against_the_slo():
    # 4096 tokens on an H200 (k10c): full 2.8 ms, call against psi 1.3 -- under half, but 1.5 ms
    # is 3% of a 50 ms SLO.
    assert spare_shortens(full_ms=2.8, cached_ms=1.3)  # the share test alone admits it
    assert not spare_shortens(full_ms=2.8, cached_ms=1.3, slo_ms=50.0, min_saving=0.1)
    assert not spare_shortens(full_ms=3.6, cached_ms=1.3, slo_ms=50.0, min_saving=0.1)  # keeping psi
    # 8192 and 16384 tokens on the same GPU (k10a, k10b): 7.4 / 1.6 and 18.4 / 1.9 ms.
    assert spare_shortens(full_ms=7.4, cached_ms=1.6, slo_ms=50.0, min_saving=0.1)
    assert spare_shortens(full_ms=18.4, cached_ms=1.9, slo_ms=50.0, min_saving=0.1)
    # 4096 tokens on an H100 (2026-11-27): full 4.4, cached 1.6 -- 2.8 ms, under 5: refused
    # too (the spare term's runs there were 0.90x and 1.35x the baseline, without it 0.83x and
    # 1.57x, in two leases: no clear gain to keep).
    assert not spare_shortens(full_ms=4.4, cached_ms=1.6, slo_ms=50.0, min_saving=0.1)
    assert spare_shortens(full_ms=4.4, cached_ms=1.6, slo_ms=50.0, min_saving=0.05)
    # A tighter SLO makes the same saving count for more.
    assert spare_shortens(full_ms=2.8, cached_ms=1.3, slo_ms=10.0, min_saving=0.1)
    # Both tests hold: a large saving that is still most of the full ranking is not enough.
    assert not spare_shortens(full_ms=40.0, cached_ms=30.0, slo_ms=50.0, min_saving=0.1)


def test_the_spare_terms_host_bound_is_the_share_of_a_core_the_instances_requests_take():
    # The H200's length mix (k27b): ~2.7-3.6 ms of host a request at 300-400 calls a second is
    # about one core: no room for the spare term under a bound of 0.6.
    assert not host_has_spare(host_ms_per_request=3.0, calls_per_s=300.0, host_max=0.6)
    # 16384 tokens at ~45 calls a second (k24): the host is mostly idle.
    assert host_has_spare(host_ms_per_request=4.0, calls_per_s=45.0, host_max=0.6)
    # At the bound: refused (a share of 0.6 is not under 0.6).
    assert not host_has_spare(host_ms_per_request=2.0, calls_per_s=300.0, host_max=0.6)
    assert host_has_spare(host_ms_per_request=2.0, calls_per_s=299.0, host_max=0.6)
    # Off (0), or a host not yet measured: the device alone decides, as before the bound.
    assert host_has_spare(host_ms_per_request=3.0, calls_per_s=1000.0, host_max=0.0)
    assert host_has_spare(host_ms_per_request=None, calls_per_s=1000.0, host_max=0.6)
    assert host_has_spare(host_ms_per_request=0.0, calls_per_s=1000.0, host_max=0.6)
    # A negative rate (a count that went back) is no load.
    assert host_has_spare(host_ms_per_request=3.0, calls_per_s=-5.0, host_max=0.6)


def test_adds_little_work_compares_pre_inference_plus_the_cached_call_with_the_full_ranking():
    # One H100 at 4096 tokens, CUDA graphs: full 4.3 ms, pre-inference 3.8, call against psi 1.6.
    assert not adds_little_work(4.3, 3.8, 1.6, max_extra=0.15)  # 5.4 > 1.15 x 4.3 = 4.95
    assert adds_little_work(4.3, 3.8, 1.6, max_extra=0.3)  # 5.4 <= 5.59
    # Long prefixes: attention dominates both passes, the call against psi is a small share.
    assert adds_little_work(13.0, 12.5, 0.7, max_extra=0.15)
    assert not adds_little_work(13.0, 12.5, 0.7, max_extra=-1.0)  # clamped to 0: 13.2 > 13


def test_reuse_pays_when_calls_on_one_psi_save_more_than_the_pre_inference():
    # GPU-like costs at 4096 tokens: full 5 ms, pre-inference 4.8 ms, cached call 1.5 ms.
    assert not reuse_pays(5.0, 4.8, 1.5, later_calls=0.0)  # one call: 5 < 4.8 + 1.5
    assert not reuse_pays(5.0, 4.8, 1.5, later_calls=0.3)  # 1.3 x 3.5 = 4.55 < 4.8
    assert reuse_pays(5.0, 4.8, 1.5, later_calls=2.0)  # 3 x 3.5 = 10.5 > 4.8
    # A cached call as dear as a full one never pays, however often the user returns.
    assert not reuse_pays(2.0, 1.9, 2.0, later_calls=16.0)
    assert not reuse_pays(5.0, 4.8, 1.5, later_calls=-3.0)  # nonsense is clamped to no return


def test_where_rankings_keep_psi_reuse_pays_only_for_a_pre_inference_cheaper_than_the_ranking():
    # The later calls read the full ranking's own psi: however many, pre-inferring saves nothing
    # unless it plus the call against psi cost less than the full ranking (H100, 4096 tokens).
    assert not reuse_pays(4.3, 3.8, 1.6, later_calls=16.0, rankings_keep_psi=True)
    assert reuse_pays(13.0, 11.5, 0.7, later_calls=0.0, rankings_keep_psi=True)  # 12.2 < 13


def test_return_rate_counts_keys_seen_within_the_window():
    rate = ReturnRate(window_s=10.0, prior_events=0.0)
    assert rate.fraction() == 0.0
    assert rate.expected_later() == 0.0
    assert rate.observe((1, 1), 0.0) is False
    assert rate.observe((1, 1), 5.0) is True
    assert rate.observe((1, 2), 6.0) is False  # another prefix version: another psi
    assert rate.observe((1, 1), 16.0) is False  # 11 s after its last sighting: outside the window
    assert rate.fraction() == pytest.approx(1 / 4, rel=1e-3)
    # Sessions of 3 calls (first + 2 returns): a third of events are new, E[later] about 2.
    steady = ReturnRate(window_s=10.0, prior_events=0.0)
    t = 0.0
    for user in range(3000):
        for _ in range(3):
            t += 0.01
            steady.observe((user, 1), t)
    assert steady.fraction() == pytest.approx(2 / 3, rel=0.02)
    assert steady.expected_later() == pytest.approx(2.0, rel=0.1)
    # One-off users: no reuse expected.
    once = ReturnRate(window_s=10.0)
    for user in range(1000):
        once.observe((user, 1), user * 0.01)
    assert once.expected_later() == 0.0


def test_return_rate_is_bounded_in_memory_and_conservative_when_fresh():
    rate = ReturnRate(window_s=100.0, max_keys=2, prior_events=32.0)
    rate.observe((1, 1), 0.0)
    rate.observe((2, 1), 0.1)
    rate.observe((3, 1), 0.2)  # forgets (1, 1), the oldest
    assert rate.observe((1, 1), 0.3) is False
    assert rate.observe((3, 1), 0.4) is True
    # One return in five events, against 32 pseudo-events of none: far under 1/5.
    assert rate.fraction() == pytest.approx(1 / 37, rel=1e-3)
    with pytest.raises(ValueError, match="window_s"):
        ReturnRate(window_s=-1.0)


def test_the_spare_term_saves_more_than_its_pre_inference_makes_other_calls_wait():
    # The mix's long prefixes on an H200 (k14b, 300 req/s): ~9.2 ms full, 1.2 against psi, 13.3
    # ms of pre-inference: 8 ms saved on the call and 300 x (9.2^2 - 1.2^2) / 2 = 12.5 of others'
    # waits behind its full ranking, against 300 x 13.3^2 / 2 = 26.5 behind the pre-inference.
    assert not spare_outweighs_waits(full_ms=9.2, cached_ms=1.2, preinfer_ms=13.3, calls_per_s=300.0)
    # 16384 tokens at ~35 req/s (k10b, k12b): 18.4 / 1.9 ms, ~20 ms of pre-inference: 16.5 + 5.9
    # saved against 7; 8192 tokens at ~90 req/s: 7.4 / 1.6, ~9 ms: 5.8 + 2.3 against 3.6.
    assert spare_outweighs_waits(full_ms=18.4, cached_ms=1.9, preinfer_ms=20.0, calls_per_s=35.0)
    assert spare_outweighs_waits(full_ms=7.4, cached_ms=1.6, preinfer_ms=9.0, calls_per_s=90.0)
    # 16384 tokens at 50.6 req/s (k17a): 19.6 / 1.9 ms, 24-27 ms of pre-inference. Counting the
    # call's own saving alone (17.7) turned a 27 ms one away (18.4 of waits); with the waits its
    # full ranking would impose (9.6 more) both pay.
    assert spare_outweighs_waits(full_ms=19.6, cached_ms=1.9, preinfer_ms=24.0, calls_per_s=50.6)
    assert spare_outweighs_waits(full_ms=19.6, cached_ms=1.9, preinfer_ms=27.0, calls_per_s=50.6)
    # A pre-inference far dearer than the full ranking it replaces is still turned away under load.
    assert not spare_outweighs_waits(full_ms=19.6, cached_ms=1.9, preinfer_ms=40.0, calls_per_s=50.6)
    # Nobody else to wait: any saving pays; no saving never does.
    assert spare_outweighs_waits(full_ms=3.0, cached_ms=1.0, preinfer_ms=50.0, calls_per_s=0.0)
    assert not spare_outweighs_waits(full_ms=1.0, cached_ms=1.0, preinfer_ms=0.0, calls_per_s=0.0)


def test_offered_load_is_work_per_unit_time_and_decays():
    load = OfferedLoad(window_s=2.0)
    assert load.fraction(0.0) == 0.0
    # 25 requests/s of 16 ms each, for long enough to settle: about 40% of the instance's time.
    t = 0.0
    for _ in range(500):
        t += 0.04
        load.add(t, 16.0)
    assert load.fraction(t) == pytest.approx(0.4, rel=0.05)
    assert load.rate(t) == pytest.approx(25.0, rel=0.05)  # and 25 events a second
    # No more traffic: the estimate decays by e every window.
    assert load.fraction(t + 2.0) == pytest.approx(0.4 / np.e, rel=0.05)
    assert load.fraction(t + 20.0) < 1e-3
    assert load.rate(t + 20.0) < 0.1  # the event rate decays alike
    # A clock that steps back (events decided out of order) never inflates the estimate.
    late = OfferedLoad(window_s=2.0)
    late.add(10.0, 100.0)
    late.add(9.0, 100.0)
    assert late.fraction(10.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="window_s"):
        OfferedLoad(window_s=0)


def test_ablation_policies():
    assert decide(Policy.ALL, BOUNDS, 1.0, 10**9, ledger(resident=10**9), (1, 1), 0.0) is Reason.ADMITTED
    assert decide(Policy.OFF, BOUNDS, 1e9, 1, ledger(), (1, 1), 0.0) is Reason.NOT_AT_RISK


def test_ledger_counts_admissions_until_a_later_report_or_the_lease_end():
    led = ledger(budget=1000, resident=100, backlog=0)
    led.admit((1, 1), 200, now=1.0, lease_deadline=5.0)
    led.admit((2, 1), 300, now=2.0, lease_deadline=2.5)
    assert led.resident_bytes() == 600
    assert led.backlog(2.0) == 2
    led.forget_expired(3.0)
    assert led.resident_bytes() == 300
    led.report(4.0, 1000, 250, 1, 0)  # the ranker now reports user 1's psi itself
    assert led.resident_bytes() == 250
    assert led.backlog(4.0) == 1
    assert led.is_admitted((1, 1), 4.5)


def test_an_admission_leaves_the_backlog_when_its_pre_inference_is_expected_done():
    led = ledger(budget=1000, resident=0, backlog=1)
    for user in range(10):  # 10 admissions within one Stats interval, each done 30 ms after
        now = 0.01 * (user + 1)
        led.admit((user, 1), 10, now=now, lease_deadline=5.0, queued_until=now + 0.03)
    assert led.backlog(0.1) == 1 + 4  # those admitted at 0.07 .. 0.10 are still queued
    assert led.backlog(0.2) == 1
    assert led.resident_bytes() == 100  # their psi still counts until the ranker reports it
    assert decide(Policy.SEQUENCE_AWARE, BOUNDS, 30.0, 10, led, (99, 1), 0.2) is Reason.ADMITTED


def test_only_the_backlog_due_first_is_ahead_of_a_pre_inference():
    # The ranker builds pre-inferences earliest deadline first: of 3 reported, due 50, 100 and
    # 200 ms from the report, one is ahead of an event due at 70 ms and all three of one at 1 s.
    led = ledger(budget=1000, resident=0, backlog=3)
    led.report(0.0, 1000, 0, 3, 0, dues=[0.2, 0.05, 0.1])
    assert led.backlog_ahead(0.0, 0.07) == 1
    assert led.backlog_ahead(0.0, 0.15) == 2
    assert led.backlog_ahead(0.0, 1.0) == 3
    assert led.backlog(0.0) == 3  # the load bound still counts them all
    # Admissions since the report: those due first and not expected done yet.
    led.admit((1, 1), 10, now=0.01, lease_deadline=5.0, queued_until=0.05, due=0.06)
    led.admit((2, 1), 10, now=0.01, lease_deadline=5.0, queued_until=0.05, due=0.5)
    assert led.backlog_ahead(0.02, 0.07) == 2
    assert led.backlog_ahead(0.02, 1.0) == 5
    assert led.backlog_ahead(0.06, 1.0) == 3  # both expected done by then
    # Reloads and pre-inferences without a deadline are listed in no due: never ahead.
    led.report(1.0, 1000, 0, 4, 0, dues=[1.1])
    assert led.backlog_ahead(1.0, 1.05) == 0
    assert led.backlog_ahead(1.0, 1.2) == 1
    # A report listing no deadlines for its backlog (a ranker that sends none): all of it ahead.
    led.report(2.0, 1000, 0, 4, 0)
    assert led.backlog_ahead(2.0, 2.01) == 4
    # A list cut at its cap: past its last deadline, the unlisted rest is ahead too.
    led.report(3.0, 1000, 0, MAX_PREINFER_DUES + 10, 0, dues=[3.5] * MAX_PREINFER_DUES)
    assert led.backlog_ahead(3.0, 3.4) == 0
    assert led.backlog_ahead(3.0, 3.6) == MAX_PREINFER_DUES + 10


def test_latency_model_ignores_a_stalled_batch():
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    truth = {n: 2.0 + 0.01 * n for n in (100, 200, 400, 800, 1600, 3200)}
    samples = [Sample(n, ms) for n, ms in truth.items() for _ in range(3)]
    samples.append(Sample(100, 3000.0))  # a compile stall
    model.observe(samples)
    assert model.full_ms(100) == pytest.approx(truth[100], rel=0.05)


@pytest.mark.parametrize("stalls", [1, 5, 10])
def test_latency_model_is_not_dragged_by_a_minority_of_long_stalls(stalls):
    # A fresh ranker's first pre-inferences on a GPU included compiles seconds long among ~10 ms
    # steps: a least-squares first fit through them predicted 20-200x the real cost, judged none
    # of them an outlier, and the trigger, pricing pre-inference by it, stopped admitting any.
    rng = np.random.default_rng(stalls)

    def truth(n: int) -> float:
        return 1.5 + 0.0012 * n + 1e-8 * n * n

    samples = [Sample(int(n), truth(int(n)) * rng.uniform(0.9, 1.2)) for n in rng.integers(200, 6000, 22)]
    samples[11:11] = [
        Sample(int(n), float(rng.uniform(3000, 12000))) for n in rng.integers(200, 6000, stalls)
    ]
    model = LatencyModel(preset("bench"), assumed_tflops=400.0)
    model.observe(samples)
    assert model.kept == 22
    for n in (1000, 4000):
        assert model.full_ms(n) == pytest.approx(truth(n), rel=0.25)


def noisy_samples(seed: int) -> tuple[list[Sample], Callable[[int], float]]:
    """Many short requests, a few long ones, every timing within +-30% of the truth (noise that
    grows with the cost, as on a shared CPU)."""
    rng = np.random.default_rng(seed)

    def truth(n: int) -> float:
        return 4.0 + 0.005 * n + 8e-5 * n * n

    samples = [Sample(int(n), truth(int(n)) * rng.uniform(0.7, 1.3)) for n in rng.integers(50, 300, 100)]
    samples += [Sample(n, truth(n) * rng.uniform(0.7, 1.3)) for n in (700, 800, 900, 1000)]
    return samples, truth


@pytest.mark.parametrize("seed", range(30))
def test_latency_model_keeps_the_long_samples_of_noisy_measurements(seed):
    # The long tail is what the at-risk decision rests on: an outlier bound set by the short
    # requests' absolute residuals dropped it and extrapolated from the short ones (up to 74% off).
    samples, truth = noisy_samples(seed)
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    model.observe(samples)
    assert model.kept == len(samples)
    assert model.full_ms(1000) == pytest.approx(truth(1000), rel=0.25)


def test_latency_model_fit_is_the_best_non_negative_one():
    # Full rankings timed in-process on the shared 2-core build machine (prefix + 48 tokens).
    # Their unconstrained fit has a negative linear term; clamping it to 0 (as the fit once did)
    # kept the other terms fitted to compensate for it: 3x the squared error of the best
    # non-negative fit, every prediction from 60 tokens up too high.
    measured = {60: 1.0, 147: 11.4, 290: 27.7, 712: 56.1, 1002: 138.7}
    n = np.array(list(measured), dtype=np.float64)
    y = np.array(list(measured.values()))
    a, b, c = LatencyModel._fit(n, y)
    assert min(a, b, c) >= 0
    sse = float(np.sum((a + b * n + c * n * n - y) ** 2))
    rng = np.random.default_rng(0)
    for _ in range(2000):  # no non-negative coefficients fit better
        a2, b2, c2 = rng.uniform(0, 20), rng.uniform(0, 0.1), rng.uniform(0, 3e-4)
        assert float(np.sum((a2 + b2 * n + c2 * n * n - y) ** 2)) >= sse - 1e-9
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    model.observe([Sample(int(k), v) for k, v in measured.items()])
    assert model.kept == len(measured)  # none of these is an outlier: the model is that fit
    assert model.full_ms(1002) == pytest.approx(a + b * 1002 + c * 1002 * 1002)


def test_min_tokens_over_is_the_first_length_predicted_above():
    model = LatencyModel(preset("tiny"), assumed_tflops=1.0)
    model.observe([Sample(n, 2.0 + 0.01 * n + 1e-5 * n * n) for n in (100, 200, 400, 800)])
    n = model.min_tokens_over(50.0)
    assert n is not None
    assert model.full_ms(n - 1) <= 50.0 < model.full_ms(n)
    assert model.min_tokens_over(1.0) == 0  # the intercept alone exceeds it
    assert LatencyModel(preset("tiny"), assumed_tflops=1.0).min_tokens_over(1e30) is None
