"""The end-to-end benchmark: the paper's two claims, every configuration in one run, one machine.

    python -m bench.relay --device cuda --preset bench --slo-ms 30 ...   # GPU (see README for the runs)
    python -m bench.relay --quick                                        # CPU smoke run (tiny model)

For each configuration (baseline, preinfer-all, no-affinity, no-expander, relay: switches of the
same stack, see relaygr/launcher.py) the whole stack is brought up once and two open-loop sweeps run
through it (workload: relaygr/workload.py, replay: relaygr/replay.py):
  * length sweep at a fixed offered rate: every user's prefix has the same length L; the largest L
    whose ranking P99 <= SLO with no failed call is max_len_at_slo;
  * rate sweep at a fixed length mix (the ML-100K shape, scaled): the highest offered rate whose
    P99 <= SLO with no failed call is goodput_rps.
Each sweep stops at its first point past the SLO (latency only grows beyond it). Per point: P50 /
P99 / P99.9, per-stage percentiles, served-by fractions, wasted pre-inferences, resident bytes,
lead time; eps = max |score - full-inference score| over a sample of calls, the full scores
obtained afterwards from the same ranker with a prefix version that has no psi.

Writes bench/results/relay-<device>.json, .md and two PNG plots (P99 vs length, P99 vs rate).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import orjson

from bench.report import RESULTS_DIR, device_slug
from relaygr.harness import CONFIGS, Point, machine, markdown_table, run_point, stack_overrides
from relaygr.launcher import Stack, StackConfig
from relaygr.workload import WorkloadConfig


async def sweeps(stack: Stack, args: argparse.Namespace) -> list[Point]:
    base = WorkloadConfig(
        seed=args.seed,
        duration_s=args.duration_s,
        rate_rps=args.rate,
        users=args.users,
        recent_tokens=args.recent,
        candidates=args.candidates,
        length_scale=args.length_scale,
        max_prefix_len=max(args.lengths, default=args.max_prefix_len),
    )
    points: list[Point] = []
    # A short replay first, thrown away: the first calls of a fresh stack pay one-off costs
    # (allocator growth, lazy initialisation) that belong to no configuration.
    warm = dataclasses.replace(base, duration_s=args.warmup_s, rate_rps=args.rate, version_base=999_000_000)
    await run_point(stack, warm, args.slo_ms, "warmup", args.rate, eps_sample=0)
    await asyncio.sleep(args.settle_s)
    # Each point gets its own prefix versions: the same (user, version) must always name the
    # same tokens, and one point must not hit psi that an earlier one left in the tiers.
    for i, length in enumerate(args.lengths):
        cfg = dataclasses.replace(base, fixed_prefix_len=length, version_base=(i + 1) * 1_000_000)
        point = await run_point(stack, cfg, args.slo_ms, "length", length, args.eps_sample)
        points.append(point)
        if not point.ok:
            break
        await asyncio.sleep(args.settle_s)
    for i, rate in enumerate(args.rates):
        cfg = dataclasses.replace(base, rate_rps=rate, version_base=(i + 101) * 1_000_000)
        point = await run_point(stack, cfg, args.slo_ms, "rate", rate, args.eps_sample)
        points.append(point)
        if not point.ok:
            break
        await asyncio.sleep(args.settle_s)
    return points


def best(points: list[Point], sweep: str) -> float:
    """The largest swept value meeting the SLO before the first one that does not (0: none)."""
    value = 0.0
    for p in points:
        if p.sweep != sweep:
            continue
        if not p.ok:
            break
        value = p.value
    return value


def config_record(name: str, points: list[Point], slo_ms: float) -> dict[str, Any]:
    ref = next((p for p in points if p.sweep == "rate"), points[0])  # the first rate point: same load for all
    s = ref.summary
    return {
        "config": name,
        "slo_ms": slo_ms,
        "max_len_at_slo": best(points, "length"),
        "goodput_rps": best(points, "rate"),
        "reference_rate_rps": ref.value if ref.sweep == "rate" else None,
        "p50_ms": s["p50_ms"],
        "p99_ms": s["p99_ms"],
        "p999_ms": s["p999_ms"],
        "hbm_hit_rate": s.get("hbm_hit", 0.0) + s.get("inflight_join", 0.0),
        "dram_reload_rate": s.get("dram_reload", 0.0),
        "miss_rate": s.get("full_recompute", 0.0),
        "wasted_preinfer_rate": ref.rankers["wasted_preinfer_rate"],
        "eps_max": max(p.eps_max for p in points),
        "points": [p.record() for p in points],
    }


def plot(records: list[dict[str, Any]], slo_ms: float, path_stem: Path, device: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for sweep, xlabel in (("length", "prefix length (tokens)"), ("rate", "offered rate (requests/s)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for r in records:
            pts = [p for p in r["points"] if p["sweep"] == sweep]
            if pts:
                ax.plot([p["value"] for p in pts], [p["p99_ms"] for p in pts], marker="o", label=r["config"])
        ax.axhline(slo_ms, color="black", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ranking P99 (ms)")
        ax.set_yscale("log")
        ax.set_title(f"ranking P99 vs {sweep} ({device})")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        path = path_stem.with_name(f"{path_stem.name}-p99-vs-{sweep}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS)
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rankers", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--slo-ms", type=float, default=300.0)
    parser.add_argument("--rate", type=float, default=4.0, help="offered rate of the length sweep")
    parser.add_argument("--risk-fraction", type=float, default=0.5,
                        help="trigger: at risk when predicted full ranking > this x SLO")  # fmt: skip
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--length-scale", type=float, default=4.0, help="ML-100K lengths x this (rate sweep)")
    parser.add_argument("--max-prefix-len", type=int, default=16384, help="clip of the rate sweep's lengths")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--recent", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=32)
    parser.add_argument("--hbm-budget-mb", type=float, default=512.0)
    parser.add_argument("--arena-gb", type=float, default=1.0)
    parser.add_argument("--eps-sample", type=int, default=1, help="0 skips the eps check")
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--warmup-s", type=float, default=4.0, help="a discarded replay before the sweeps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--tag", default="", help="suffix of the result file name (e.g. 2gpu)")
    parser.add_argument(
        "--merge", nargs="+", default=None, metavar="JSON", help="merge earlier runs' results"
    )
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args)
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}")
    records = []
    started = time.time()
    for name in names:
        print(f"[{name}] starting the stack ({args.rankers} ranker(s) on {args.device})", flush=True)
        # Started from the main thread: its children live as long as it.
        with Stack(stack_config(name, args)) as stack:
            points = asyncio.run(sweeps(stack, args))
        records.append(config_record(name, points, args.slo_ms))
    run_config = {k: v for k, v in vars(args).items() if k not in ("out_dir", "merge")}
    write_report(records, run_config | {"wall_s": time.time() - started}, machine(), args)


def save_logs(stack: Stack, directory: Path, config: str) -> None:
    """Every service's log records so far, one JSON line each: <config>-<service>.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    for proc in [*stack.retired, *stack.processes]:  # a respawned service's first process too
        lines = [orjson.dumps(record).decode() for record in proc.records()]
        (directory / f"{config}-{proc.name}.jsonl").write_text("".join(f"{line}\n" for line in lines))


