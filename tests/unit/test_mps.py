"""relaygr.mps against a stand-in for nvidia-cuda-mps-control on PATH (the build machine has no
GPU): the daemon is started with the stack's own directories, its clients get them, it is told
to quit once, and a missing or failing control program is a clear error. The launcher refuses
MPS off CUDA."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from relaygr.launcher import StackConfig
from relaygr.mps import MpsDaemon, MpsUnavailable

FAKE = """#!/bin/sh
# Records each invocation: its arguments, the MPS directories it was given, and its input.
{
  echo "args=$*"
  echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"
  echo "log=$CUDA_MPS_LOG_DIRECTORY"
  echo "visible=${CUDA_VISIBLE_DEVICES-unset}"
  if [ "$1" != "-d" ]; then echo "input=$(cat)"; fi
} >> "$FAKE_MPS_RECORD"
exit "${FAKE_MPS_EXIT:-0}"
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return record


def test_the_daemon_runs_with_the_stack_s_own_directories_and_quits_once(tmp_path: Path, fake_control: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    daemon = MpsDaemon(str(run_dir))
    daemon.start()
    assert daemon.env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(run_dir / "mps-pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(run_dir / "mps-log"),
    }
    assert (run_dir / "mps-pipe").is_dir()
    assert (run_dir / "mps-log").is_dir()
    daemon.stop()
    daemon.stop()  # once only
    lines = fake_control.read_text().splitlines()
    assert lines == [
        "args=-d", f"pipe={run_dir / 'mps-pipe'}", f"log={run_dir / 'mps-log'}", "visible=unset",
        "args=", f"pipe={run_dir / 'mps-pipe'}", f"log={run_dir / 'mps-log'}", "visible=unset", "input=quit",
    ]  # fmt: skip
    assert daemon.server_running() is False  # no GPU here: nothing started a server


def test_a_stack_on_one_gpu_of_several_gives_the_daemon_its_devices_and_renumbers_the_clients(
    tmp_path: Path, fake_control: Path, monkeypatch: pytest.MonkeyPatch
):
    # One stack per GPU (bench/device/goodput_pair.sh): the daemon sees GPU 1 as its device 0;
    # a client that kept CUDA_VISIBLE_DEVICES=1 would find no device behind the server.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    daemon = MpsDaemon(str(tmp_path))
    daemon.start()
    assert "visible=1" in fake_control.read_text().splitlines()
    client = daemon.client_env({**os.environ, "RELAYGR_X": "kept"})
    assert client["CUDA_VISIBLE_DEVICES"] == "0"
    assert daemon.client_env({"CUDA_VISIBLE_DEVICES": "2,3"})["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "CUDA_VISIBLE_DEVICES" not in daemon.client_env({})  # every GPU: nothing to renumber
    assert client["RELAYGR_X"] == "kept"
    assert client["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps-pipe")
    assert client["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps-log")
    daemon.stop()


def test_a_control_program_that_fails_or_is_missing_is_a_clear_error(
    tmp_path: Path, fake_control: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("FAKE_MPS_EXIT", "3")
    with pytest.raises(MpsUnavailable, match="-d failed: exit status 3"):
        MpsDaemon(str(tmp_path)).start()
    with pytest.raises(MpsUnavailable, match="not on PATH"):
        MpsDaemon(str(tmp_path), control="no-such-mps-control").start()
    MpsDaemon(str(tmp_path)).stop()  # never started: nothing to tell


def test_the_launcher_refuses_mps_off_cuda():
    with pytest.raises(ValueError, match="mps is for rankers on CUDA"):
        StackConfig(mps=True).validate()
    StackConfig(mps=True, device="cuda", rankers=2, rankers_per_device=2).validate()
