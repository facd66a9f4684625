"""What a point's per-call records say about its tail (the files `bench.goodput --calls-dir` writes).

    python -m bench.calls bench/results/calls/*.jsonl.xz      # a table, one row per file
    python -m bench.calls a.jsonl --json out.json             # and the rows as JSON
    python -m bench.calls a.jsonl --by-path                   # and where each path's time goes

Per file: the calls served OK and how (shares by path), the measured queue P50 / P99, and the
queue that one serial server would have given the same calls: each call's measured compute time,
in order of its send time, first come first served (`fifo_queue_ms_*`). Measured close to the
FIFO replay: the tail is the arrivals' bursts meeting the service times; measured far above it:
the server was slower inside the bursts than its calls' own compute times say, ordered them
worse, or spent the device on work that is in no call's compute (a relay's pre-inference steps
and copies: s1 at 125 req/s, measured 59 ms against a FIFO replay's 18); far below: it ran
shorter ones first. Records that name their batch (`batch_seq`) replay each batch once, when
its last call has come; older ones replay every call alone with its batch's compute (a
relay's batched calls then overstate the replay's queue). Also the busiest
60 ms and 150 ms of arrivals (`burst_60ms`, `burst_150ms`) against the mean rate, and the compute
time summed over the calls' span (`compute_share`, the critical path's share of the device), and
how late the load generator sent them (`lag_ms_p99`: a point it fell behind in is the client's).
Send times stand for arrival times (the network is a constant offset at the rates measured).

`--against FILE`: the same calls in another configuration's file of the same seed and rate (the
workload is replayed identically: a call's `index` names it in both): each call's latency less
its own there, on average and by 100 ms window of send time, the slowest windows with the
take-overs and calls on pre-inferred psi just before them. Which moments make one configuration
worse than the other, without the run-to-run spread between two searches' limits.

`--by-path`: per file, one row per (served_by, batch size): calls, latency P50 / P99 and the P50
of each stage the records time (queue, host launch, compute, cache lookup / reload, other server
time, network), and the share of the file's calls at or over `--slow-ms` (default 40) that the
row holds: which path and which stage make the tail.

`--slow-windows`: per file, the half-second windows of send time that hold the most slow calls
(at or over `--slow-ms`), up to three: the calls sent in the window against the point's mean,
how many were slow, the share of first calls of a session (`session_index` 0: a relay has no
psi for them, so it saves nothing there) and how the window's calls were served. Whether the
tail is one burst or spread over the point: at L8192 on an H200 (h7a, h7b) the relay's misses
were one window 14 s into each point, 1.3-1.4x the mean rate, 54% of its calls first calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relaygr.compressed import open_text
from relaygr.harness import markdown_table
from shared.stats import percentile

QUEUE_COLUMNS = ("file", "calls", "served", "queue_ms_p50", "queue_ms_p99", "fifo_queue_ms_p50",
                 "fifo_queue_ms_p99", "burst_60ms", "burst_150ms", "mean_per_60ms", "compute_share", "lag_ms_p99")  # fmt: skip


def read_calls(path: Path) -> list[dict[str, Any]]:
    """One point's calls (JSON lines; .xz, .gz or plain)."""
    with open_text(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def batches(calls: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The calls grouped by the batch that computed them: one group per (instance, batch_seq)
    where the records carry it (StageTimings.batch_seq), else each call on its own (older
    records: every call of a batch then counts the batch's compute again)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    alone: list[list[dict[str, Any]]] = []
    for c in calls:
        seq = c.get("batch_seq") or 0
        if seq:
            groups.setdefault((c.get("instance", ""), seq), []).append(c)
        else:
            alone.append([c])
    return [*groups.values(), *alone]


def fifo_queue_ms(calls: Sequence[dict[str, Any]]) -> list[float]:
    """Each call's wait in one first-come-first-served server that takes each batch's measured
    compute_ms once, batches in order of their last call's `at_s` (seconds): a batch starts
    when the server is free and all its calls have come."""
    free_ms = float("-inf")
    waits = []
    for group in sorted(batches(calls), key=lambda g: max(c["at_s"] for c in g)):
        ready_ms = max(c["at_s"] for c in group) * 1e3
        start = max(ready_ms, free_ms)
        waits += [start - c["at_s"] * 1e3 for c in group]
        free_ms = start + group[0]["compute_ms"]
    return waits


def busiest_window(times_s: Sequence[float], window_s: float) -> int:
    """The most send times within any `window_s` (inclusive)."""
    ordered = sorted(times_s)
    best, lo = 0, 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] > window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _pct(values: Sequence[float], q: float) -> float:
    return percentile(values, q) if values else 0.0


def analyse(name: str, calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row of one file (module docstring)."""
    ok = [c for c in calls if c.get("status") == "OK" and c.get("at_s") == c.get("at_s")]  # NaN: never sent
    times = [c["at_s"] for c in ok]
    span_s = max(times) - min(times) if len(times) > 1 else 0.0
    served = collections.Counter(c["served_by"] for c in ok)
    measured, fifo = [c["queue_ms"] for c in ok], fifo_queue_ms(ok)
    compute_s = sum(group[0]["compute_ms"] for group in batches(ok)) / 1e3
    return {
        "file": name,
        "calls": len(ok),
        "served": {k: round(v / len(ok), 3) for k, v in served.most_common()} if ok else {},
        "queue_ms_p50": _pct(measured, 50),
        "queue_ms_p99": _pct(measured, 99),
        "fifo_queue_ms_p50": _pct(fifo, 50),
        "fifo_queue_ms_p99": _pct(fifo, 99),
        "burst_60ms": busiest_window(times, 0.06),
        "burst_150ms": busiest_window(times, 0.15),
        "mean_per_60ms": round(len(ok) / span_s * 0.06, 2) if span_s > 0 else 0.0,
        "compute_share": round(compute_s / span_s, 3) if span_s > 0 else 0.0,
        # How late the load generator sent the calls (P99): seconds mean the client, not the
        # server, set the point (bench.goodput's client_bound); 0 in records without it.
        "lag_ms_p99": _pct([c.get("lag_ms", 0.0) for c in ok], 99),
    }


PATH_COLUMNS = ("file", "served_by", "batch", "calls", "latency_ms_p50", "latency_ms_p99", "queue_ms_p50",
                "launch_ms_p50", "compute_ms_p50", "cache_ms_p50", "server_other_ms_p50", "network_ms_p50",
                "slow_share")  # fmt: skip
_STAGES = ("queue_ms", "launch_ms", "compute_ms", "cache_ms", "server_other_ms", "network_ms")


def by_path(name: str, calls: Sequence[dict[str, Any]], slow_ms: float = 40.0) -> list[dict[str, Any]]:
    """One row per (served_by, batch size) of the calls served OK (module docstring); full
    rankings that kept psi (records from k31 on: `psi_kept`) as `full_recompute+kept`."""
    ok = [c for c in calls if c.get("status") == "OK" and c.get("at_s") == c.get("at_s")]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for c in ok:
        served = str(c.get("served_by", "")) + ("+kept" if c.get("psi_kept") else "")
        groups[(served, int(c.get("batch", 0)))].append(c)
    slow_total = sum(1 for c in ok if c.get("latency_ms", 0.0) >= slow_ms)
    rows = []
    for (served, size), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        latency = [c["latency_ms"] for c in group]
        row: dict[str, Any] = {"file": name, "served_by": served, "batch": size, "calls": len(group),
                               "latency_ms_p50": _pct(latency, 50), "latency_ms_p99": _pct(latency, 99)}  # fmt: skip
        for stage in _STAGES:
            values = [c[stage] for c in group if stage in c]
            row[f"{stage}_p50"] = _pct(values, 50) if values else None
        slow = sum(1 for v in latency if v >= slow_ms)
        row["slow_share"] = round(slow / slow_total, 3) if slow_total else 0.0
        rows.append(row)
    return rows


WINDOW_COLUMNS = ("file", "window_s", "calls", "mean_calls", "slow", "first_call_share", "served")


def slow_windows(
    name: str, calls: Sequence[dict[str, Any]], slow_ms: float = 40.0, window_s: float = 0.5, top: int = 3
) -> list[dict[str, Any]]:
    """The `top` windows of `window_s` seconds of send time holding the most slow calls, busiest
    first (module docstring); none where no call was slow."""
    ok = [c for c in calls if c.get("status") == "OK" and c.get("at_s") == c.get("at_s")]
    if not ok:
        return []
    start = min(c["at_s"] for c in ok)
    by_window: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for c in ok:
        by_window[int((c["at_s"] - start) // window_s)].append(c)
    mean = len(ok) / max(len(by_window), 1)
    ranked = sorted(
        by_window.items(), key=lambda kv: (-sum(c.get("latency_ms", 0.0) >= slow_ms for c in kv[1]), kv[0])
    )
    rows = []
    for index, group in ranked[:top]:
        slow = sum(1 for c in group if c.get("latency_ms", 0.0) >= slow_ms)
        if slow == 0:
            break
        served = collections.Counter(str(c.get("served_by", "")) for c in group)
        first = sum(1 for c in group if c.get("session_index") == 0)
        rows.append({
            "file": name, "window_s": round(start + index * window_s, 2), "calls": len(group),
            "mean_calls": round(mean, 1), "slow": slow, "first_call_share": round(first / len(group), 2),
            "served": {k: round(v / len(group), 2) for k, v in served.most_common()},
        })  # fmt: skip
    return rows


PAIRED_COLUMNS = ("file", "window_s", "calls", "mean_extra_ms", "max_extra_ms", "took_over", "psi_ahead",
                  "slowest_launch")  # fmt: skip


def _relayed(c: dict[str, Any]) -> bool:
    """Whether a call's psi came from a pre-inference (joined, taken over, or a first call of its
    session read from psi): what puts pre-inference work on the device shortly before it."""
    by = c.get("served_by")
    return by in ("inflight_join", "partial_prefix") or (by == "hbm_hit" and c.get("session_index") == 0)


def paired(
    name: str,
    calls: Sequence[dict[str, Any]],
    reference: Sequence[dict[str, Any]],
    window_s: float = 0.1,
    lead_s: float = 0.25,
    top: int = 5,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The same calls in two records of one seed and rate (the workload generator replays the
    same requests: each call's `index` names it in both): how much slower each call was in
    `calls` than in `reference`, and the `top` windows of send time where it was slowest on
    average, each with what the relay did just before it (within `lead_s`): take-overs
    (partial_prefix) and calls served from pre-inferred psi (`_relayed`): whether its worst
    moments follow pre-inference work. At 337.5 req/s on the mix (H200, k13a) the relay's worst
    100 ms were 30 ms a call slower than the baseline's for the same calls, right after a
    take-over of an 11.8k-token pre-inference. Also the slowest launch in that span, beside the
    same call's in the reference (`slowest_launch`): a stall of the device loop itself (at 312.5
    req/s on an H100's mix, k29b, a full ranking keeping a 7889-token psi launched in 37.1 ms
    against 0.8 in the baseline: the device's allocator freed its cache and retried)."""
    ref = {c["index"]: c for c in reference if c.get("status") == "OK" and "index" in c}
    both = [(c, ref[c["index"]]) for c in calls if c.get("status") == "OK" and c.get("index") in ref]
    summary: dict[str, Any] = {"file": name, "paired_calls": len(both)}
    if not both:
        return summary, []
    extra = [c["latency_ms"] - r["latency_ms"] for c, r in both]
    summary |= {"mean_extra_ms": round(statistics.fmean(extra), 2), "p50_extra_ms": round(_pct(extra, 50), 2),
                "p99_ms": round(_pct([c["latency_ms"] for c, _ in both], 99), 2),
                "reference_p99_ms": round(_pct([r["latency_ms"] for _, r in both], 99), 2)}  # fmt: skip
    by_window: dict[int, list[float]] = collections.defaultdict(list)
    for (c, _), x in zip(both, extra, strict=True):
        by_window[int(c["at_s"] // window_s)].append(x)
    ranked = sorted(by_window.items(), key=lambda kv: -statistics.fmean(kv[1]))[:top]
    # By time alone: calls stamped at the same instant must not be compared themselves (dicts).
    relayed = sorted(
        ((c["at_s"], c) for c in calls if c.get("status") == "OK" and _relayed(c)), key=lambda tc: tc[0]
    )
    launched = sorted(((c["at_s"], c, r) for c, r in both if "launch_ms" in c), key=lambda tcr: tcr[0])
    rows = []
    for index, xs in ranked:
        start = index * window_s
        ahead = [c for t, c in relayed if start - lead_s <= t < start + window_s]
        span = [(c, r) for t, c, r in launched if start - lead_s <= t < start + window_s]
        slowest = None
        if span:
            c, r = max(span, key=lambda cr: cr[0]["launch_ms"])
            slowest = (f"{c['launch_ms']} ms ({c.get('served_by')}, {c.get('prefix_len')} tokens; "
                       f"reference {r.get('launch_ms')} ms)")  # fmt: skip
        rows.append({
            "file": name, "window_s": round(start, 2), "calls": len(xs),
            "mean_extra_ms": round(statistics.fmean(xs), 1), "max_extra_ms": round(max(xs), 1),
            "took_over": [c["prefix_len"] for c in ahead if c.get("served_by") == "partial_prefix"],
            "psi_ahead": len(ahead), "slowest_launch": slowest,
        })  # fmt: skip
    return summary, rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path, help="calls files (JSON lines; .xz, .gz or plain)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--by-path", action="store_true", help="also a table by served_by and batch size")
    parser.add_argument("--slow-windows", action="store_true",
                        help="also the half-second windows holding the most slow calls")  # fmt: skip
    parser.add_argument("--slow-ms", type=float, default=40.0,
                        help="--by-path, --slow-windows: the latency from which a call counts as slow")  # fmt: skip
    parser.add_argument("--against", type=Path, default=None,
                        help="a calls file of the same seed and rate (another configuration): each "
                        "call compared with itself there, and the windows where it was slowest")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.slow_ms > 0:
        parser.error("--slow-ms must be > 0")
    reference = None
    if args.against is not None:
        try:
            reference = read_calls(args.against)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"bench.calls: cannot read {args.against}: {exc}") from None
    rows, path_rows, window_rows, pair_rows, pair_windows = [], [], [], [], []
    for path in args.files:
        try:
            calls = read_calls(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"bench.calls: cannot read {path}: {exc}") from None
        rows.append(analyse(path.name, calls))
        if args.by_path:
            path_rows += by_path(path.name, calls, args.slow_ms)
        if args.slow_windows:
            window_rows += slow_windows(path.name, calls, args.slow_ms)
        if reference is not None:
            summary, windows = paired(path.name, calls, reference)
            pair_rows.append(summary)
            pair_windows += windows
    print(markdown_table(rows, QUEUE_COLUMNS))
    if reference is not None:
        print()
        print(f"against {args.against.name}, call for call:")
        print(markdown_table(pair_rows, ("file", "paired_calls", "mean_extra_ms", "p50_extra_ms", "p99_ms",
                                         "reference_p99_ms")))  # fmt: skip
        print()
        print(markdown_table(pair_windows, PAIRED_COLUMNS))
    if args.by_path:
        print()
        print(markdown_table(path_rows, PATH_COLUMNS))
    if args.slow_windows:
        print()
        print(markdown_table(window_rows, WINDOW_COLUMNS))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
