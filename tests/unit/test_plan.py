"""`relaygr plan`: GPUs from the capacity model. More GPUs for a higher target rate or a tighter
SLO, never fewer; a 1024-GPU plan in seconds; bad inputs give one-line errors."""

from __future__ import annotations

import gzip
import json
import time

import numpy as np
import pytest

from relaygr.cli import main
from relaygr.plan import plan, table
from relaygr.workload import read_length_histogram


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A measured run of the baseline at 4096 tokens: full rankings of 3.3-4.0 ms."""
    root = tmp_path_factory.mktemp("run")
    (root / "calls").mkdir()
    rng = np.random.default_rng(2)
    rows = [
        {"status": "OK", "served_by": "full_recompute", "prefix_len": 4096, "suffix_len": 320, "batch_seq": i,
         "compute_ms": float(rng.uniform(3.3, 4.0)), "queue_ms": 1.0, "cache_ms": 0.0, "latency_ms": 8.0}
        for i in range(400)
    ]  # fmt: skip
    return baseline_run(root / "goodput-x-p.json", "L4096", rows, met_rps=150.0, missed_rps=250.0)


def baseline_run(path, workload: str, rows: list[dict], met_rps: float, missed_rps: float):
    """A goodput result file at `path` of the baseline on `workload`, met at met_rps and missed at
    missed_rps, and the met point's per-call records `rows` beside it."""
    with gzip.open(
        path.parent / "calls" / f"{path.stem}-baseline-{workload}-p1-{met_rps:g}.jsonl.gz", "wt"
    ) as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    points = [{"rate_rps": met_rps, "meets_slo": True}, {"rate_rps": missed_rps, "meets_slo": False}]
    result = {"config": {"slo_ms": 50.0, "lead_in_s": 2.0},
              "results": [{"config": "baseline", "workload": workload, "points": points}]}  # fmt: skip
    path.write_text(json.dumps(result))
    return path


def test_more_traffic_or_a_tighter_slo_never_needs_fewer_gpus(source):
    (small,) = plan(source, ["baseline"], 1_000)
    (large,) = plan(source, ["baseline"], 10_000)
    (tight,) = plan(source, ["baseline"], 10_000, slo_ms=25.0)
    assert 1 <= small["gpus"] <= large["gpus"] <= tight["gpus"]
    assert large["gpus"] == pytest.approx(10_000 / large["per_gpu_goodput_rps"], abs=1)
    assert large["per_gpu_rps"] <= large["per_gpu_goodput_rps"]
    assert large["p99_ms"] <= 50.0  # the per-GPU point the plan runs at meets the SLO
    assert "| baseline | L4096 | 50 | 10000 |" in table([large])


