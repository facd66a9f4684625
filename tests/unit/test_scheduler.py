"""The iteration scheduler's policy on the CPU: budget, earliest-deadline order, batching, chunk
progress, join vs take-over."""

from __future__ import annotations

import pytest

from services.ranker.call_cost import CostFit, CostPrior
from services.ranker.scheduler import (
    Chunk,
    IterationScheduler,
    PreinferItem,
    RankItem,
    RankKind,
    Relay,
    SchedulerConfig,
)
from shared.fingerprint import CHUNK_TOKENS

MS = 1e-3


def fitted(per_batch_s: float, per_token_s: float, per_pair_s: float) -> CostFit:
    """A fit that has measured exactly these costs (many batches of varied shapes)."""
    fit = CostFit(CostPrior(per_batch_s=per_batch_s, per_token_s=per_token_s, batches=0.0))
    for tokens in (64, 256, 1024, 4096):
        for prefix in (0, 512, 2048, 8192):
            pairs = prefix * tokens
            fit.observe(tokens, pairs, per_batch_s + per_token_s * tokens + per_pair_s * pairs)
    return fit


# ~1 ms a step, 2 us a token, 0.5 ns an attention pair: a 2048-token chunk after 4096 built
# tokens is predicted at 1 + 4.1 + 6.3 = 11.4 ms.
COSTS = fitted(1 * MS, 2e-6, 0.5e-9)


def scheduler(**overrides) -> IterationScheduler:
    config = SchedulerConfig(
        **{"max_wait_s": 0.0, "chunk_tokens": 2048, "max_rank_delay_s": 5 * MS, **overrides}
    )
    return IterationScheduler(config, COSTS)


def rank(
    id: int, deadline: float, kind: RankKind = RankKind.CACHED, tokens: int = 100, submitted: float = 0.0
):
    return RankItem(id, kind, deadline, submitted, tokens)


def test_the_fit_learnt_the_costs():
    c = COSTS.coefficients
    assert c.per_batch_s == pytest.approx(1 * MS, rel=0.05)
    assert c.per_token_s == pytest.approx(2e-6, rel=0.05)
    assert c.per_pair_s == pytest.approx(0.5e-9, rel=0.05)


def test_chunks_fit_the_step_budget_and_are_the_largest_that_do():
    s = scheduler()
    budget = s.step_budget_s()
    assert budget == pytest.approx(6 * MS, rel=0.05)  # the step's fixed cost is not held against it
    for done in (0, 1024, 4096, 8192):
        plan = s.plan(0.0, [], [PreinferItem(1, 16384, done, 0.0)])
        (chunk,) = plan.chunks
        n = chunk.end - chunk.start
        assert chunk.start == done
        assert n % CHUNK_TOKENS == 0
        assert s.chunk_seconds(done, n) <= budget or n == CHUNK_TOKENS
        assert n == 2048 or s.chunk_seconds(done, n + CHUNK_TOKENS) > budget
    # Later chunks attend to more built tokens: they get smaller under the same budget.
    sizes = [s.plan(0.0, [], [PreinferItem(1, 65536, d, 0.0)]).chunks[0].end - d for d in (0, 16384, 49152)]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] > sizes[-1]


def test_a_tiny_budget_still_builds_one_fingerprint_chunk_per_step():
    s = scheduler(max_rank_delay_s=1e-6)
    (chunk,) = s.plan(0.0, [], [PreinferItem(1, 5000, 512, 0.0)]).chunks
    assert (chunk.start, chunk.end) == (512, 512 + CHUNK_TOKENS)


def test_chunks_grow_past_the_first_size_when_a_step_is_mostly_fixed_cost():
    """On an H100 a chunk step costs ~4.5 ms of host time whatever its size (256 to 4096 tokens).
    With the costs the engine calibrates at warm-up (Engine.calibrate_steps) as the prior, the
    whole 4096-token prefix is one step, also after measuring small steps: the fixed cost does
    not count against the delay budget."""
    fit = CostFit(CostPrior(per_batch_s=4.4 * MS, per_token_s=0.0, per_pair_s=0.0, pairs_measured=True))
    for _ in range(8):
        fit.observe(256, 256 * 512, 4.5 * MS)
    s = IterationScheduler(SchedulerConfig(max_wait_s=0.0, chunk_tokens=4096, max_rank_delay_s=5 * MS), fit)
    (chunk,) = s.plan(0.0, [], [PreinferItem(1, 4096, 0, 0.0)]).chunks
    assert (chunk.start, chunk.end) == (0, 4096)
    # The default prior (a CPU's 10 us a token) and the same measurements: stuck at 256, which is
    # why the engine calibrates.
    cpu = CostFit(CostPrior())
    for _ in range(8):
        cpu.observe(256, 256 * 512, 4.5 * MS)
    stuck = IterationScheduler(s.config, cpu).plan(0.0, [], [PreinferItem(1, 4096, 0, 0.0)])
    assert stuck.chunks[0].end == 256


