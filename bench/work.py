"""Device work per call in a goodput run, against the least the relay's session model allows.

    python -m bench.work bench/results/goodput-nvidia-h100-80gb-hbm3-t2.json

For every point of every record: the accelerator time spent (ranking plus pre-inference, over the
replay: lead-in and measured window) per call offered, and the costs in service it comes from:
P, a whole pre-inference (device_preinfer_s over the pre-inferences produced); C, a call against
psi (hits' compute P50 over their batch P50); F, a full ranking (compute P50; with the relay it
keeps psi). `first` is the share of calls that are a user's first (1 - returning_share): each
costs at least min(P + C, F) however it is served, and every other call at least C, so

    bound_ms = first x min(P + C, F) + (1 - first) x C

is the relay's least work per call at these costs. `ceiling` is the baseline's measured work per
call at the same rate (or the nearest measured) over the relay's bound: the most relay / baseline
goodput could reach where both are limited by device time at the same busy share. It says which
cost has to fall for a target; bench.goodput measures whether it did.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

COLUMNS = ("config", "workload", "rate_rps", "busy", "work_ms", "first", "P_ms", "C_ms", "F_ms", "bound_ms",
           "ceiling")  # fmt: skip


def _per_call(stage: dict[str, Any] | None) -> float:
    """A path's compute per call: its compute P50 over its batch P50 (nan without such calls)."""
    if not stage or not stage.get("calls"):
        return math.nan
    return float(stage["compute_ms_p50"]) / max(1.0, float(stage.get("batch_p50", 1.0)))


def point_work(point: dict[str, Any], lead_in_s: float) -> dict[str, float]:
    """Work per call and its parts for one point (module docstring)."""
    window_s = lead_in_s + float(point["duration_s"])
    calls = float(point.get("offered_rps") or point["rate_rps"]) * window_s
    device_s = float(point.get("device_rank_s", 0.0)) + float(point.get("device_preinfer_s", 0.0))
    served = point.get("by_served", {})
    preinfers = float(point.get("psi_produced", 0)) - float(point.get("reloads", 0))
    p_ms = float(point.get("device_preinfer_s", 0.0)) * 1e3 / preinfers if preinfers > 0 else math.nan
    c_ms = _per_call(served.get("hbm_hit"))
    f_ms = _per_call(served.get("full_recompute"))
    first = 1.0 - float(point.get("returning_share", 0.0))
    # A first call: pre-inferred then ranked against psi, or ranked in full (whichever is
    # measured; nan when neither is).
    first_costs = [x for x in (p_ms + c_ms, f_ms) if not math.isnan(x)]
    first_cost = min(first_costs) if first_costs else math.nan
    bound = first * first_cost + (1.0 - first) * c_ms
    return {
        "busy": float(point.get("busy_fraction", math.nan)),
        "work_ms": device_s * 1e3 / calls if calls > 0 else math.nan,
        "first": first,
        "P_ms": p_ms,
        "C_ms": c_ms,
        "F_ms": f_ms,
        "bound_ms": bound,
    }


def rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per point of every record; `ceiling` against the baseline of the same workload."""
    lead_in_s = float(run.get("config", {}).get("lead_in_s", 0.0))
    out: list[dict[str, Any]] = []
    baseline: dict[str, list[tuple[float, float]]] = {}
    for record in run["results"]:
        for point in record["points"]:
            row = {"config": record["config"], "workload": record["workload"], "rate_rps": point["rate_rps"],
                   **point_work(point, lead_in_s)}  # fmt: skip
            out.append(row)
            if record["config"] == "baseline":
                baseline.setdefault(record["workload"], []).append((row["rate_rps"], row["work_ms"]))
    for row in out:
        measured = baseline.get(row["workload"])
        if row["config"] == "baseline" or not measured or math.isnan(row["bound_ms"]):
            row["ceiling"] = math.nan
            continue
        nearest = min(measured, key=lambda rw: abs(rw[0] - row["rate_rps"]))
        row["ceiling"] = nearest[1] / row["bound_ms"]
    return out


def table(found: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="goodput result files (JSON)")
    args = p.parse_args(argv)
    for path in args.files:
        try:
            run = json.loads(path.read_text())
            found = rows(run)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"{path}: not a goodput result ({type(exc).__name__}: {exc})")
        device = run.get("machine", {}).get("device", "?")
        print(f"## {path.name} ({device})\n\n{table(found)}\n")


if __name__ == "__main__":
    main()
