"""The expander's arena size: configured, or a fraction of the memory available here."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.expander.config import MIN_HOST_HEADROOM_BYTES, PAGE, ExpanderConfig, mem_available_bytes
from shared.config import ConfigError, load_config

GIB = 1 << 30


def test_no_size_given_takes_the_fraction_of_what_is_available_page_aligned():
    config = ExpanderConfig()
    assert config.arena_bytes == 0
    assert config.sized_arena_bytes(128 * GIB) == 64 * GIB  # default fraction 0.5
    odd = 10 * GIB + 12345
    assert config.sized_arena_bytes(odd) == int(odd * 0.5) // PAGE * PAGE
    # The headroom holds on a small host: 6 GiB available, 4 GiB kept, 2 GiB arena.
    assert config.sized_arena_bytes(6 * GIB) == 6 * GIB - MIN_HOST_HEADROOM_BYTES
    with pytest.raises(ConfigError, match="no arena"):
        config.sized_arena_bytes(3 * GIB)
    with pytest.raises(ConfigError, match="unreadable"):
        config.sized_arena_bytes(None)


def test_a_configured_size_wins_but_never_past_what_is_available():
    config = ExpanderConfig(arena_bytes=2 * GIB)
    assert config.sized_arena_bytes(128 * GIB) == 2 * GIB
    assert config.sized_arena_bytes(None) == 2 * GIB  # nothing to check against
    with pytest.raises(ConfigError, match="more than the host has available"):
        config.sized_arena_bytes(GIB)


@pytest.mark.parametrize(("flag", "value"), [("--arena-fraction", "0"), ("--arena-fraction", "0.95"),
                                             ("--arena-bytes", "-4096"), ("--arena-bytes", "1000")])  # fmt: skip
def test_bad_sizes_are_refused_at_start_up(flag, value):
    with pytest.raises(ConfigError, match="arena"):
        load_config(ExpanderConfig, [flag, value])


def test_available_memory_is_capped_by_the_cgroup_limit(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemAvailable:   100000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    host = 100_000_000 * 1024
    assert mem_available_bytes(str(meminfo), str(cgroup)) == host  # no cgroup files: the host's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert mem_available_bytes(str(meminfo), str(cgroup)) == host
    (cgroup / "memory.max").write_text(f"{16 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{4 * GIB}\n")
    assert mem_available_bytes(str(meminfo), str(cgroup)) == 12 * GIB
    assert mem_available_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None
    assert mem_available_bytes(str(tmp_path / "none"), str(cgroup)) == 12 * GIB
    # This machine: something sensible.
    here = mem_available_bytes()
    assert here is None or here > 0