def test_a_prefix_is_built_in_aligned_chunks_up_to_its_last_token():
    s = scheduler(chunk_tokens=1024, max_rank_delay_s=1.0)
    length, done, chunks = 5000, 0, []
    while done < length:
        (chunk,) = s.plan(0.0, [], [PreinferItem(7, length, done, 0.0)]).chunks
        assert chunk.start == done
        chunks.append(chunk)
        done = chunk.end
    assert [c.end - c.start for c in chunks] == [1024] * 4 + [904]
    assert all(c.start % CHUNK_TOKENS == 0 for c in chunks)


def test_ranking_calls_go_first_earliest_deadline_first_and_of_one_kind():
    s = scheduler()
    ranks = [
        rank(1, 0.300),
        rank(2, 0.100, RankKind.FULL),
        rank(3, 0.200),
        rank(4, 0.150, RankKind.FULL),
        rank(5, 0.050),
    ]
    plan = s.plan(0.0, ranks, [PreinferItem(9, 4096, 0, 0.0)])
    assert plan.rank == (5, 3, 1)
    assert not plan.chunks
    plan = s.plan(0.0, [r for r in ranks if r.id in (2, 4)], [])
    assert plan.rank == (2, 4)


def test_calls_against_psi_go_before_a_full_call_that_has_slack():
    s = scheduler()
    # A full ranking of 4096 tokens is predicted at ~9 ms, a batch of two cached calls at ~1.4 ms.
    full = rank(1, 0.050, RankKind.FULL, tokens=4096)
    hits = [rank(2, 0.060), rank(3, 0.070)]
    assert s.plan(0.0, [full, *hits], []).rank == (2, 3)
    # Once the full call's slack is gone it runs first (earliest deadline first).
    assert s.plan(0.040, [full, *hits], []).rank == (1,)
    # A partial call (computing the rest of its prefix) is treated alike.
    partial = rank(4, 0.050, RankKind.PARTIAL, tokens=2048)
    assert s.plan(0.0, [partial, *hits], []).rank == (2, 3)
    # Not when the full call would start past its queue budget (the engine would drop it).
    hurried = RankItem(5, RankKind.FULL, 0.050, 0.0, 4096, start_by=0.001)
    assert s.plan(0.0, [hurried, *hits], []).rank == (5,)


def test_hits_do_not_pass_a_queue_of_full_calls_that_would_miss_behind_them():
    s = scheduler()
    # Two full rankings of ~9.2 ms each and two hits of ~1.4 ms in one batch: the first full has
    # slack for the hits (10.6 ms against 12), the second not once the first has run (19.8
    # against 19; 18.4 without the hits): passing both over would put it past its deadline.
    fulls = [rank(1, 0.012, RankKind.FULL, tokens=4096), rank(2, 0.019, RankKind.FULL, tokens=4096)]
    hits = [rank(3, 0.060), rank(4, 0.070)]
    assert s.plan(0.0, [*fulls, *hits], []).rank == (1,)
    # With room for both after the hits, the hits go first.
    roomy = [fulls[0], rank(2, 0.030, RankKind.FULL, tokens=4096)]
    assert s.plan(0.0, [*roomy, *hits], []).rank == (3, 4)


def test_short_calls_pass_a_long_one_only_while_every_long_call_keeps_its_deadline():
    s = scheduler()
    # Two long full rankings (~18.9 ms each) and a short one (~1.8 ms): the short one may not go
    # first, since the second long one would then finish past its deadline (39.6 ms against 39;
    # 37.8 in deadline order), though the first would not (20.7 against 21).
    longs = [
        RankItem(1, RankKind.FULL, 0.021, 0.0, 4416, 4096 * 4416),
        RankItem(2, RankKind.FULL, 0.039, 0.0, 4416, 4096 * 4416),
    ]
    short = [RankItem(3, RankKind.FULL, 0.060, 0.0, 400, 80 * 400)]
    assert s.plan(0.0, [*longs, *short], []).rank[0] == 1
    roomy = [longs[0], RankItem(2, RankKind.FULL, 0.080, 0.0, 4416, 4096 * 4416)]
    assert s.plan(0.0, [*roomy, *short], []).rank == (3,)


