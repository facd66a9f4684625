"""The engine measures its pre-inference steps at warm-up and sizes chunks from them (issue 13:
a step-cost fit that only saw small chunks kept them small on an H100)."""

from __future__ import annotations

import pytest

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig
from services.ranker.model import HSTURanker
from shared.modelspec import preset


async def test_calibration_makes_measured_step_costs_the_prior_and_survives_forget() -> None:
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig())
    engine.start()
    try:
        prefixes, _ = batch(5, [Shape(2, 1022, 4, 4)])
        short, _ = batch(6, [Shape(2, 200, 4, 4)])
        with pytest.raises(ValueError, match="over 256"):
            await engine.calibrate_steps(short[0])
        prior = await engine.calibrate_steps(prefixes[0], repeats=1)
        assert prior.pairs_measured
        assert prior.per_batch_s + prior.per_token_s > 0
        assert prior.per_pair_s >= 0
        assert engine.scheduler.costs is engine.step_costs
        assert engine.step_costs.prior == prior
        engine.forget_batches()  # the warm-up's samples go, the measured prior stays
        assert engine.step_costs.prior == prior
    finally:
        engine.stop()


async def test_copy_bandwidth_is_measured_on_the_device_thread() -> None:
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig())
    engine.start()
    try:
        gbps = await engine.measure_copy_gbps(nbytes=8 << 20, repeats=3)
    finally:
        engine.stop()
    assert 0.05 < gbps < 10_000  # a memory copy on any machine: finite, positive, not absurd
