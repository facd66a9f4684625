"""The ranker's event pool (services/ranker/events.py) and the section timer drawing from it."""

from __future__ import annotations

import threading

import pytest

from services.ranker.device_time import SectionTimer
from services.ranker.events import EventPool


class FakeEvent:
    """Stands in for a CUDA timing event: records count, elapsed time from a shared clock."""

    clock = 0.0

    def __init__(self) -> None:
        self.records = 0
        self.at: float | None = None

    def record(self) -> None:
        FakeEvent.clock += 1.5
        self.records += 1
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None
        assert end.at is not None
        return end.at - self.at  # ms


def test_events_given_back_are_handed_out_before_new_ones():
    pool = EventPool(FakeEvent)
    first, second = pool.take(), pool.take()
    assert (pool.created, pool.reused) == (2, 0)
    pool.give(first)
    assert pool.take() is first
    assert (pool.created, pool.reused, pool.idle) == (2, 1, 0)
    assert pool.take() is not second  # still held: a new one
    assert pool.created == 3


def test_the_pool_keeps_at_most_its_limit_idle():
    pool = EventPool(FakeEvent, limit=2)
    events = [pool.take() for _ in range(5)]
    for e in events:
        pool.give(e)
    assert pool.idle == 2
    with pytest.raises(ValueError, match="limit"):
        EventPool(FakeEvent, limit=-1)


def test_no_event_is_handed_to_two_takers_at_once():
    pool = EventPool(FakeEvent, limit=1000)
    held: list[list[FakeEvent]] = [[] for _ in range(4)]

    def churn(mine: list[FakeEvent]) -> None:
        for i in range(2000):
            mine.append(pool.take())
            if i % 2:
                pool.give(mine.pop(0))

    threads = [threading.Thread(target=churn, args=(h,)) for h in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    in_hand = [id(e) for h in held for e in h]
    assert len(in_hand) == len(set(in_hand)) == 4 * 1000
    assert pool.created + pool.reused == 4 * 2000


def test_a_section_timer_with_a_pool_reuses_its_events_once_read():
    pool = EventPool(FakeEvent)
    timer = SectionTimer(cuda=True, pool=pool)
    with timer.section():
        pass
    with timer.section():
        pass
    assert timer.last_event is not None
    assert timer.done()
    assert timer.total_s() == pytest.approx(2 * 1.5e-3)
    assert pool.created == 4
    timer.release()
    assert pool.idle == 4
    again = SectionTimer(cuda=True, pool=pool)
    with again.section():
        pass
    assert (pool.created, pool.reused) == (4, 2)
    assert again.total_s() == pytest.approx(1.5e-3)  # recorded again: its new record counts


def test_a_section_timer_off_cuda_times_by_the_wall_clock_and_releases_nothing():
    pool = EventPool(FakeEvent)
    timer = SectionTimer(cuda=False, pool=pool)
    with timer.section():
        pass
    assert timer.last_event is None
    assert timer.total_s() >= 0.0
    timer.release()
    assert (pool.created, pool.idle) == (0, 0)


class CountingEvent(FakeEvent):
    def __init__(self, done: bool) -> None:
        super().__init__()
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def test_waiting_for_a_done_event_never_synchronizes():
    from services.ranker.events import wait_until_done

    done, running = CountingEvent(done=True), CountingEvent(done=False)
    wait_until_done(done)
    wait_until_done(running)
    assert done.synchronized == 0  # a synchronize gives the interpreter up: only when needed
    assert running.synchronized == 1
    assert running.query()