def test_short_calls_of_one_kind_run_before_a_long_one_that_has_slack():
    s = scheduler()
    # A full ranking of a 4096-token prefix (~19 ms predicted) and two of 80 tokens (~1.8 ms):
    # batched behind it they waited for all of it; alone they go first while it keeps its deadline.
    long = RankItem(1, RankKind.FULL, 0.050, 0.0, 4416, 4096 * 4416)
    short = [
        RankItem(2, RankKind.FULL, 0.060, 0.0, 400, 80 * 400),
        RankItem(3, RankKind.FULL, 0.070, 0.0, 400, 80 * 400),
    ]
    medium = RankItem(4, RankKind.FULL, 0.080, 0.0, 2000, 1000 * 2000)  # ~6 ms: not short
    assert s.plan(0.0, [long, *short, medium], []).rank == (2, 3)
    # Without the slack, earliest deadline first: the long call leads (a short one joins it, as
    # far as the batching rule allows).
    assert s.plan(0.032, [long, *short], []).rank == (1, 2)
    # A call that is not long (a few per-batch costs) is never put behind shorter ones.
    modest = RankItem(5, RankKind.FULL, 0.050, 0.0, 700, 600 * 700)  # ~2.6 ms
    assert s.plan(0.0, [modest, *short], []).rank[0] == 5


def test_work_that_would_miss_anyway_waits_behind_work_that_can_still_make_it():
    s = scheduler()

    def full(id: int, due_by: float) -> RankItem:  # ordered by a latency target half the SLO
        return RankItem(id, RankKind.FULL, due_by / 2, 0.0, 4096, due_by=due_by)

    # A full ranking (~9.2 ms) due in 5 ms misses whatever runs first; the one due in 15 ms makes
    # it only if it runs now. Earliest deadline first would make both late.
    late, in_time = full(1, 0.005), full(2, 0.015)
    assert s.doomed(0.0, late)
    assert not s.doomed(0.0, in_time)
    assert s.plan(0.0, [late, in_time], []).rank == (2,)
    # Once nothing can make it, earliest deadline first again, before any pre-inference no call
    # waits for (a doomed call is still served, not parked for ever behind background work).
    background = PreinferItem(9, 4096, 0, 0.0, need_by=0.100)
    assert s.plan(0.010, [late, in_time], [background]).rank == (1,)
    # A joined pre-inference whose rest cannot be built by its callers' due time waits behind a
    # hit that can still make its own; one that can still make it keeps its place.
    hopeless = PreinferItem(8, 4096, 0, 0.0, joined_deadline=0.002, joined_due_by=0.004)
    hit = RankItem(3, RankKind.CACHED, 0.010, 0.0, 100, due_by=0.020)
    assert s.doomed(0.0, hopeless)
    assert s.plan(0.0, [hit], [hopeless]).rank == (3,)
    assert [c.id for c in s.plan(0.0, [], [hopeless, background]).chunks] == [8]
    hopeful = PreinferItem(7, 2048, 1024, 0.0, joined_deadline=0.008, joined_due_by=0.015)
    assert not s.doomed(0.0, hopeful)
    assert [c.id for c in s.plan(0.0, [hit], [hopeless, hopeful]).chunks] == [7]
    # Joined by a call already past hope and a later one that is not (a session's next call):
    # the rest serves both, so it keeps its place (the engine keeps the latest due_by).
    shared = PreinferItem(5, 2048, 1024, 0.0, joined_deadline=0.002, joined_due_by=max(0.004, 0.030))
    assert not s.doomed(0.0, shared)
    assert [c.id for c in s.plan(0.0, [hit], [shared]).chunks] == [5]
    # Without a due time (no SLO given): never doomed, whatever the latency target says.
    assert not s.doomed(1e9, rank(4, 0.001, RankKind.FULL, tokens=4096))
    assert not s.doomed(1e9, PreinferItem(6, 4096, 0, 0.0, joined_deadline=0.001))
    assert s.plan(0.0, [rank(5, 0.001, RankKind.FULL, tokens=4096), in_time], []).rank == (5,)


def test_a_batch_respects_its_call_and_token_limits():
    s = scheduler(max_batch=2, max_batch_tokens=250)
    plan = s.plan(0.0, [rank(1, 0.1, tokens=200), rank(2, 0.2, tokens=100), rank(3, 0.3, tokens=40)], [])
    assert plan.rank == (1, 3)  # 2 would pass the token bound; the batch holds two calls
    # One call larger than the bound runs alone.
    assert s.plan(0.0, [rank(1, 0.1, tokens=999)], []).rank == (1,)


