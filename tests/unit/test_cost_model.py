"""Reload-or-recompute (services/ranker/cost_model.py): recompute is judged by the engine's
measured steps once attached (issue 14: at L4096 on an H100 the FLOPs estimate made every reload
look dearer than a recompute, and no reload was ever served)."""

from __future__ import annotations

import pytest

from services.ranker.cost_model import CostModel
from shared.modelspec import preset

SPEC = preset("bench")
PSI_4K = SPEC.psi_bytes(4096)  # 128 MiB


def h100_like() -> CostModel:
    return CostModel(SPEC, assumed_tflops=200.0, h2d_gbps=20.0)


def test_the_flops_estimate_alone_never_reloads_4k_psi():
    costs = h100_like()
    assert costs.recompute_ms(4096) < 4.0  # the FLOPs at 200 TFLOP/s: optimistic
    for busy in (False, True):
        assert not costs.choose(PSI_4K, 4096, compute_busy=busy).reload


def test_measured_steps_judge_recompute_and_win_over_the_wall_time_fit():
    costs = h100_like()
    costs.observe_preinfer(1024, 2.0)  # waited behind ranking steps too: not the device's cost
    costs.observe_preinfer(2048, 3.0)
    costs.step_s = lambda tokens: 5.0e-3 * -(-tokens // 4096)  # one ~5 ms step per 4096 tokens
    assert costs.recompute_ms(4096) == pytest.approx(5.0)
    assert costs.recompute_ms(8192) == pytest.approx(10.0)
    idle = costs.choose(PSI_4K, 4096, compute_busy=False)
    assert (idle.reload, idle.reason) == (False, "recompute_cheaper")  # 6.9 ms copy vs 5 ms
    busy = costs.choose(PSI_4K, 4096, compute_busy=True)
    assert (busy.reload, busy.reason) == (True, "copy_engine_under_load")
    # Within idle_copy_preference (1.25x) the copy wins at rest too: it leaves the compute free.
    costs.step_s = lambda tokens: 6.5e-3 * -(-tokens // 4096)
    assert costs.choose(PSI_4K, 4096, compute_busy=False).reason == "cheaper"  # 6.9 ms vs 6.5
    costs.observe_reload(PSI_4K, 0.2 + PSI_4K / 40e9 * 1e3)  # one reload measured at 40 GB/s
    costs.observe_reload(PSI_4K, 0.2 + PSI_4K / 40e9 * 1e3)
    assert costs.choose(PSI_4K, 4096, compute_busy=False).reason == "cheaper"


def test_a_callers_measured_saving_overrides_the_step_model():
    # A call on a miss would run a full ranking, not a chunked pre-inference: what a reload
    # saves it is the measured gap between its full and cached rankings (engine.reload_saving_s).
    costs = CostModel(SPEC, assumed_tflops=200.0, h2d_gbps=52.0)
    costs.step_s = lambda tokens: 1.0e-3  # a step model that prices the prefix far too cheap
    assert not costs.choose(PSI_4K, 4096, compute_busy=False).reload
    decision = costs.choose(PSI_4K, 4096, compute_busy=False, recompute_ms=3.1)
    assert (decision.reload, decision.reason, decision.recompute_ms) == (True, "cheaper", 3.1)
    assert not costs.choose(PSI_4K, 4096, compute_busy=True, recompute_ms=1.0).reload


@pytest.mark.parametrize("busy", [False, True])
def test_psi_may_be_reloaded_exactly_where_some_load_would_have_choose_reload_it(busy):
    """may_reload is choose's widest rule (under load): psi it rejects is never reloaded, idle
    or busy; psi choose reloads under load, it accepts."""
    costs = CostModel(SPEC, assumed_tflops=200.0, h2d_gbps=50.0)
    for mib in (1, 20, 50, 100, 128, 512):
        nbytes = mib << 20
        for saving_ms in (0.1, 0.5, 1.0, 2.0, 3.0, 10.0):
            chosen = costs.choose(nbytes, 4096, compute_busy=busy, recompute_ms=saving_ms).reload
            if chosen:
                assert costs.may_reload(nbytes, saving_ms)
            if busy:
                assert chosen == costs.may_reload(nbytes, saving_ms)
    # On the H200's link (~54 GB/s, k25b): ~660-token psi of the bench preset (21.6 MB) saving
    # 0.2 ms is never worth a copy; 4096-token psi (128 MiB) saving 2.3 ms is.
    h200 = CostModel(SPEC, assumed_tflops=200.0, h2d_gbps=54.0)
    assert not h200.may_reload(21_632_160, 0.22)
    assert h200.may_reload(128 << 20, 2.3)
