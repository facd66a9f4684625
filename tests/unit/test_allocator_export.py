"""The ranker's export of its accelerator's caching allocator (RankerService._read_allocator): the
counters grow by what the allocator counted since the last reading, and a retry is logged."""

from __future__ import annotations

from services.ranker.config import RankerConfig
from services.ranker.service import RankerService
from shared.config import load_config
from tests.accelerators import Reporting


def reading(retries: int, mallocs: int, frees: int) -> dict[str, int]:
    return {"reserved_bytes": 3 << 30, "allocated_bytes": 2 << 30, "alloc_retries": retries,
            "device_allocs": mallocs, "device_frees": frees}  # fmt: skip


def sample(service: RankerService, name: str, labels: dict[str, str] | None = None) -> float | None:
    return service.registry.get_sample_value(name, labels or {})


def test_the_allocators_counters_are_exported_as_increments(monkeypatch, capsys):
    service = RankerService(load_config(RankerConfig, ["--device", "cpu"]))
    readings = iter([reading(1, 10, 2), reading(3, 14, 5), reading(3, 14, 5)])
    monkeypatch.setattr(service, "accel", Reporting(service.accel, readings=readings))
    first = service._read_allocator(reading(1, 8, 2))  # the reading at start: 2 mallocs since
    assert sample(service, "relaygr_ranker_device_mallocs_total") == 2
    assert sample(service, "relaygr_ranker_device_frees_total") == 0
    assert sample(service, "relaygr_ranker_allocator_retries_total") == 0
    assert "allocator_retried" not in capsys.readouterr().out
    second = service._read_allocator(first)
    assert sample(service, "relaygr_ranker_device_mallocs_total") == 6
    assert sample(service, "relaygr_ranker_device_frees_total") == 3
    assert sample(service, "relaygr_ranker_allocator_retries_total") == 2
    assert sample(service, "relaygr_ranker_device_memory_bytes", {"kind": "reserved"}) == 3 << 30
    assert "allocator_retried" in capsys.readouterr().out
    service._read_allocator(second)  # nothing new: nothing added
    assert sample(service, "relaygr_ranker_device_mallocs_total") == 6


def test_without_an_allocator_nothing_is_exported():
    service = RankerService(load_config(RankerConfig, ["--device", "cpu"]))
    assert service.accel.allocator_stats() == {}
    assert service._read_allocator({}) == {}
    assert sample(service, "relaygr_ranker_device_mallocs_total") == 0