def test_a_batch_waits_to_fill_at_most_max_wait():
    s = scheduler(max_wait_s=2 * MS, max_batch=4)
    plan = s.plan(0.0005, [rank(1, 1.0, submitted=0.0)], [PreinferItem(9, 4096, 0, 0.0)])
    assert plan.empty
    assert plan.wait_s == pytest.approx(1.5 * MS)
    assert s.plan(0.0021, [rank(1, 1.0, submitted=0.0)], []).rank == (1,)
    full = [rank(i, 1.0, submitted=0.0) for i in range(4)]
    assert s.plan(0.0, full, []).rank == (0, 1, 2, 3)  # full: no wait


def test_a_call_that_would_run_alone_anyway_does_not_wait_for_a_batch():
    s = scheduler(max_wait_s=2 * MS, max_batch=4)
    # 1000 tokens: 3 ms, 2 ms beyond the 1 ms per-batch cost; a second such call would delay the
    # first by more than the batch saves, so it would not join: waiting only idles the device.
    plan = s.plan(0.0005, [rank(1, 1.0, tokens=1000, submitted=0.0)], [])
    assert plan.rank == (1,)
    assert plan.wait_s == 0.0
    # 400 tokens: 1.8 ms, 0.8 beyond: a second one would join, so the batch waits to fill.
    assert s.plan(0.0005, [rank(1, 1.0, tokens=400, submitted=0.0)], []).wait_s == pytest.approx(1.5 * MS)


def test_a_joined_preinference_runs_by_its_callers_deadline():
    s = scheduler()
    joined = PreinferItem(9, 4096, 2048, 0.0, joined_deadline=0.100)
    other = PreinferItem(8, 4096, 1024, 0.0)
    plan = s.plan(0.0, [rank(1, 0.200)], [other, joined])
    assert not plan.rank
    assert [c.id for c in plan.chunks] == [9]  # only the joined one: the ranking call is next
    assert plan.chunks[0].start == 2048
    assert s.plan(0.0, [rank(1, 0.050)], [other, joined]).rank == (1,)


def test_started_preinferences_are_finished_before_new_ones_and_batched_within_the_budget():
    s = scheduler(max_rank_delay_s=50 * MS, preinfer_max_batch=3)
    items = [PreinferItem(1, 1024, 0, 0.0), PreinferItem(2, 1024, 256, 1.0), PreinferItem(3, 1024, 0, 2.0)]
    plan = s.plan(0.0, [], items)
    assert [c.id for c in plan.chunks] == [2, 1, 3]
    assert plan.predicted_s <= s.step_budget_s()
    # The step is one batch: its chunks share one per-step cost. 4 ms: the rest of 2 (768
    # tokens, 2.9 ms) leaves room for 256 tokens of 1 (3.5 ms in all), not 512 (4.1 ms).
    tight = scheduler(max_rank_delay_s=3 * MS, preinfer_max_batch=3).plan(0.0, [], items)
    assert [(c.id, c.start, c.end) for c in tight.chunks] == [(2, 256, 1024), (1, 0, 256)]
    assert tight.predicted_s <= 4 * MS
    tighter = scheduler(max_rank_delay_s=2 * MS, preinfer_max_batch=3).plan(0.0, [], items)
    assert [c.id for c in tighter.chunks] == [2]  # the next one would pass the budget


def test_preinferences_are_built_in_the_order_their_calls_are_due():
    s = scheduler(max_rank_delay_s=500 * MS, preinfer_max_batch=5)
    items = [
        PreinferItem(1, 1024, 0, 0.0, need_by=0.300),
        PreinferItem(2, 1024, 0, 1.0, need_by=0.050),  # signalled later, needed sooner
        PreinferItem(3, 1024, 0, 2.0),  # no known need: after those with one
        PreinferItem(4, 1024, 256, 3.0),  # ... but started ones first among those
    ]
    assert [c.id for c in s.plan(0.0, [], items).chunks] == [2, 1, 4, 3]
    # Ranking calls still go first, and a pre-inference a call waits for goes before the rest.
    assert s.plan(0.0, [rank(7, 0.500)], items).rank == (7,)
    joined = PreinferItem(5, 1024, 0, 4.0, joined_deadline=0.200, need_by=0.400)
    assert [c.id for c in s.plan(0.0, [], [*items, joined]).chunks] == [5]


def test_taken_over_and_finished_preinferences_get_no_chunks():
    s = scheduler()
    plan = s.plan(0.0, [], [PreinferItem(1, 4096, 1024, 0.0, taken=True), PreinferItem(2, 512, 512, 0.0)])
    assert plan.empty
    assert plan.wait_s == 0.0