def test_a_thousand_gpu_plan_for_a_hundred_million_users_takes_seconds(source):
    started = time.monotonic()
    (row,) = plan(source, ["baseline"], 200_000, users=100_000_000)
    assert row["gpus"] >= 1024 * 0.5
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target-rps", "0"], "--target-rps: must be a finite number > 0"),
        (["--target-rps", "100", "--configs", "relay-shed-2p-mps"], "the model covers"),
        (["--target-rps", "100", "--workload", "mix"], "--workload: one of ['L4096']"),
        (["--target-rps", "100", "--slo-ms", "-5"], "--slo-ms: must be a finite number > 0"),
        (["--target-rps", "100", "--configs", "relay"], "holds no records of relay (it holds baseline)"),
        (["--target-rps", "100", "--configs", " , "], "--configs: name at least one configuration"),
        (["--target-rps", "100", "--trigger-setting", "spare_min_saving"], "--trigger-setting"),
        (
            ["--target-rps", "100", "--session-mean-requests", "0.5"],
            "--session-mean-requests: must be a finite number >= 1",
        ),
        (
            ["--target-rps", "100", "--session-mean-requests", "inf"],
            "--session-mean-requests: must be a finite number >= 1",
        ),
        (["--target-rps", "100", "--think-scale", "0"], "--think-scale: must be a finite number > 0"),
    ],
)
def test_bad_inputs_get_one_line_errors(source, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--from", str(source), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err


def test_the_configurations_planned_by_default_are_the_modelled_ones_the_file_holds(source, tmp_path, capsys):
    assert main(["plan", "--from", str(source), "--target-rps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "| baseline |" in out
    # A trigger setting is the relay's alone: a plan of the baseline takes no notice of it.
    assert (
        main(
            [
                "plan",
                "--from",
                str(source),
                "--target-rps",
                "1000",
                "--trigger-setting",
                "spare_min_saving=0.2",
            ]
        )
        == 0
    )
    nothing = tmp_path / "other.json"
    nothing.write_text(
        json.dumps({"config": {"slo_ms": 50.0}, "results": [{"config": "relay-2p-mps", "points": []}]})
    )
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--from", str(nothing), "--target-rps", "1000"])
    assert exit_.value.code == 2
    assert "holds no configuration the model covers" in capsys.readouterr().err


def test_a_missing_file_is_one_line_too(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--from", str(tmp_path / "none.json"), "--target-rps", "100"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot read" in err


def test_the_command_prints_the_table_and_writes_the_plans(source, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--from",
                str(source),
                "--target-rps",
                "5000",
                "--configs",
                "baseline",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "| baseline |" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["plans"]
    assert row["gpus"] >= 1


def test_the_sensitivity_table_varies_one_input_at_a_time_and_the_plot_is_drawn(source, tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", "--from", str(source), "--target-rps", "5000", "--configs", "baseline", "--sensitivity",
            "--plot", str(png), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "| SLO | 0.8 | baseline |" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    inputs = {(r["input"], r["factor"]) for r in doc["sensitivity"]}
    assert ("SLO", 0.8) in inputs
    assert ("a full ranking's cost", 0.8) in inputs
    assert not any(r["input"] == "host DRAM per GPU" for r in doc["sensitivity"])  # the baseline keeps no psi
    tighter = next(r for r in doc["sensitivity"] if r["input"] == "SLO" and r["factor"] == 0.8)
    assert tighter["gpus"] >= doc["plans"][0]["gpus"]
    cheaper = next(r for r in doc["sensitivity"] if r["input"] == "a full ranking's cost")
    assert cheaper["gpus"] <= doc["plans"][0]["gpus"]
    slower = next(
        r
        for r in doc["sensitivity"]
        if r["input"] == "the host's launch and step time" and r["factor"] == 1.5
    )
    assert slower["gpus"] >= doc["plans"][0]["gpus"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpus_are_added_until_the_point_at_the_target_meets_the_slo(source, monkeypatch):
    """The one-GPU goodput is a bisected limit met on one draw of the workload; the plan's own
    point (its share of the target and of the users) can miss just below it. Here the modelled
    point misses above 90% of the goodput."""
    import relaygr.plan as planning

    real = planning.p99_at
    (reference,) = plan(source, ["baseline"], 10_000)
    limit = 0.9 * reference["per_gpu_goodput_rps"]

    def stricter(traffic, rate, cal, setup, seed=0):
        point = real(traffic, rate, cal, setup, seed)
        return point | {"meets_slo": point["meets_slo"] and rate <= limit}

    monkeypatch.setattr(planning, "p99_at", stricter)
    (row,) = plan(source, ["baseline"], 10_000)
    assert row["gpus_from_goodput"] == reference["gpus"]
    assert row["gpus"] > row["gpus_from_goodput"]
    assert row["per_gpu_rps"] <= limit
    assert f"| {row['gpus']} (goodput alone: {reference['gpus']}) |" in table([row])
    # A point that never meets the SLO is refused in one line, not planned.
    monkeypatch.setattr(planning, "p99_at", lambda *a, **k: real(*a, **k) | {"meets_slo": False})
    with pytest.raises(ValueError, match="misses the 50 ms SLO even on"):
        plan(source, ["baseline"], 10_000)


def test_a_plan_takes_another_session_model_than_its_runs(source):
    """--session-mean-requests / --think-scale: the users' sessions instead of the run's, the
    calls' costs as measured; each plan says which sessions it modelled."""
    (run,) = plan(source, ["baseline"], 1_000)
    assert (run["session_mean_requests"], run["think_scale"]) == (3.0, 0.1)  # the workload's defaults
    (once,) = plan(source, ["baseline"], 1_000, session={"session_mean_requests": 1.0, "think_scale": 0.5})
    assert (once["session_mean_requests"], once["think_scale"]) == (1.0, 0.5)
    assert once["served"] == {"full_recompute": 1.0}
    for bad, message in (({"session_mean_requests": 0.9}, "must be >= 1"), ({"think_scale": 0.0}, "must be > 0"),
                         ({"users": 5.0}, "session: only")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            plan(source, ["baseline"], 1_000, session=bad)


@pytest.fixture(scope="module")
def mix_source(tmp_path_factory):
    """A measured run of the baseline on the length mix: full rankings of 0.8 ms plus 0.5 us a
    token of its sequence, prefixes of 100-6000 tokens."""
    root = tmp_path_factory.mktemp("mix")
    (root / "calls").mkdir()
    rng = np.random.default_rng(3)
    rows = []
    for i in range(600):
        prefix = int(rng.integers(100, 6000))
        rows.append({"status": "OK", "served_by": "full_recompute", "prefix_len": prefix, "suffix_len": 320,
                     "batch_seq": i, "compute_ms": 0.8 + 0.0005 * (prefix + 320) * float(rng.uniform(0.95, 1.05)),
                     "queue_ms": 1.0, "cache_ms": 0.0, "latency_ms": 6.0})  # fmt: skip
    return baseline_run(root / "goodput-x-m.json", "mix", rows, met_rps=300.0, missed_rps=500.0)


def test_a_plan_takes_the_operators_length_histogram_on_a_mix_runs_costs(
    mix_source, source, tmp_path, capsys
):
    """--lengths FILE: users' prefixes drawn from the operator's bins, priced by the mix run's
    fit; longer prefixes never need fewer GPUs; a run of one length is refused (its costs fit
    that length only), and lengths past the run's are flagged as extrapolated."""
    short, long = tmp_path / "short.csv", tmp_path / "long.csv"
    short.write_text("upper_length,weight\n200,0\n512,1\n1024,1\n")  # 201-1024 tokens
    long.write_text("4096,1\n8192,3\n")
    (mixed,) = plan(mix_source, ["baseline"], 5_000)
    (few,) = plan(mix_source, ["baseline"], 5_000, lengths=read_length_histogram(short))
    (many,) = plan(mix_source, ["baseline"], 5_000, lengths=read_length_histogram(long))
    assert few["gpus"] <= mixed["gpus"] <= many["gpus"]
    assert few["per_gpu_goodput_rps"] > many["per_gpu_goodput_rps"]
    assert few["workload"] == "mix costs, --lengths"
    assert few["prefix_tokens"][2] <= 1024
    assert not few["extrapolated"]
    assert many["extrapolated"]  # up to 8192 tokens, the run measured under 6000
    assert "extrapolated" not in mixed
    with pytest.raises(ValueError, match="needs a source run of the length mix"):
        plan(source, ["baseline"], 5_000, lengths=read_length_histogram(short))
    assert main(["plan", "--from", str(mix_source), "--target-rps", "5000", "--lengths", str(long)]) == 0
    assert "are extrapolated by the fit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "plan",
                "--from",
                str(mix_source),
                "--target-rps",
                "5000",
                "--lengths",
                str(tmp_path / "none.csv"),
            ]
        )
    assert exit_.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
