"""`relaygr plan`: how many GPUs a target rate needs, per configuration, from the capacity model
(relaygr.sim) calibrated on one GPU's measured goodput run.

    relaygr plan --from bench/results/goodput-nvidia-h100-80gb-hbm3-ed2.json --target-rps 50000 \\
        --configs baseline,relay-nospare --users 100000000

Each ranker serves its own users (the router's affinity keeps a user's calls on one instance),
so the fleet is independent copies of one ranker: the model's goodput of one GPU under the SLO,
then GPUs = ceil(target / that), and the modelled point at target / GPUs per GPU (its P99, how
calls are served, its device busy share). Only what the model covers is planned (baseline,
rankings keeping psi, pre-inference of every request, and `relay`: the trigger's admission as the
source run set it), and only as well as the model matches its source file (`python -m
relaygr.sim` prints the comparison).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from relaygr.sim import (
    PSI_PATHS,
    Model,
    goodput,
    load_model,
    measured_limit,
    p99_at,
    search_start_rps,
    with_session,
)
from relaygr.workload import user_prefix_lengths

# GPUs are raised by this factor (at least one) while the point at the target misses, this often
# at most (about 1.5x) before the plan is refused.
_RAISE = 1.02
_MAX_RAISES = 20


def plan_one(model: Model, target_rps: float, users: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The plan for one configuration (module docstring). ValueError when no rate meets the SLO
    on one GPU."""
    if not target_rps > 0:
        raise ValueError("--target-rps must be > 0")
    met, missed = measured_limit(model.result, model.config, model.workload)
    start = search_start_rps(met, missed)
    per_gpu, _, points = goodput(model.traffic, model.cal, model.setup, start, seed=seed)
    if per_gpu <= 0:
        raise ValueError(f"{model.config}: no rate meets the {model.setup.slo_ms:g} ms SLO on one GPU")
    from_goodput = gpus = math.ceil(target_rps / per_gpu * (1 - 1e-9))
    # The point each GPU then runs at (its share of the target, with its share of the users) is
    # modelled again: a limit found by bisection met the SLO at its own rate, and another rate
    # just below it draws another workload, which can miss (relay-nospare from h2e: 228.4 req/s
    # a GPU met, 228.3 on 1095 GPUs missed, with 10^6 users as with 10^8). GPUs are added until
    # the modelled point meets the SLO.
    for _ in range(_MAX_RAISES + 1):
        traffic = model.traffic
        if users is not None:
            traffic = dataclasses.replace(traffic, users=max(1, math.ceil(users / gpus)))
        point = p99_at(traffic, target_rps / gpus, model.cal, model.setup, seed)
        if point["meets_slo"]:
            break
        gpus = max(gpus + 1, math.ceil(gpus * _RAISE))
    else:
        raise ValueError(
            f"{model.config}: the modelled P99 at the target misses the {model.setup.slo_ms:g} ms SLO even on "
            f"{gpus} GPUs ({from_goodput} by the one-GPU goodput)"
        )
    return {
        "config": model.config,
        "workload": model.workload,
        "slo_ms": model.setup.slo_ms,
        "target_rps": target_rps,
        "per_gpu_goodput_rps": per_gpu,
        "gpus": gpus,
        "gpus_from_goodput": from_goodput,  # before any added for the point at the target (above)
        "per_gpu_rps": target_rps / gpus,
        "p99_ms": point["p99_ms"],
        "busy": point["busy"],
        "served": {k: point[k] for k in (*PSI_PATHS, "full_recompute") if k in point},
        "hbm_psi_gb_per_gpu": model.setup.hbm_budget_bytes / 2**30 if model.setup.psi else 0.0,
        "dram_gb_per_gpu": model.setup.dram_bytes / 2**30 if model.setup.psi else 0.0,
        "search": [{k: p[k] for k in ("rate_rps", "p99_ms", "meets_slo")} for p in points],
    }