def test_relay_decisions():
    s = scheduler()
    now, far = 0.0, 10.0
    assert s.relay(PreinferItem(1, 4096, 0, 0.0), now, far) is Relay.TAKE_OVER  # not started, long
    assert s.remaining_seconds(0, 256) <= s.step_budget_s()
    assert s.relay(PreinferItem(1, 256, 0, 0.0), now, far) is Relay.JOIN  # not started, one step
    assert (
        s.relay(PreinferItem(1, 256, 0, 0.0), now, now + s.remaining_seconds(0, 256) / 2) is Relay.TAKE_OVER
    )
    assert s.relay(PreinferItem(1, 4096, 3840, 0.0), now, far) is Relay.JOIN  # one short chunk left
    assert s.relay(PreinferItem(1, 16384, 1024, 0.0), now, far) is Relay.TAKE_OVER  # much left
    rest = s.remaining_seconds(3840, 4096)
    assert s.relay(PreinferItem(1, 4096, 3840, 0.0), now, now + rest / 2) is Relay.TAKE_OVER  # past deadline
    assert s.relay(PreinferItem(1, 16384, 1024, 0.0, taken=True), now, far) is Relay.JOIN


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        SchedulerConfig(chunk_tokens=1000)
    with pytest.raises(ValueError, match="max_rank_delay_s"):
        SchedulerConfig(max_rank_delay_s=0.0)


def test_a_call_joins_a_batch_only_while_batching_it_saves_more_than_it_costs():
    # 1 ms a batch, 2 us a token: 20-token calls add 0.04 ms each and eight fill a batch; calls
    # of 100 tokens add 0.2 ms, and a sixth would cost the five before it more than it saves.
    s = scheduler(max_batch=8)
    assert s.plan(0.0, [rank(i, 1.0 + i, tokens=20) for i in range(8)], []).rank == tuple(range(8))
    assert s.plan(0.0, [rank(i, 1.0 + i, tokens=100) for i in range(8)], []).rank == tuple(range(6))
    # CPU-like: 1.3 ms a batch, 9 us a token, 0.1 ns a pair (fitted on the 2-core build VM).
    # A 300-token recompute adds ~11.7 ms: batched, every call before it would wait for it.
    cpu = IterationScheduler(SchedulerConfig(max_wait_s=0.0, max_batch=8), fitted(1.3 * MS, 9e-6, 1e-10))
    full = [RankItem(i, RankKind.FULL, 1.0 + i, 0.0, 300, 250 * 300) for i in range(4)]
    assert cpu.plan(0.0, full, []).rank == (0,)
    # Calls against psi of a few tokens cost less than the batch they share: a few join.
    cached = [RankItem(i, RankKind.CACHED, 1.0 + i, 0.0, 48) for i in range(8)]
    assert cpu.plan(0.0, cached, []).rank == (0, 1, 2, 3)  # the 4th: 3 x 0.43 ms <= 1.3 ms


def test_first_chunks_that_a_graph_holds_are_costed_by_the_graph_steps_fit():
    # An H100's shape: an eager step pays ~4.5 ms of host time whatever its size, plus its
    # attention; a graph step from the prefix's first token costs its device work.
    eager = fitted(4.5 * MS, 0.1e-6, 0.3e-9)
    graph = fitted(0.2 * MS, 0.8e-6, 0.0)
    config = SchedulerConfig(max_wait_s=0.0, chunk_tokens=8192, max_rank_delay_s=1 * MS)
    plain = IterationScheduler(config, eager)
    both = IterationScheduler(config, eager, first_costs=graph, graph_tokens=8192)
    assert both.chunk_seconds(0, 4096) == pytest.approx(0.2 * MS + 4096 * 0.8e-6, rel=0.01)
    assert both.chunk_seconds(256, 4096) == pytest.approx(plain.chunk_seconds(256, 4096))  # reads psi: eager
    assert both.chunk_seconds(0, 8448) == pytest.approx(plain.chunk_seconds(0, 8448))  # past the graphs
    # A fresh 4096-token prefix: one graph step (3.5 ms) fits the step budget (4.5 + 1 ms); by
    # the eager fit alone (10 ms) it would be built in smaller eager steps.
    item = PreinferItem(1, 4096, 0, 0.0)
    [chunk] = both.plan(0.0, [], [item]).chunks
    assert (chunk.start, chunk.end) == (0, 4096)
    [eager_chunk] = plain.plan(0.0, [], [item]).chunks
    assert eager_chunk.end < 4096
    # ... and a call whose pre-inference has not started joins it rather than taking it over.
    assert both.relay(item, 0.0, 1.0) is Relay.JOIN
    assert plain.relay(item, 0.0, 1.0) is Relay.TAKE_OVER
    # Started pre-inferences are costed by the eager fit.
    assert both.remaining_seconds(256, 4096) == pytest.approx(plain.remaining_seconds(256, 4096))


