"""The ranking-call cost model: fitted to measured batches, non-negative, prior before any."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from services.ranker import call_cost
from services.ranker.call_cost import CallWork, CostFit, CostPrior

# What the fit should recover: roughly this machine's tiny preset on the CPU.
TRUE_BATCH_S, TRUE_TOKEN_S, TRUE_PAIR_S = 2e-3, 5e-6, 100e-9


@dataclass(frozen=True)
class Sample:
    """The fields of the engine's BatchSample that the fit reads."""

    full: bool
    tokens: int
    prefix_len: int
    compute_ms: float
    seq: int


def true_seconds(tokens: int, pairs: int) -> float:
    return TRUE_BATCH_S + TRUE_TOKEN_S * tokens + TRUE_PAIR_S * pairs


def batches(n: int, seed: int = 0, noise: float = 0.05) -> list[Sample]:
    """A mix of batches against psi (suffixes of 8-400 tokens) and full recomputes (one user,
    prefixes of 100-6000 tokens), timed by the true model with multiplicative noise."""
    rng = random.Random(seed)
    out = []
    for seq in range(n):
        suffix = rng.randint(8, 400)
        if rng.random() < 0.5:
            prefix = rng.randint(100, 6000)
            tokens, pairs, full = prefix + suffix, prefix * (prefix + suffix), True
        else:
            prefix, tokens, pairs, full = 0, suffix, 0, False
        seconds = true_seconds(tokens, pairs) * (1 + rng.uniform(-noise, noise))
        out.append(Sample(full, tokens, prefix, seconds * 1e3, seq))
    return out


def test_before_any_measurement_the_prior_predicts():
    fit = CostFit(CostPrior(per_batch_s=1e-3, per_token_s=10e-6))
    coef = fit.coefficients
    assert coef.per_batch_s == pytest.approx(1e-3, rel=1e-3)
    assert coef.per_token_s == pytest.approx(10e-6, rel=1e-3)
    assert coef.per_pair_s == pytest.approx(0.0, abs=1e-12)  # learnt from measurements only
    assert fit.measured == 0
    assert fit.seconds(CallWork.of(1000, 48, against_psi=False)) == pytest.approx(
        1e-3 + 1048 * 10e-6, rel=1e-3
    )
    assert fit.seconds(CallWork.of(1000, 48, against_psi=True)) == pytest.approx(1e-3 + 48 * 10e-6, rel=1e-3)


def test_the_fit_recovers_per_batch_per_token_and_per_pair_costs():
    fit = CostFit(CostPrior())
    assert fit.observe_batches(batches(400)) == 400
    coef = fit.coefficients
    assert coef.per_batch_s == pytest.approx(TRUE_BATCH_S, rel=0.15)
    assert coef.per_pair_s == pytest.approx(TRUE_PAIR_S, rel=0.05)
    for prefix, suffix, psi in [(4096, 48, False), (2048, 48, False), (300, 48, False), (8000, 48, True)]:
        work = CallWork.of(prefix, suffix, psi)
        assert fit.seconds(work) == pytest.approx(true_seconds(work.tokens, work.pairs), rel=0.1)


def test_a_long_full_recompute_costs_a_hundred_short_calls():
    fit = CostFit(CostPrior())
    fit.observe_batches(batches(200))
    long_full = fit.seconds(CallWork.of(4096, 48, against_psi=False))
    hit = fit.seconds(CallWork.of(4096, 48, against_psi=True))
    assert long_full > 100 * hit


def test_the_fit_follows_a_slower_machine():
    fit = CostFit(CostPrior(memory_batches=32.0))
    fit.observe_batches(batches(200))
    before = fit.seconds(CallWork.of(3000, 48, against_psi=False))
    slower = [
        Sample(b.full, b.tokens, b.prefix_len, 3 * b.compute_ms, 1000 + b.seq) for b in batches(200, seed=1)
    ]
    fit.observe_batches(slower)
    assert fit.seconds(CallWork.of(3000, 48, against_psi=False)) == pytest.approx(3 * before, rel=0.1)


def test_coefficients_stay_non_negative():
    # Batches that get cheaper as they get longer: a per-token cost below 0 fits best.
    fit = CostFit(CostPrior())
    for seq in range(50):
        tokens = 100 + 50 * seq
        fit.observe(tokens, 0, max(1e-4, 0.05 - tokens * 1e-5))
    coef = fit.coefficients
    assert coef.per_token_s >= 0.0
    assert coef.per_pair_s >= 0.0
    assert coef.per_batch_s > 0.0


def test_batches_are_observed_once_in_sequence_order():
    fit = CostFit(CostPrior())
    samples = batches(10)
    assert fit.observe_batches(samples[:6]) == 6
    assert fit.observe_batches(samples) == 4  # the engine's window repeats the old ones
    assert fit.observe_batches(samples) == 0
    assert fit.measured == 10


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0])
def test_bad_measurements_are_ignored(seconds):
    fit = CostFit(CostPrior())
    before = fit.coefficients
    fit.observe(100, 0, seconds)
    assert fit.measured == 0
    assert fit.coefficients == before


@pytest.mark.parametrize(
    "overrides",
    [
        {"per_batch_s": -1.0},
        {"per_token_s": -1e-6},
        {"per_batch_s": 0.0, "per_token_s": 0.0},
        {"batches": -1.0},
        {"memory_batches": 0.5},
    ],
)
def test_invalid_prior_is_rejected(overrides):
    with pytest.raises(ValueError, match="must"):
        CostPrior(**overrides)


def test_call_work_counts_what_each_path_computes():
    assert CallWork.of(1000, 48, against_psi=True) == CallWork(48, 0, False)
    assert CallWork.of(1000, 48, against_psi=False) == CallWork(1048, 1000 * 1048, True)
    assert CallWork.of(1000, 48, against_psi=False).describe() == "1048 tokens in full"
    with pytest.raises(ValueError, match="token counts"):
        CallWork.of(-1, 48, against_psi=False)


def test_the_fit_is_solved_on_each_early_batch_then_every_few(monkeypatch: pytest.MonkeyPatch) -> None:
    fit = CostFit(CostPrior())
    solves = []
    real_solve = fit._solve
    monkeypatch.setattr(fit, "_solve", lambda: solves.append(fit.measured) or real_solve())
    for i in range(call_cost._SOLVE_EACH_FIRST + 4 * call_cost._SOLVE_EVERY):
        tokens = 100 + 10 * i
        fit.observe(tokens, 0, true_seconds(tokens, 0))
    early = list(range(1, call_cost._SOLVE_EACH_FIRST + 1))
    later = [call_cost._SOLVE_EACH_FIRST + k * call_cost._SOLVE_EVERY for k in range(1, 5)]
    assert solves == early + later
    # The last batch observed was solved with: the coefficients are those of every batch seen.
    assert fit.coefficients.seconds(1000, 0) == pytest.approx(true_seconds(1000, 0), rel=0.05)