def stack_config(name: str, args: argparse.Namespace) -> StackConfig:
    """The stack of configuration `name` (CONFIGS) with the run's settings: rankers, device,
    preset, slo_ms, hbm_budget_mb, arena_gb, recent, candidates, risk_fraction."""
    overrides, trigger_extra = stack_overrides(name, args.arena_gb)
    # `rankers` counts devices; a configuration with k ranker processes per device splits each
    # device's HBM budget among them.
    per_device = int(overrides.get("rankers_per_device", 1))
    return StackConfig(rankers=args.rankers * per_device, device=args.device, preset=args.preset,
                       slo_ms=args.slo_ms, hbm_budget_mb=args.hbm_budget_mb / per_device,
                       # the trigger's estimate of the tokens a ranking call adds to the prefix
                       trigger_args=("--suffix-tokens-estimate", str(args.recent + args.candidates),
                                     "--risk-fraction", str(args.risk_fraction), *trigger_extra),
                       **overrides)  # fmt: skip


def write_report(records: list[dict[str, Any]], run_config: dict[str, Any], info: dict[str, Any],
                 args: argparse.Namespace) -> None:  # fmt: skip
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"relay-{device_slug(info['device'])}{'-' + args.tag if args.tag else ''}"
    slo_ms = float(run_config["slo_ms"])
    stem.with_suffix(".json").write_text(json.dumps({"machine": info, "config": run_config, "results": records},
                                                    indent=2) + "\n")  # fmt: skip
    columns = ["config", "slo_ms", "max_len_at_slo", "goodput_rps", "p50_ms", "p99_ms", "p999_ms",
               "hbm_hit_rate", "dram_reload_rate", "miss_rate", "wasted_preinfer_rate", "eps_max"]  # fmt: skip
    header = ""
    base = next((r for r in records if r["config"] == "baseline"), None)
    relay = next((r for r in reversed(records) if r["config"] == "relay"), None)
    if base is not None and relay is not None and base["max_len_at_slo"] and base["goodput_rps"]:
        header = (f"relay / baseline: max length at SLO {relay['max_len_at_slo'] / base['max_len_at_slo']:.2f}x, "
                  f"SLO goodput {relay['goodput_rps'] / base['goodput_rps']:.2f}x "
                  f"(SLO {slo_ms:g} ms, {info['device']} x{run_config.get('rankers', 1)})\n\n")  # fmt: skip
    stem.with_suffix(".md").write_text(f"# relay on {info['device']} (commit {info['commit']})\n\n{header}"
                                       + markdown_table(records, columns))  # fmt: skip
    pngs = plot(records, slo_ms, stem, info["device"])
    print(header + markdown_table(records, columns))
    print("wrote", stem.with_suffix(".json"), stem.with_suffix(".md"), *pngs)


def merge(paths: list[str], args: argparse.Namespace) -> None:
    """One report from several runs of the same setup (e.g. configurations run in separate calls)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    devices = {r["machine"]["device"] for r in runs}
    if len(devices) != 1:
        raise SystemExit(f"refusing to merge runs from different devices: {sorted(devices)}")
    keys = ("slo_ms", "rate", "lengths", "rates", "preset", "rankers", "length_scale", "duration_s")
    for r in runs[1:]:
        differing = [k for k in keys if r["config"].get(k) != runs[0]["config"].get(k)]
        if differing:
            raise SystemExit(f"refusing to merge runs whose settings differ: {differing}")
    records = []
    for run in runs:
        risk = run["config"].get("risk_fraction", 0.5)
        for rec in run["results"]:
            records.append(rec | {"risk_fraction": risk})
    # A configuration measured in several runs is told apart by the setting that differed.
    names = [rec["config"] for rec in records]
    for rec in records:
        if names.count(rec["config"]) > 1 and rec["risk_fraction"] != runs[-1]["config"].get(
            "risk_fraction", 0.5
        ):
            rec["config"] = f"{rec['config']} (risk {rec['risk_fraction']:g})"
    config = runs[0]["config"] | {"merged_from": [Path(p).name for p in paths],
                                  "configs": ",".join(rec["config"] for rec in records)}  # fmt: skip
    write_report(records, config, runs[0]["machine"], args)


if __name__ == "__main__":
    main()
