"""The GPUs' utilisation over a point (relaygr/gpu_util.py), against a stand-in nvidia-smi: its
lines parsed per GPU, its loop stopped with SIGINT, nothing sampled where there is none."""

from __future__ import annotations

import os
import stat
import time

import pytest

from relaygr.gpu_util import GpuUtilization, parse_samples, physical_index


def test_samples_are_fractions_per_gpu_and_noise_is_skipped():
    text = "0, 50\n1, 100\n0, 70\n[N/A], 3\n1, [N/A]\nwarning: something\n0, 150\n\n1, 0\n"
    assert parse_samples(text) == {0: [0.5, 0.7], 1: [1.0, 0.0]}


@pytest.mark.parametrize(
    ("cuda_index", "visible", "want"),
    [(0, "", 0), (1, "", 1), (0, "2,3", 2), (1, "2, 3", 3), (0, "GPU-1234", 0), (5, "1", 5)],
)
def test_a_cuda_index_names_the_gpu_that_cuda_visible_devices_lists(cuda_index, visible, want):
    assert physical_index(cuda_index, visible) == want


def fake_nvidia_smi(tmp_path, lines: str) -> str:
    """A script that prints `lines` every 20 ms until SIGINT, and records its arguments."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "$@" > {tmp_path}/argv\n'
        "trap 'exit 0' INT\n"
        f"while true; do printf '{lines}'; sleep 0.02; done\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_the_sampler_averages_each_gpu_over_the_point(tmp_path):
    sampler = GpuUtilization(interval_ms=20, command=fake_nvidia_smi(tmp_path, "0, 40\\n1, 90\\n"))
    assert sampler.start()
    time.sleep(0.3)
    means = sampler.stop()
    assert means == {0: pytest.approx(0.4), 1: pytest.approx(0.9)}
    argv = (tmp_path / "argv").read_text().split()
    assert "--query-gpu=index,utilization.gpu" in argv
    assert "--loop-ms=20" in argv
    assert sampler.stop() == {}  # stopped once; a second stop has nothing


def test_without_nvidia_smi_nothing_is_sampled(tmp_path):
    sampler = GpuUtilization(command=os.path.join(tmp_path, "no-such-nvidia-smi"))
    assert sampler.start() is False
    assert sampler.stop() == {}


def test_a_sampling_interval_under_10_ms_is_refused():
    with pytest.raises(ValueError, match="interval_ms"):
        GpuUtilization(interval_ms=5)