def test_a_first_chunk_that_a_graph_holds_may_pass_the_eager_chunk_cap():
    # chunk_tokens 4096 (the default) with graphs to 17408 tokens: an 8192-token prefix whose
    # one graph step (6.8 ms) fits the budget (4.5 + 5 ms) is built in one step, not a graph
    # step and an eager one; an eager fit alone keeps the cap, and later chunks keep it too.
    eager = fitted(4.5 * MS, 0.1e-6, 0.3e-9)
    graph = fitted(0.2 * MS, 0.8e-6, 0.0)
    config = SchedulerConfig(
        max_wait_s=0.0, chunk_tokens=4096, max_rank_delay_s=5 * MS, first_chunk_absorbs=True
    )
    both = IterationScheduler(config, eager, first_costs=graph, graph_tokens=17408)
    plain = IterationScheduler(config, eager)
    assert both.chunk_cap(0) == 17408
    assert both.chunk_cap(256) == 4096
    assert plain.chunk_cap(0) == 4096
    [chunk] = both.plan(0.0, [], [PreinferItem(1, 8192, 0, 0.0)]).chunks
    assert (chunk.start, chunk.end) == (0, 8192)
    assert both.remaining_seconds(0, 8192) == pytest.approx(both.chunk_seconds(0, 8192))
    # The budget still bounds it, give or take one eager step's fixed cost (chunk_size): a
    # 16384-token prefix as one step (13.3 ms) passes the budget (9.5) by less than an eager
    # step's fixed cost (4.5) and saves one: one step. 24576 tokens (19.9 ms) is split, its
    # first chunk within the budget plus that fixed cost.
    [whole] = both.plan(0.0, [], [PreinferItem(2, 16384, 0, 0.0)]).chunks
    assert (whole.start, whole.end) == (0, 16384)
    [first] = both.plan(0.0, [], [PreinferItem(4, 24576, 0, 0.0)]).chunks
    assert first.start == 0
    assert 4096 < first.end < 24576
    assert both.chunk_seconds(0, first.end) <= both.step_budget_s() + 4.5 * MS
    # Built by the eager fit alone, no chunk passes the cap.
    [eager_chunk] = plain.plan(0.0, [], [PreinferItem(3, 8192, 0, 0.0)]).chunks
    assert eager_chunk.end <= 4096


def test_full_rankings_are_batched_only_into_shapes_a_captured_graph_holds():
    # 20-token full rankings: eight would batch by cost alone (1 ms a batch, 2 us a token).
    calls = [rank(i, 0.100 + i * MS, RankKind.FULL, tokens=20) for i in range(1, 9)]
    no_graphs = scheduler(max_batch=8)
    assert no_graphs.plan(0.0, calls, []).rank == tuple(range(1, 9))

    def held(upto: int):
        return lambda tokens: len(tokens) <= upto  # captured graphs: up to `upto` calls

    alone = scheduler(max_batch=8)
    alone.full_replays = held(1)
    assert alone.plan(0.0, calls, []).rank == (1,)  # each replays its graph, none runs eagerly
    # ... and it does not wait to fill a batch it would not form.
    waiting = scheduler(max_batch=8, max_wait_s=5 * MS)
    waiting.full_replays = held(1)
    assert waiting.plan(0.0, calls[:1], []).rank == (1,)
    pairs = scheduler(max_batch=8)
    pairs.full_replays = held(2)
    assert pairs.plan(0.0, calls, []).rank == (1, 2)
    # A lead that no graph holds runs eagerly anyway: batched by cost as before.
    eager = scheduler(max_batch=8)
    eager.full_replays = lambda tokens: False
    assert eager.plan(0.0, calls, []).rank == tuple(range(1, 9))
    # Calls against psi are batched by cost whatever the full rankings' graphs.
    hits = [rank(i, 0.100 + i * MS, RankKind.CACHED, tokens=20) for i in range(1, 9)]
    assert alone.plan(0.0, hits, []).rank == tuple(range(1, 9))


