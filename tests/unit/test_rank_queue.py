"""The ranking-call queue the scheduler plans from (services/ranker/rank_queue.py): deadline
order, doomed calls apart and found once, overdue calls by heap, and a step's planning bounded
whatever the backlog."""

from __future__ import annotations

import pytest

from services.ranker.call_cost import CostFit, CostPrior
from services.ranker.rank_queue import RankQueue
from services.ranker.scheduler import IterationScheduler, RankItem, RankKind, SchedulerConfig

MS = 1e-3


def call(i: int, deadline: float, *, submitted: float = 0.0, start_by: float = float("inf"),
         due_by: float = float("inf"), tokens: int = 320) -> RankItem:  # fmt: skip
    return RankItem(i, RankKind.CACHED, deadline, submitted, tokens, start_by=start_by, due_by=due_by)


def never(_item: RankItem) -> bool:
    return False


def test_calls_come_out_earliest_deadline_first_ties_in_the_order_they_came():
    q = RankQueue([call(1, 0.3), call(2, 0.1), call(3, 0.2)])
    q.add(call(4, 0.2))  # ties with 3 (same deadline and arrival): after it
    q.add(call(5, 0.0))
    window = q.window(10, never)
    assert [c.id for c in window.calls] == [5, 2, 3, 4, 1]
    assert not window.doomed
    assert not window.more
    short = q.window(2, never)
    assert [c.id for c in short.calls] == [5, 2]
    assert short.more
    assert len(q) == 5
    assert 3 in q
    assert 9 not in q


def test_removed_calls_leave_every_order():
    q = RankQueue([call(i, i / 10) for i in range(5)])
    assert q.remove(2).id == 2
    assert q.remove(2) is None
    assert [c.id for c in q.window(10, never).calls] == [0, 1, 3, 4]
    assert sorted(c.id for c in q) == [0, 1, 3, 4]
    q.clear()
    assert len(q) == 0
    assert q.window(10, never).calls == []


def test_a_call_is_queued_once():
    q = RankQueue([call(1, 0.1)])
    with pytest.raises(ValueError, match="queued already"):
        q.add(call(1, 0.2))


def test_doomed_calls_wait_apart_found_once_and_come_out_when_nothing_is_live():
    q = RankQueue([call(i, i / 10) for i in range(6)])
    checked: list[int] = []

    def hopeless_below_3(item: RankItem) -> bool:
        checked.append(item.id)
        return item.id < 3

    window = q.window(2, hopeless_below_3)
    assert [c.id for c in window.calls] == [3, 4]
    assert window.more
    assert not window.doomed
    assert checked == [0, 1, 2, 3, 4]
    checked.clear()
    assert [c.id for c in q.window(2, hopeless_below_3).calls] == [3, 4]
    assert checked == [3, 4]  # the doomed ones are not costed again
    for i in (3, 4, 5):
        q.remove(i)
    doomed = q.window(2, hopeless_below_3)
    assert [c.id for c in doomed.calls] == [0, 1]
    assert doomed.doomed
    assert doomed.more
    assert q.remove(1).id == 1  # from the doomed order too
    assert [c.id for c in q.window(5, hopeless_below_3).calls] == [0, 2]


def test_calls_past_their_start_by_are_taken_out_and_only_they():
    q = RankQueue([call(1, 0.1, start_by=1.0), call(2, 0.2, start_by=3.0), call(3, 0.3)])
    q.add(call(4, 0.4, start_by=2.0))
    q.remove(4)  # served before its start_by: no longer anyone's business
    assert q.overdue(0.5) == []
    assert [c.id for c in q.overdue(2.5)] == [1]
    assert [c.id for c in q.overdue(1e9)] == [2]
    assert [c.id for c in q.window(10, never).calls] == [3]


class CountingScheduler(IterationScheduler):
    """Counts the calls costed for doom: the per-step work planning does on the queue."""

    costed = 0

    def doomed(self, now, item):  # type: ignore[no-untyped-def]
        self.costed += 1
        return super().doomed(now, item)


def test_a_steps_planning_does_not_grow_with_the_backlog():
    # 2000 queued calls, the oldest 1900 past saving: the first step finds them doomed once;
    # later steps cost only the window of live calls at the front, and serve them first.
    s = CountingScheduler(SchedulerConfig(max_batch=8), CostFit(CostPrior()))
    q = RankQueue(
        [call(i, 0.050 + i * MS, submitted=i * MS, due_by=0.001 if i < 1900 else 10.0) for i in range(2000)]
    )
    first = s.plan(0.010, q, [])
    assert first.rank[0] == 1900
    assert s.costed <= 1900 + s.window_size
    for _step in range(20):
        s.costed = 0
        plan = s.plan(0.010, q, [])
        for i in plan.rank:
            q.remove(i)
        assert s.costed <= s.window_size
        assert min(plan.rank) >= 1900  # live calls first
    # Live calls gone: the doomed ones run, earliest deadline first.
    for i in [c.id for c in q if c.id >= 1900]:
        q.remove(i)
    assert s.plan(0.010, q, []).rank[0] == 0


def test_a_backlog_past_the_window_is_served_earliest_deadline_first():
    # Behind a full queue, hits that would pass a full ranking with slack do not: the slack
    # cannot be judged from the window, and with this many calls queued there is none.
    s = IterationScheduler(SchedulerConfig(max_batch=8), CostFit(CostPrior()))
    fulls = [RankItem(i, RankKind.FULL, 1.0 + i, 0.0, 4096, 4096 * 4096) for i in range(s.window_size + 1)]
    hit = call(999, 2.0 + s.window_size)
    assert s.plan(0.0, [*fulls, hit], []).rank[0] == 0
    assert s.plan(0.0, [fulls[0], hit], []).rank == (999,)  # a short queue: the hit goes first


def test_doomed_calls_are_judged_again_when_the_step_costs_change():
    q = RankQueue([call(i, i / 10) for i in range(4)])
    assert q.window(4, lambda item: True).doomed  # a dear fit: all doomed
    assert q.window(4, never).doomed  # the same costs: they stay doomed, not re-costed
    revived = q.window(4, lambda item: item.id >= 2, recheck=True)  # cheaper: 0 and 1 make it now
    assert [c.id for c in revived.calls] == [0, 1]
    assert not revived.doomed


def test_the_scheduler_judges_doomed_calls_again_once_its_fit_learns_they_can_make_it():
    fit = CostFit(CostPrior(per_batch_s=0.1))  # 100 ms a batch: every call due in 50 ms is doomed
    s = IterationScheduler(SchedulerConfig(max_batch=8), fit)
    q = RankQueue([call(i, 0.030 + i * MS, due_by=0.050) for i in range(3)])
    assert s.plan(0.002, q, []).rank == (0, 1, 2)  # all doomed, served anyway (nothing else)
    q = RankQueue([call(i, 0.030 + i * MS, due_by=0.050) for i in range(3)])
    s.plan(0.002, q, [])
    q.add(call(9, 0.5, due_by=10.0))  # a live call: the doomed ones wait behind it
    assert s.plan(0.002, q, []).rank == (9,)
    for _ in range(64):  # the fit measures 1 ms batches
        fit.observe(320, 0, 0.001)
    assert s.plan(0.002, q, []).rank[0] == 0  # judged again: live, and earliest
