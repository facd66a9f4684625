"""Process-level helpers every service uses at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from services.ranker.config import RankerConfig
from shared.config import ConfigError, load_config


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pin_process_moves_threads_started_before_and_after():
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading
        from shared.lifecycle import pin_process
        started = threading.Event(); stop = threading.Event(); ids = []
        def worker():
            ids.append(threading.get_native_id()); started.set(); stop.wait()
        before = threading.Thread(target=worker); before.start(); started.wait()
        pin_process({{{cpu}}})
        started.clear()
        after = threading.Thread(target=worker); after.start(); started.wait()
        masks = [os.sched_getaffinity(tid) for tid in [0, *ids]]
        stop.set(); before.join(); after.join()
        print(masks)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr([{cpu}] * 3)


def test_ranker_refuses_cpus_it_cannot_use():
    usable = os.sched_getaffinity(0)
    cpu, missing = min(usable), max(usable) + 1
    with pytest.raises(ConfigError, match=f"CPUs \\[{missing}\\] are not available"):
        load_config(RankerConfig, ["--cpu-affinity", f"{cpu},{missing}"])
    assert load_config(RankerConfig, ["--cpu-affinity", str(cpu)]).cpu_affinity == (cpu,)
