"""The copy watcher: a watched copy's caller is told once its event is done, from the watcher's
own thread and in the order watched; a failed wait is logged and the next copies are still
told; stop() ends the thread once what was watched before is told."""

from __future__ import annotations

import threading

from services.ranker.copy_watch import CopyWatcher


class HeldEvent:
    """A device event stand-in whose work is done once release() is called."""

    def __init__(self, fail: bool = False) -> None:
        self._done = threading.Event()
        self._fail = fail

    def release(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(10)
        if self._fail:
            raise RuntimeError("the device reported an error")


def test_callers_are_told_when_their_copies_are_done_in_order():
    watcher = CopyWatcher()
    watcher.start()
    told: list[tuple[str, str]] = []
    both = threading.Event()

    def tell(name: str) -> None:
        told.append((name, threading.current_thread().name))
        if len(told) == 2:
            both.set()

    first, second = HeldEvent(), HeldEvent()
    watcher.watch(first, lambda: tell("first"))
    watcher.watch(second, lambda: tell("second"))
    second.release()  # done first on the device, but watched after the first
    assert not both.wait(0.05)
    assert told == []
    first.release()
    assert both.wait(10)
    assert [name for name, _ in told] == ["first", "second"]
    assert {thread for _, thread in told} == {"relaygr-copies"}
    assert watcher.told == 2
    watcher.stop()


def test_a_failed_wait_tells_nobody_and_the_watcher_goes_on():
    watcher = CopyWatcher()
    watcher.start()
    told = threading.Event()
    bad, good = HeldEvent(fail=True), HeldEvent()
    watcher.watch(bad, lambda: (_ for _ in ()).throw(AssertionError("told after a failed wait")))
    watcher.watch(good, told.set)
    bad.release()
    good.release()
    assert told.wait(10)
    assert watcher.told == 1
    watcher.stop()


def test_stop_waits_for_the_copies_watched_before():
    watcher = CopyWatcher()
    watcher.start()
    told = threading.Event()
    event = HeldEvent()
    watcher.watch(event, told.set)
    stopping = threading.Thread(target=watcher.stop)
    stopping.start()
    assert not told.is_set()
    event.release()
    stopping.join(10)
    assert not stopping.is_alive()
    assert told.is_set()
    watcher.stop()  # twice: nothing to stop
