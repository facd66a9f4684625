"""`relaygr` refuses every bad value in one line, exit status 2, before it starts anything.

Each case runs the real CLI in a subprocess under an audit hook that kills the process (exit 99,
"SPAWNED" on stderr) the moment it tries to start a child process: the embedded broker is the
first thing `up` starts, the stack the first thing `demo` starts after its core comparison, whose
printout goes to stdout. A value checked too late therefore fails the test three ways: the exit
status, the stderr line, and stdout. `test_the_guard_catches_a_start` shows the hook does fire.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SPAWNED_EXIT = 99
GUARD = f"""
import os, sys
def guard(event, args):
    if event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"):
        os.write(2, f"SPAWNED {{event}} {{args[:2]!r}}\\n".encode())
        os._exit({SPAWNED_EXIT})
sys.addaudithook(guard)
from relaygr.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI under the spawn guard, with no RELAYGR_* setting but `env`'s."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RELAYGR_")}
    return subprocess.run(
        [sys.executable, "-c", GUARD, *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1, lines
    assert lines[0].startswith("relaygr: error: ")
    for word in words:
        assert word in lines[0]
    assert result.stdout == ""


UP_CASES = [
    (["--rankers", "0"], "--rankers"),
    (["--rankers", "two"], "--rankers"),
    (["--slo-ms", "-5"], "--slo-ms"),
    (["--slo-ms", "0"], "--slo-ms"),
    (["--slo-ms", "nan"], "--slo-ms"),
    (["--slo-ms", "inf"], "--slo-ms"),
    (["--hbm-budget-mb", "0"], "--hbm-budget-mb"),
    (["--preset", "bogus"], "bench"),  # the presets are listed
    (["--device", "tpu"], "cuda"),
    (["--device", "cuda", "--rankers", "4096"], "GPU"),  # more rankers than GPUs, anywhere
    (["--device", "cuda", "--rankers", "4096", "--rankers-per-gpu", "2"], "2048 GPU"),
    (["--rankers-per-gpu", "0"], "--rankers-per-gpu"),
    (["--rankers-per-gpu", "2"], "needs --device cuda"),
    (["--mps"], "mps is for rankers on CUDA devices"),
    (["--policy", "sometimes"], "--policy"),
    (["--placement", "random"], "--placement"),
    (["--placement", "round_robin", "--rankers", "1"], "round_robin"),
    (["--kafka", "nowhere"], "--kafka"),
    (["--kafka", "a:9092,b:99999"], "b:99999"),
    (["--no-such-flag"], "--no-such-flag"),
    (["stray"], "stray"),
]


@pytest.mark.parametrize(("args", "word"), UP_CASES, ids=[" ".join(a) for a, _ in UP_CASES])
def test_up_refuses_a_bad_flag_in_one_line_before_starting_anything(args, word):
    assert_refused(run_cli(["up", *args]), word)


ENV_CASES = [
    ({"RELAYGR_RANKER_LOG_LEVEL": "verbose"}, "RELAYGR_RANKER_LOG_LEVEL"),  # the rankers' only
    ({"RELAYGR_LOG_LEVEL": "debug"}, "no longer read"),  # an old name names its successor
    ({"RELAYGR_ROUTER_LOG_LEVEL": "loud"}, "RELAYGR_ROUTER_LOG_LEVEL"),  # the router's only
    ({"RELAYGR_EXPANDER_TTL_S": "-1"}, "ttl_s"),  # the expander's only
    ({"RELAYGR_MAX_LEASE_MS": "10"}, "RELAYGR_MAX_LEASE_MS"),  # a cross-field rule (lease 2000 > max)
    ({"RELAYGR_TLS_CA": "/nonexistent/ca.pem"}, "RELAYGR_TLS_CERT"),
    ({"RELAYGR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "SASL"),
    ({"RELAYGR_RANKER_MAX_BATCH": "many"}, "RELAYGR_RANKER_MAX_BATCH"),
]


@pytest.mark.parametrize(("env", "word"), ENV_CASES, ids=[next(iter(e)) for e, _ in ENV_CASES])
def test_up_refuses_a_bad_environment_setting_of_any_service(env, word):
    assert_refused(run_cli(["up"], env), word)


def test_up_refuses_a_temp_dir_too_long_for_the_expanders_socket(tmp_path):
    # The expander's socket lives in a run directory under TMPDIR; a unix socket path holds 107 bytes.
    long_dir = tmp_path / ("d" * 100)
    long_dir.mkdir()
    assert_refused(run_cli(["up"], {"TMPDIR": str(long_dir)}), "socket_path")


DEMO_CASES = [
    (["--slo-ms", "-5"], "--slo-ms"),
    (["--duration-s", "0"], "--duration-s"),
    (["--rate", "-1"], "--rate"),
    (["--rankers", "0"], "--rankers"),
    (["--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize(("args", "word"), DEMO_CASES, ids=[" ".join(a) for a, _ in DEMO_CASES])
def test_demo_refuses_a_bad_flag_before_its_core_comparison(args, word):
    assert_refused(run_cli(["demo", *args]), word)


def test_demo_refuses_a_bad_environment_setting_before_its_core_comparison():
    # Checked by the services' config classes after relaygr.demo is imported (torch: seconds).
    assert_refused(run_cli(["demo"], {"RELAYGR_RANKER_LOG_LEVEL": "verbose"}), "RELAYGR_RANKER_LOG_LEVEL")


def test_no_command_is_one_line_too():
    assert_refused(run_cli([]), "demo", "up")


def test_the_guard_catches_a_start():
    # Good values: `up` goes on to start the embedded broker, which the guard stops. Without
    # this, a guard that never fired would let every case above pass for the wrong reason.
    result = run_cli(["up", "--rankers", "1"])
    assert result.returncode == SPAWNED_EXIT, result.stderr[-2000:]
    assert "SPAWNED subprocess.Popen" in result.stderr


def subcommands() -> dict[str, object]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return dict(sub.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["demo", "up"])
def test_every_option_has_help_with_its_default(command):
    parser = subcommands()[command]
    for action in parser._actions:  # type: ignore[attr-defined]
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings} has no help"
        assert "default" in action.help, f"{command} {action.option_strings} does not show its default"


def test_up_help_lists_the_presets_and_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["up", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for word in ("tiny", "bench", "cpu", "cuda", "affinity", "round_robin", "sequence", "default: 50.0"):
        assert word in text


@pytest.mark.slow
def test_up_says_in_one_line_that_no_broker_answers():
    # Not a bad value but a new user's first mistake: the launcher retries for 30 s, then one
    # line (aiokafka's ~150 connection errors are silenced) and status 1, nothing started.
    result = run_cli(["up", "--kafka", "127.0.0.1:1", "--rankers", "1"])
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "relaygr: error: no Kafka broker answers at 127.0.0.1:1 (tried for 30 s)"
    ]
