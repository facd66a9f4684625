"""shared.lifecycle.set_timer_slack: the ranker's threads wake from timed waits on time."""

from __future__ import annotations

import sys
import threading

import pytest

from shared.lifecycle import set_timer_slack, timer_slack_ns

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl timer slack is Linux's")


@linux
def test_a_thread_started_after_the_setting_inherits_it_and_zero_restores_the_default():
    # In a thread of its own: its default is what its creator had (an in-process ranker may have
    # set the test process's main thread already), and nothing here outlives it.
    seen: dict[str, int | None] = {}

    def check() -> None:
        seen["default"] = timer_slack_ns()
        seen["set"] = int(set_timer_slack(1000))
        seen["now"] = timer_slack_ns()
        child = threading.Thread(target=lambda: seen.__setitem__("child", timer_slack_ns()))
        child.start()
        child.join()
        seen["reset"] = int(set_timer_slack(0))
        seen["after"] = timer_slack_ns()

    thread = threading.Thread(target=check)
    thread.start()
    thread.join()
    assert seen["default"] is not None
    assert seen["set"] == 1
    assert seen["now"] == 1000
    assert seen["child"] == 1000
    assert seen["reset"] == 1
    assert seen["after"] == seen["default"]


def test_a_negative_slack_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        set_timer_slack(-1)