def test_where_chunks_that_read_psi_replay_graphs_every_chunk_is_costed_and_capped_as_one():
    # RankGraphs.chunks_reading_psi: a started prefix's rest replays a graph too, so it is
    # costed by the graph steps' fit and capped by the graphs' tokens, not the eager chunk cap.
    eager = fitted(3.782 * MS, 0.0, 0.0247e-9)
    graph = fitted(0.553 * MS, 0.3616e-6, 0.0252e-9)
    config = SchedulerConfig(max_wait_s=0.0, chunk_tokens=4096, max_rank_delay_s=5 * MS)
    s = IterationScheduler(config, eager, first_costs=graph, graph_tokens=17408, graph_batch=2)
    before = s.chunk_seconds(6144, 2048)
    assert before == pytest.approx(eager.coefficients.seconds(2048, 2048 * (6144 + 2048)))
    assert s.chunk_cap(6144) == 4096
    rest = [PreinferItem(20, 16384, 6144, 0.0, need_by=1.0)]
    assert not s.step_graphed(s.plan(0.0, [], rest).chunks)
    s.graph_reads_psi = True
    assert s.chunk_seconds(6144, 2048) == pytest.approx(
        graph.coefficients.seconds(2048, 2048 * (6144 + 2048))
    )
    assert s.chunk_seconds(6144, 2048) < before
    assert s.chunk_cap(6144) == 17408
    plan = s.plan(0.0, [], rest)
    assert s.step_graphed(plan.chunks)
    assert plan.chunks[0].end - plan.chunks[0].start > 4096  # past the eager cap, within the budget
    assert plan.predicted_s <= s.step_budget_s() + eager.coefficients.per_batch_s
    # More rests than the graphs hold sequences: an eager step.
    three = [PreinferItem(30 + i, 8192, 4096, 0.0, need_by=1.0 + i) for i in range(3)]
    assert not s.step_graphed([Chunk(i.id, i.done, i.done + 512) for i in three])


def test_a_graph_step_takes_other_prefixes_only_whole_and_an_eager_step_no_first_chunk():
    # The H200's fits (k8b): an eager step 3.8 ms whatever its size plus its attention, a graph
    # step 0.55 ms + 0.36 us a token + its attention; graphs hold two prefixes, 17408 tokens.
    eager = fitted(3.782 * MS, 0.0, 0.0247e-9)
    graph = fitted(0.553 * MS, 0.3616e-6, 0.0252e-9)
    config = SchedulerConfig(max_wait_s=0.0, chunk_tokens=4096, max_rank_delay_s=5 * MS, preinfer_max_batch=4)
    s = IterationScheduler(config, eager, first_costs=graph, graph_tokens=17408, graph_batch=2)
    fresh = [PreinferItem(i, 8192, 0, 0.0, need_by=1.0 + i) for i in range(4)]
    plan = s.plan(0.0, [], fresh)
    # One 8192-token prefix per step (5.2 ms; two would be 10.5 ms, past the 8.8 ms budget):
    # no second prefix cut to the budget's leftover, whose rest would need an eager step.
    assert [(c.id, c.start, c.end) for c in plan.chunks] == [(0, 0, 8192)]
    assert plan.predicted_s == pytest.approx(s.chunk_seconds(0, 8192))
    assert s.step_graphed(plan.chunks)
    # Short prefixes share a graph step whole, up to the graphs' batch.
    short = [PreinferItem(10 + i, 2048, 0, 0.0, need_by=1.0 + i) for i in range(4)]
    plan = s.plan(0.0, [], short)
    assert [(c.start, c.end) for c in plan.chunks] == [(0, 2048), (0, 2048)]
    assert s.step_graphed(plan.chunks)
    assert plan.predicted_s <= s.step_budget_s()
    # An eager step (a started prefix's rest) takes other rests, not a fresh prefix's first chunk.
    started = [
        PreinferItem(20, 8192, 6144, 0.0, need_by=1.0),
        fresh[1],
        PreinferItem(21, 8192, 7168, 0.0, need_by=3.0),
    ]
    plan = s.plan(0.0, [], started)
    assert [(c.id, c.start, c.end) for c in plan.chunks] == [(20, 6144, 8192), (21, 7168, 8192)]
    assert not s.step_graphed(plan.chunks)
    assert plan.predicted_s <= s.step_budget_s()
    # Without graphs (the CPU), a fresh prefix's first chunk may join an eager step.
    plain = IterationScheduler(config, eager)
    assert [c.id for c in plain.plan(0.0, [], started).chunks][:2] == [20, 1]


