"""The engine measures its pre-inference steps at warm-up and sizes chunks from them (issue 13:
a step-cost fit that only saw small chunks kept them small on an H100)."""

from __future__ import annotations

import pytest

from kernels.device import accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.engine import Engine, EngineConfig
from services.ranker.graphs import GraphLimits
from services.ranker.model import HSTURanker, PrefixChunk
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
        prior = await engine.calibrate_steps(prefixes[0], repeats=3)  # a median: one timing is noise
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


class _GraphsOnTheCpu:
    """Stands in for RankGraphs where pre-inference steps from a prefix's first token would replay
    a graph: runs them eagerly (same result) and says it replayed them, so the engine's
    bookkeeping of graph steps runs on the CPU. Steps of later chunks are refused, as RankGraphs
    refuses them."""

    def __init__(self, model: HSTURanker, max_full_tokens: int) -> None:
        self.model = model
        self.limits = GraphLimits(max_full_tokens=max_full_tokens)
        self.replayed: list[list[tuple[int, int]]] = []

    def preinfer(self, chunks: list[PrefixChunk]) -> bool:
        if any(c.start for c in chunks):
            return False
        self.model.preinfer_chunks(chunks)
        self.replayed.append([(c.start, c.end) for c in chunks])
        return True

    def capture_pending(self, limit: int = 1) -> int:
        return 0

    def has_pending(self) -> bool:
        return False


async def test_graph_steps_get_a_cost_fit_of_their_own() -> None:
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig(preinfer_chunk_tokens=512))
    fake = _GraphsOnTheCpu(model, max_full_tokens=2048)
    engine.graphs = fake  # type: ignore[assignment]
    engine.start()
    try:
        prefixes, _ = batch(5, [Shape(2, 1022, 4, 4)])
        prior = await engine.calibrate_steps(prefixes[0], repeats=3)  # a median: one timing is noise
        assert engine.step_costs.prior == prior  # eager steps: the eager fit
        assert engine.first_costs is not None
        assert engine.scheduler.first_costs is engine.first_costs
        assert engine.scheduler.graph_tokens == 2048
        assert engine.scheduler.graph_batch == fake.limits.max_full_batch
        calibrated = [ends for ends in fake.replayed if ends[0][0] == 0]
        assert {ends[0][1] for ends in calibrated} == {256, 512, 1024}
        first_prior = engine.first_costs.prior
        engine.forget_batches()  # the measured priors stay, the samples go
        assert engine.first_costs.prior == first_prior
        assert engine.scheduler.first_costs is engine.first_costs
        # A pre-inference: its first chunk by a "graph" (the graph fit learns from it), the rest
        # eagerly (the eager fit does).
        first_seen, eager_seen = engine.first_costs.measured, engine.step_costs.measured
        psi = await engine.preinfer(prefixes[0])
        assert psi.prefix_len == 1024
        assert engine.first_costs.measured == first_seen + 1
        assert engine.step_costs.measured >= eager_seen + 1
    finally:
        engine.stop()


async def test_without_graphs_for_them_first_chunks_share_the_eager_fit() -> None:
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    engine = Engine(model, accelerator("cpu"), EngineConfig())
    engine.graphs = _GraphsOnTheCpu(model, max_full_tokens=0)  # type: ignore[assignment]
    engine.start()
    try:
        prefixes, _ = batch(5, [Shape(2, 1022, 4, 4)])
        await engine.calibrate_steps(prefixes[0], repeats=3)  # a median: one timing is noise
    finally:
        engine.stop()
    assert engine.first_costs is None
    assert engine.scheduler.first_costs is None
