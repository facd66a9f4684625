"""`relaygr plan`: how many GPUs a target rate needs, per configuration, from the capacity model
(relaygr.sim) calibrated on one GPU's measured goodput run.

    relaygr plan --from bench/results/goodput-nvidia-h100-80gb-hbm3-ed2.json --target-rps 50000 \\
        --configs baseline,relay-nospare --users 100000000

Each ranker serves its own users (the router's affinity keeps a user's calls on one instance),
so the fleet is independent copies of one ranker: the model's goodput of one GPU under the SLO,
then GPUs = ceil(target / that), and the modelled point at target / GPUs per GPU (its P99, how
calls are served, its device busy share). Only what the model covers is planned (baseline,
rankings keeping psi, pre-inference of every request: not the trigger's own policy yet), and only
as well as the model matches its source file (`python -m relaygr.sim` prints the comparison).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from relaygr.sim import PSI_PATHS, Model, goodput, load_model, measured_limit, p99_at


def plan_one(model: Model, target_rps: float, users: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The plan for one configuration (module docstring). ValueError when no rate meets the SLO
    on one GPU."""
    if not target_rps > 0:
        raise ValueError("--target-rps must be > 0")
    met, missed = measured_limit(model.result, model.config, model.workload)
    start = met if met > 0 else (missed / 2 if math.isfinite(missed) else 10.0)
    per_gpu, _, _ = goodput(model.traffic, model.cal, model.setup, start, seed=seed)
    if per_gpu <= 0:
        raise ValueError(f"{model.config}: no rate meets the {model.setup.slo_ms:g} ms SLO on one GPU")
    gpus = math.ceil(target_rps / per_gpu * (1 - 1e-9))
    traffic = model.traffic
    if users is not None:
        traffic = dataclasses.replace(traffic, users=max(1, math.ceil(users / gpus)))
    point = p99_at(traffic, target_rps / gpus, model.cal, model.setup, seed)
    return {
        "config": model.config,
        "workload": model.workload,
        "slo_ms": model.setup.slo_ms,
        "target_rps": target_rps,
        "per_gpu_goodput_rps": per_gpu,
        "gpus": gpus,
        "per_gpu_rps": target_rps / gpus,
        "p99_ms": point["p99_ms"],
        "busy": point["busy"],
        "served": {k: point[k] for k in (*PSI_PATHS, "full_recompute") if k in point},
        "hbm_psi_gb_per_gpu": model.setup.hbm_budget_bytes / 2**30 if model.setup.psi else 0.0,
        "dram_gb_per_gpu": model.setup.dram_bytes / 2**30 if model.setup.psi else 0.0,
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
) -> list[dict[str, Any]]:
    """One plan per configuration, each modelled from `source`'s own records of it."""
    if users is not None and users < 1:
        raise ValueError("--users must be >= 1")
    if slo_ms is not None and not slo_ms > 0:
        raise ValueError("--slo-ms must be > 0")
    rows = []
    for config in configs:
        model = load_model(source, config, workload, changes)
        if slo_ms is not None:
            model = dataclasses.replace(model, setup=dataclasses.replace(model.setup, slo_ms=slo_ms))
        rows.append(plan_one(model, target_rps, users, seed))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The plans as a markdown table."""
    head = "| config | workload | SLO ms | target req/s | per-GPU goodput | GPUs | P99 ms at target | busy | served |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        served = ", ".join(f"{k} {v:.2f}" for k, v in r["served"].items())
        lines.append(
            f"| {r['config']} | {r['workload']} | {r['slo_ms']:g} | {r['target_rps']:g} | "
            f"{r['per_gpu_goodput_rps']:.1f} | {r['gpus']} | {r['p99_ms']:.1f} | {r['busy']:.2f} | {served} |"
        )
    return "\n".join(lines)