def plan(
    source: Path,
    configs: list[str],
    target_rps: float,
    workload: str | None = None,
    slo_ms: float | None = None,
    users: int | None = None,
    changes: dict[str, float] | None = None,
    seed: int = 0,
    trigger_settings: dict[str, Any] | None = None,
    session: dict[str, float] | None = None,
    lengths: tuple[tuple[int, float], ...] = (),
) -> list[dict[str, Any]]:
    """One plan per configuration, each modelled from `source`'s own records of it (`relay`: with
    `trigger_settings` instead of the run's where given). `session`: the users' session model
    instead of the run's (SESSION_KEYS: the mean requests of a session, its think times' scale);
    `lengths`: the users' prefix lengths drawn from these (upper length, weight) bins instead of
    the run's workload (relaygr.workload, length_histogram). Either way the calls' costs are as
    the run measured them, fitted by tokens: lengths outside the run's are extrapolated, and
    each plan says so (`extrapolated`, beside the run's `calibrated_call_tokens`)."""
    if users is not None and users < 1:
        raise ValueError("--users must be >= 1")
    if slo_ms is not None and not slo_ms > 0:
        raise ValueError("--slo-ms must be > 0")
    session = dict(session or {})
    if set(session) - set(SESSION_KEYS):
        raise ValueError(f"session: only {', '.join(SESSION_KEYS)}")
    if session.get("session_mean_requests", 1.0) < 1:
        raise ValueError("--session-mean-requests must be >= 1")
    if not session.get("think_scale", 1.0) > 0:
        raise ValueError("--think-scale must be > 0")
    rows = []
    for config in configs:
        # The trigger's settings are the relay's alone (the others' files ran no trigger that admits).
        settings = trigger_settings if config == "relay" else None
        model = load_model(source, config, workload, changes, trigger_settings=settings or None)
        if slo_ms is not None:
            model = dataclasses.replace(model, setup=dataclasses.replace(model.setup, slo_ms=slo_ms))
        if lengths:
            if model.traffic.fixed_prefix_len is not None:
                # One length's records fit no cost per token: k27c's (L4096) put a 1024-token full
                # ranking at 0.27 ms, where the mix's fit (k27b) gives 1.25 and 8192 tokens 7.8
                # (bench.core on an H200: 7.4).
                raise ValueError(
                    f"--lengths needs a source run of the length mix: {source.name}'s {model.workload} "
                    "measured one length, whose costs do not extrapolate to others"
                )
            try:
                histogram = dataclasses.replace(
                    model.traffic, length_histogram=lengths, fixed_prefix_len=None
                )
            except ValueError as exc:
                raise ValueError(f"--lengths: {exc}") from None
            model = dataclasses.replace(model, traffic=histogram)
        model = with_session(model, session)
        row = plan_one(model, target_rps, users, seed)
        row["session_mean_requests"] = model.traffic.session_mean_requests
        row["think_scale"] = model.traffic.think_scale
        # The full rankings' sequences the run measured (prefix and suffix tokens of a call).
        row["calibrated_call_tokens"] = list(model.cal.full.call_tokens)
        if lengths:
            planned = user_prefix_lengths(model.traffic)
            suffix = model.traffic.recent_tokens + model.traffic.candidates
            low, high = model.cal.full.call_tokens
            row["workload"] = f"{model.workload} costs, --lengths"
            row["prefix_tokens"] = [int(planned.min()), int(np.median(planned)), int(planned.max())]
            row["extrapolated"] = bool(planned.min() + suffix < low or planned.max() + suffix > high)
        rows.append(row)
    return rows


# The session model a plan may take instead of its run's (relaygr.workload.WorkloadConfig).
SESSION_KEYS = ("session_mean_requests", "think_scale")


