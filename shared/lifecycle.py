"""Process lifecycle helpers shared by every service's entry point."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """When started by the launcher (RELAYGR_DIE_WITH_PARENT=<its pid>), ask the kernel for SIGTERM
    when the launcher dies, so a killed launcher leaves no orphan services behind. Linux only;
    elsewhere, and when the variable is unset, this does nothing."""
    parent = os.environ.get("RELAYGR_DIE_WITH_PARENT")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