def test_a_first_chunk_passes_the_budget_where_that_saves_a_step_of_mostly_fixed_cost():
    # The ranker's steps as measured at start-up on an H200 (k10b): eager 3.983 ms a step and
    # 0.06736 ns a pair, graph 0.53 ms + 0.373 us a token + 0.02702 ns a pair, to 17408 tokens.
    eager = fitted(3.983 * MS, 0.0, 0.06736e-9)
    graph = fitted(0.53 * MS, 0.373e-6, 0.02702e-9)
    config = SchedulerConfig(max_wait_s=0.0, first_chunk_absorbs=True)
    sched = IterationScheduler(config, eager, first_costs=graph, graph_tokens=17408)
    budget = sched.step_budget_s()  # 3.983 + 5 ms

    def steps(length: int) -> list[int]:
        done, out = 0, []
        while done < length:
            n = sched.chunk_size(done, length - done, budget)
            out.append(n)
            done += n
        return out

    # By the budget alone 16384 tokens were a graph step of 12032 (8.9 ms), an eager one of
    # 4096 and an eager one of 256 (4.3 ms, nearly all fixed cost): 21.6 ms. Now two steps,
    # the graph's the longer (the graph's tokens are cheaper than the eager step's pairs).
    assert sched._rest(0, 16384, budget) == (3, pytest.approx(21.63e-3, rel=0.01))
    assert steps(16384) == [13568, 2816]
    assert sched.remaining_seconds(0, 16384) < 17.7e-3
    assert sched.chunk_seconds(0, 13568) - budget < 3.983 * MS  # over the budget by 1.5 ms
    # 12288 tokens: one graph step instead of 12032 + an eager 256.
    assert steps(12288) == [12288]
    # What fits the budget is unchanged.
    assert steps(8192) == [8192]
    assert steps(4096) == [4096]
    # Off (the default): the budget's plan.
    off = IterationScheduler(SchedulerConfig(max_wait_s=0.0), eager, first_costs=graph, graph_tokens=17408)
    assert off.chunk_size(0, 16384, budget) == 12032
    # Never more device time than the budget's plan, and every later chunk keeps the budget.
    for length in range(256, 32768 + 1, 256):
        assert sched.remaining_seconds(0, length) <= sched._rest(0, length, budget)[1] + 1e-12
        plan = steps(length)
        assert sum(plan) == length
        done = plan[0]
        for n in plan[1:]:
            assert n <= 4096
            done += n
        assert sched.chunk_seconds(0, plan[0]) <= budget + 3.983 * MS


def test_with_the_budget_by_kind_a_graph_step_is_sized_by_its_own_fixed_cost():
    # k20b's shape at 16384 tokens on an H200: an eager step's fixed cost 5.6 ms as measured at
    # start-up, a graph replay's 0.8; every chunk a graph step (chunks that read psi too).
    eager = fitted(5.6 * MS, 0.0, 0.1e-9)
    graph = fitted(0.8 * MS, 0.29e-6, 0.052e-9)
    limits = {"first_costs": graph, "graph_tokens": 17408}
    by_eager = IterationScheduler(SchedulerConfig(max_wait_s=0.0, max_rank_delay_s=5 * MS), eager, **limits)
    by_kind = IterationScheduler(
        SchedulerConfig(max_wait_s=0.0, max_rank_delay_s=5 * MS, budget_by_kind=True), eager, **limits
    )
    for s in (by_eager, by_kind):
        s.graph_reads_psi = True
    assert by_eager.step_budget_s(0) == pytest.approx(10.6 * MS)  # the eager fixed cost, graph or not
    assert by_kind.step_budget_s(0) == pytest.approx(5.8 * MS)
    assert by_kind.step_budget_s(4096) == pytest.approx(5.8 * MS)  # reads psi, as a graph
    assert by_kind.step_budget_s() == pytest.approx(10.6 * MS)  # no chunk named: an eager step's

    def plan(s: IterationScheduler) -> list[float]:
        done, steps = 0, []
        while done < 16384:
            [chunk] = s.plan(0.0, [], [PreinferItem(1, 16384, done, 0.0)]).chunks
            steps.append(s.chunk_seconds(chunk.start, chunk.end - chunk.start))
            done = chunk.end
        return steps

    long_steps, short_steps = plan(by_eager), plan(by_kind)
    assert max(long_steps) > 7 * MS  # steps a graph replay never needs to pay for
    assert max(short_steps) <= 5.8 * MS + 1e-9  # each within its own fixed cost + 5 ms
    assert len(short_steps) > len(long_steps)  # more steps, each ~0.8 ms of fixed cost
    assert by_kind.remaining_seconds(0, 16384) == pytest.approx(sum(short_steps))
    # Without graphs for chunks that read psi, only a prefix's first chunk is a graph step.
    by_kind.graph_reads_psi = False
    assert by_kind.step_budget_s(4096) == pytest.approx(10.6 * MS)
