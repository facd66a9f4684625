"""hbm_headroom: a psi budget against the device's free memory once the ranker is warm."""

from __future__ import annotations

import asyncio

import pytest

from services.ranker.config import RankerConfig
from services.ranker.hbm_headroom import Verdict, judge
from services.ranker.service import RankerService
from shared.config import load_config
from tests.accelerators import Reporting

GIB = 2**30


def test_a_budget_with_room_to_spare_fits():
    headroom = judge(100 * GIB, 140 * GIB)
    assert headroom.verdict is Verdict.FITS
    assert headroom.advised_bytes == int(140 * GIB * 0.9)
    assert headroom.message().endswith(": fits")


def test_a_budget_that_leaves_under_the_margin_is_tight_and_says_what_to_set():
    # k15a's H200: 120000 MiB of psi beside ~140 GiB free; the allocator retried and stalled.
    headroom = judge(120000 * 2**20, 130 * GIB)
    assert headroom.verdict is Verdict.TIGHT
    message = headroom.message()
    assert "--hbm-budget-mb to at most 119808" in message  # 90% of 130 GiB, in MiB
    assert "fragmentation" in message


def test_a_budget_over_the_free_memory_exceeds():
    headroom = judge(150 * GIB, 140 * GIB)
    assert headroom.verdict is Verdict.EXCEEDS
    assert "exceeds the free memory" in headroom.message()


@pytest.mark.parametrize(
    ("budget", "free", "verdict"),
    [
        (90, 100, Verdict.FITS),
        (91, 100, Verdict.TIGHT),
        (100, 100, Verdict.TIGHT),
        (101, 100, Verdict.EXCEEDS),
    ],
)
def test_the_verdicts_change_exactly_at_the_margin_and_at_the_free_memory(budget, free, verdict):
    assert judge(budget * GIB, free * GIB).verdict is verdict


def test_a_margin_of_zero_leaves_only_fits_and_exceeds():
    assert judge(100 * GIB, 100 * GIB, margin=0.0).verdict is Verdict.FITS


@pytest.mark.parametrize(("budget", "free", "margin"), [(0, 1, 0.1), (1, -1, 0.1), (1, 1, 1.0), (1, 1, -0.1)])
def test_nonsense_is_refused(budget, free, margin):
    with pytest.raises(ValueError, match="must be"):
        judge(budget, free, margin)


async def test_the_ranker_refuses_to_start_with_a_budget_over_the_free_device_memory(monkeypatch):
    service = RankerService(load_config(RankerConfig, ["--device", "cpu", "--hbm-budget-mb", "2048"]))
    monkeypatch.setattr(service, "accel", Reporting(service.accel, free=1 * GIB))
    assert await asyncio.wait_for(service.run(install_signals=False), 120) == 1
    failure = service.lifecycle.failure
    assert failure is not None
    assert "psi budget 2.0 GiB, 1.0 GiB free" in failure
    assert "lower --hbm-budget-mb to at most 921" in failure  # 90% of 1 GiB, in MiB


async def test_the_ranker_serves_with_a_tight_budget_and_says_so(monkeypatch, capsys):
    service = RankerService(load_config(RankerConfig, ["--device", "cpu", "--hbm-budget-mb", "1000"]))
    monkeypatch.setattr(service, "accel", Reporting(service.accel, free=1 * GIB))
    await service.start()
    try:
        assert service.port != 0
    finally:
        await service.shutdown(grace_s=0.5)
    assert "hbm_budget_tight" in capsys.readouterr().out


def test_rankers_sharing_a_device_are_judged_with_their_budgets_together():
    # k18e: four processes on one H200, 27500 MiB each, ~108 GiB free once warm: out of memory.
    headroom = judge(27500 * 2**20, 108 * GIB, processes=4)
    assert headroom.verdict is Verdict.TIGHT
    assert headroom.advised_bytes == int(108 * GIB * 0.9) // 4
    message = headroom.message()
    assert "in each of 4 processes on the device" in message
    assert f"--hbm-budget-mb to at most {int(108 * GIB * 0.9) // 4 // 2**20}" in message
    assert judge(30 * GIB, 108 * GIB, processes=4).verdict is Verdict.EXCEEDS
    assert judge(27500 * 2**20, 108 * GIB).verdict is Verdict.FITS  # alone on the device
    with pytest.raises(ValueError, match="processes must be"):
        judge(GIB, GIB, processes=0)


async def test_the_ranker_refuses_a_budget_that_its_device_share_cannot_hold(monkeypatch):
    service = RankerService(
        load_config(RankerConfig, ["--device", "cpu", "--hbm-budget-mb", "600", "--device-processes", "2"])
    )
    monkeypatch.setattr(service, "accel", Reporting(service.accel, free=1 * GIB))
    assert await asyncio.wait_for(service.run(install_signals=False), 120) == 1
    failure = service.lifecycle.failure
    assert failure is not None
    assert "in each of 2 processes" in failure
    assert "lower --hbm-budget-mb to at most 460" in failure  # 90% of 1 GiB over two, in MiB