def table(rows: list[dict[str, Any]]) -> str:
    """The plans as a markdown table."""
    head = "| config | workload | SLO ms | target req/s | per-GPU goodput | GPUs | P99 ms at target | busy | served |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        served = ", ".join(f"{k} {v:.2f}" for k, v in r["served"].items())
        raised = r.get("gpus_from_goodput", r["gpus"])
        gpus = f"{r['gpus']}" if raised == r["gpus"] else f"{r['gpus']} (goodput alone: {raised})"
        lines.append(
            f"| {r['config']} | {r['workload']} | {r['slo_ms']:g} | {r['target_rps']:g} | "
            f"{r['per_gpu_goodput_rps']:.1f} | {gpus} | {r['p99_ms']:.1f} | {r['busy']:.2f} | {served} |"
        )
    return "\n".join(lines)


# What the sensitivity table varies: (input, its what-if key or "slo_ms", factors).
SENSITIVITY: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("SLO", "slo_ms", (0.8, 1.25)),
    ("host DRAM per GPU", "arena_gb", (0.5, 2.0)),
    ("a call against psi's cost", "cached_scale", (0.5,)),
    ("a full ranking's cost", "full_scale", (0.8,)),
    # The host's launch of each batch and its time between launches: at 16384 tokens on an H200
    # (k10d) the relay's modelled limit halves when they double (eager steps launch for 8-12 ms).
    ("the host's launch and step time", "launch_scale", (0.5, 1.5)),
    # Requests a user's session makes: the relay's reuse comes from them (1: none to reuse).
    ("requests per session", "session_mean_requests", (1 / 3, 2.0)),
)


def sensitivity(
    source: Path,
    configs: list[str],
    target_rps: float,
    base: list[dict[str, Any]],
    workload: str | None = None,
    slo_ms: float | None = None,
    changes: dict[str, float] | None = None,
    trigger_settings: dict[str, Any] | None = None,
    session: dict[str, float] | None = None,
    lengths: tuple[tuple[int, float], ...] = (),
) -> list[dict[str, Any]]:
    """GPUs with one input varied at a time (SENSITIVITY), beside the plan `base`: which inputs
    matter most. Inputs a configuration does not use (DRAM, psi and sessions for the baseline) are
    left out."""
    rows = []
    for name, key, factors in SENSITIVITY:
        for config, reference in zip(configs, base, strict=True):
            if key in ("arena_gb", "cached_scale", "session_mean_requests") and config == "baseline":
                continue
            for factor in factors:
                varied = dict(changes or {})
                sessions = dict(session or {})
                slo = slo_ms
                if key == "slo_ms":
                    slo = reference["slo_ms"] * factor
                elif key == "arena_gb":
                    varied[key] = reference["dram_gb_per_gpu"] * factor
                elif key == "session_mean_requests":
                    sessions[key] = max(1.0, reference[key] * factor)
                else:
                    varied[key] = varied.get(key, 1.0) * factor
                (row,) = plan(source, [config], target_rps, workload, slo, None, varied,
                              trigger_settings=trigger_settings, session=sessions, lengths=lengths)  # fmt: skip
                rows.append({"input": name, "factor": factor, "config": config, "gpus": row["gpus"],
                             "base_gpus": reference["gpus"], "change": row["gpus"] / reference["gpus"] - 1})  # fmt: skip
    return rows


def sensitivity_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| input | x | config | GPUs | against the plan |", "|---|---:|---|---:|---:|"]
    lines += [
        f"| {r['input']} | {r['factor']:g} | {r['config']} | {r['gpus']} | {r['change']:+.0%} |" for r in rows
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """P99 against the per-GPU rate, one line per configuration (its search's points), the SLO
    as a horizontal line. Needs matplotlib (the dev extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'relaygr[dev]')") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        pts = sorted(r["search"], key=lambda p: p["rate_rps"])
        ax.plot([p["rate_rps"] for p in pts], [p["p99_ms"] for p in pts], marker="o", label=r["config"])
    slo = rows[0]["slo_ms"]
    ax.axhline(slo, color="black", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
    ax.set_xlabel("ranking requests per second per GPU (modelled)")
    ax.set_ylabel("P99 latency, ms")
    ax.set_yscale("log")
    ax.set_title(f"relaygr plan: {rows[0]['workload']}, per GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
