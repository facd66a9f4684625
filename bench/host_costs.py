"""Host cost of issuing the ranker's device work: what the device loop spends per operation.

    python -m bench.host_costs --device cuda                       # bench preset, 4096 tokens
    python -m bench.host_costs --device cpu --preset tiny --prefix-len 256 --reps 5   # smoke run

In service the relay's device loop spent ~1.7 ms issuing a ranking batch against ~1.0 ms for the
baseline's, and ~0.65 ms issuing each psi demotion (H200, L4096, h3a loop sections), while the
device sat idle with calls waiting 20% of the time (the baseline 5%). This times each operation the
loop issues, alone, with the device kept busy (a sleep kernel queued on the compute stream first,
so an asynchronous issue never waits for the device) and reports its wall and CPU time on the
issuing thread, median and p90 over --reps; then the same with a second thread running Python
(`gil_contended`: every call that gives the interpreter up waits to take it back, at
--gil-switch-ms and, with --timer-slack-us, that timer slack). Operations:

  demote        a psi's copy into the pinned arena on the copy stream, ordered after compute and
                timed by pooled events as Engine._issue_copy issues it
  demote_unpooled  the same as it was issued before de0e1d4 and 1ffcb09 (wait_stream, new events,
                K/V and timestamps copied apart)
  demote_copy   the copy alone (transfer.issue_to_host: one copy of psi's block)
  demote_kv_copy  the K/V bytes' copy_ alone of a psi held apart
  reload        a psi's copy out of the arena into a new block (transfer.issue_from_host)
  new_psi       a psi block for a full ranking that keeps its prefix's K/V (HSTURanker.new_psi)
  launch_full / launch_full_keep / launch_rank
                a replayed ranking graph's launch (RankGraphs; CUDA only)
  event_*, stream_*, h2d/d2h/d2d copies, empty_*
                the driver calls those are made of (CUDA only)
  gil_retake    the interpreter given up and taken back (time.sleep(0)), nothing else

The arena is a memfd mapping registered as page-locked, as the ranker maps the expander's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench.report import RESULTS_DIR, write_result
from kernels.device import Accelerator, accelerator
from relaygr.synthetic import Shape, batch
from services.ranker.device_time import SectionTimer
from services.ranker.events import timing_event_pool
from services.ranker.model import HSTURanker
from services.ranker.transfer import host_meta, host_nbytes, issue_from_host, issue_to_host
from shared.expander.mapping import ArenaMapping
from shared.lifecycle import set_timer_slack
from shared.modelspec import preset
from shared.stats import median, percentile

BUSY_MS = 20.0  # the sleep queued ahead of each timed issue: longer than any issue


class Timer:
    """Wall and thread-CPU time of a callable over repetitions, each behind a busy device."""

    def __init__(self, acc: Accelerator, reps: int) -> None:
        self.acc, self.reps = acc, reps
        self.cuda = acc.backend == "cuda"
        self.rows: list[dict[str, Any]] = []
        self.condition = "alone"

    def _busy(self) -> None:
        if self.cuda:
            # ~BUSY_MS of device time at the clock rate; the issue that follows queues behind it.
            torch.cuda._sleep(int(BUSY_MS * 1e-3 * 1.5e9))

    def measure(self, name: str, op: Callable[[], Any], after: Callable[[Any], None] | None = None) -> None:
        wall: list[float] = []
        cpu: list[float] = []
        for rep in range(self.reps + 2):  # two warm-up repetitions
            self.acc.synchronize()
            self._busy()
            w0, c0 = time.perf_counter(), time.thread_time()
            value = op()
            w1, c1 = time.perf_counter(), time.thread_time()
            if after is not None:
                after(value)
            self.acc.synchronize()
            if rep >= 2:
                wall.append((w1 - w0) * 1e6)
                cpu.append((c1 - c0) * 1e6)
        row = {
            "op": name,
            "condition": self.condition,
            "wall_us_p50": median(wall),
            "wall_us_p90": percentile(wall, 90),
            "cpu_us_p50": median(cpu),
            "cpu_us_p90": percentile(cpu, 90),
            "reps": self.reps,
        }
        self.rows.append(row)
        print(
            f"{self.condition:13s} {name:18s} wall p50 {row['wall_us_p50']:8.1f} us  p90 {row['wall_us_p90']:8.1f}  "
            f"cpu p50 {row['cpu_us_p50']:8.1f} us  p90 {row['cpu_us_p90']:8.1f}",
            flush=True,
        )


@contextlib.contextmanager
def pinned_arena(acc: Accelerator, nbytes: int) -> Iterator[torch.Tensor]:
    """A memfd mapping of nbytes as a uint8 tensor, page-locked on CUDA (as HostTier maps the
    expander's arena: ArenaMapping, then pin_host_range over its base address)."""
    fd = os.memfd_create("relaygr-host-costs")
    try:
        os.ftruncate(fd, nbytes)
        mapping = ArenaMapping.from_fd(fd, nbytes, "host-costs")
    finally:
        os.close(fd)
    pinned = acc.pin_host_range(mapping.base_address, nbytes)
    try:
        yield mapping.tensor(0, nbytes)
    finally:
        if pinned:
            acc.unpin_host_range(mapping.base_address)
        mapping.close()


@contextlib.contextmanager
def gil_contention(on: bool, switch_ms: float) -> Iterator[None]:
    """While on: a second thread runs Python without pause (as the ranker's event loop does under
    load), so every call that releases the GIL waits to take it back; the switch interval as the
    ranker sets it."""
    if not on:
        yield
        return
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_ms / 1e3)
    thread = threading.Thread(target=spin, name="gil-contender", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(before)


def primitive_ops(
    acc: Accelerator, copy_stream: torch.cuda.Stream
) -> list[tuple[str, Callable[[], Any], Callable[[Any], None] | None]]:
    """The driver calls the loop's operations are made of, one at a time."""
    device = acc.device
    recorded = torch.cuda.Event(enable_timing=True)
    recorded.record()
    small_host = torch.zeros(8192, dtype=torch.int64).pin_memory()  # 64 KiB, as a batch's staging
    small_dev = torch.zeros(8192, dtype=torch.int64, device=device)
    scores_host = torch.zeros(1024, dtype=torch.float32).pin_memory()
    scores_dev = torch.zeros(1024, dtype=torch.float32, device=device)
    return [
        ("event_new_timed", lambda: torch.cuda.Event(enable_timing=True).record(), None),
        ("event_new_untimed", lambda: torch.cuda.Event().record(), None),
        ("event_rerecord", lambda: recorded.record(), None),
        ("event_query", lambda: recorded.query(), None),
        ("stream_wait_event", lambda: copy_stream.wait_event(recorded), None),
        ("stream_wait_stream", lambda: copy_stream.wait_stream(torch.cuda.current_stream(device)), None),
        ("h2d_64k_pinned", lambda: small_dev.copy_(small_host, non_blocking=True), None),
        ("d2h_4k_pinned", lambda: scores_host.copy_(scores_dev, non_blocking=True), None),
        ("d2d_64k", lambda: small_dev.copy_(small_dev.flip(0)), None),
        ("empty_128mib", lambda: torch.empty(128 << 20, dtype=torch.uint8, device=device), None),
        ("pinned_empty_32k", lambda: torch.empty(4096, dtype=torch.int64, pin_memory=True), None),
    ]


def graph_ops(
    args: argparse.Namespace,
    model: HSTURanker,
    prefixes: list[Any],
    suffixes: list[Any],
    psis: list[Any],
    keys: list[Any],
) -> list[tuple[str, Callable[[], Any], Callable[[Any], None] | None]]:
    """Replayed ranking graphs' launches, captured first, as the engine issues them."""
    from services.ranker.graphs import GraphLimits, RankGraphs

    tokens = args.prefix_len + args.recent + args.candidates
    limits = GraphLimits(max_batch=1, max_tokens=max(64, args.recent + args.candidates),
                         max_prefix_tokens=args.prefix_len, max_full_tokens=tokens, max_full_batch=1)  # fmt: skip
    graphs = RankGraphs(model, limits, full_keeps_kv=True)
    for _attempt in range(2):  # the first call of each shape only asks for its capture
        got = [
            graphs.launch_full(prefixes, suffixes),
            graphs.launch_full(prefixes, suffixes, [model.new_psi(p) for p in prefixes]),  # full_keep
            graphs.launch_rank(suffixes, psis, keys),
        ]
        for pending in got:
            if pending is not None:
                pending.wait()
        if all(p is not None for p in got):
            break
        graphs.capture_pending(limit=4)

    def wait(pending: Any) -> None:
        if pending is None:
            raise RuntimeError(f"a graph launch fell back to the eager pass: {graphs.stats}")
        pending.wait()

    def keep() -> Any:
        # As the engine allocates them: once the replay is issued, timestamps left to the graph.
        return graphs.launch_full(prefixes, suffixes, lambda ts: [model.new_psi(p, ts) for p in prefixes])

    return [
        ("launch_full", lambda: graphs.launch_full(prefixes, suffixes), wait),
        ("launch_full_keep", keep, wait),
        ("launch_rank", lambda: graphs.launch_rank(suffixes, psis, keys), wait),
    ]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    acc = accelerator(args.device)
    spec = preset(args.preset)
    model = HSTURanker.from_seed(spec, seed=0, device=acc.device)
    timer = Timer(acc, args.reps)
    shape = Shape(16, args.prefix_len - 16, args.recent, args.candidates)
    prefixes, suffixes = batch(7, [shape])
    prefix, keys = (
        prefixes[0],
        [model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest) for p in prefixes],
    )
    # psi as the ranker holds it (one block, HSTURanker.new_psi), and as it was held before 1ffcb09
    # (K/V and timestamps apart, as model.preinfer still returns it).
    apart = model.preinfer(prefixes)[0]
    psi = model.new_psi(prefix)
    with torch.inference_mode():  # psi blocks are inference tensors
        psi.kv.copy_(apart.kv)
        psi.timestamps.copy_(apart.timestamps)
    psis = [psi]
    meta = host_meta(psi)
    nbytes = host_nbytes(meta)
    copy_stream = torch.cuda.Stream(acc.device) if timer.cuda else None
    compute = torch.cuda.current_stream(acc.device) if timer.cuda else None
    with pinned_arena(acc, max(args.arena_mb << 20, nbytes)) as arena:
        dest = arena[:nbytes]

        def demote_unpooled() -> None:  # as the engine issued a demotion before de0e1d4
            section = SectionTimer(cuda=timer.cuda)
            if copy_stream is None:
                with section.section():
                    issue_to_host(apart, dest)
                return
            copy_stream.wait_stream(compute)  # type: ignore[arg-type]
            with torch.cuda.stream(copy_stream):
                with section.section():
                    issue_to_host(apart, dest)
                torch.cuda.Event().record(copy_stream)

        pool = timing_event_pool() if timer.cuda else None
        order = torch.cuda.Event() if timer.cuda else None

        def demote() -> SectionTimer:  # as Engine._issue_copy issues one now
            section = SectionTimer(cuda=timer.cuda, pool=pool)
            if copy_stream is None or order is None:
                with section.section():
                    issue_to_host(psi, dest)
                return section
            order.record(compute)
            copy_stream.wait_event(order)
            with torch.cuda.stream(copy_stream), section.section():
                issue_to_host(psi, dest)
            return section

        def release(section: SectionTimer) -> None:  # once done, as Engine._copied does
            section.synchronize()
            section.total_s()
            section.release()

        def demote_copy() -> None:
            if copy_stream is None:
                issue_to_host(psi, dest)
                return
            with torch.cuda.stream(copy_stream):
                issue_to_host(psi, dest)

        def reload() -> Any:
            if copy_stream is None:
                return issue_from_host(dest, meta, psi.key, acc.device)
            with torch.cuda.stream(copy_stream):
                return issue_from_host(dest, meta, psi.key, acc.device, compute)

        kv_bytes = int(meta["kv_bytes"])

        def kv_copy() -> None:  # the K/V bytes' copy alone, on the current stream
            dest[:kv_bytes].copy_(apart.kv.reshape(-1).view(torch.uint8), non_blocking=True)

        ops: list[tuple[str, Callable[[], Any], Callable[[Any], None] | None]] = [
            # The interpreter given up and taken back, nothing else: what each such torch call
            # pays on top of its own work when another thread runs Python.
            ("gil_retake", lambda: time.sleep(0), None),
            ("demote", demote, release),
            ("demote_unpooled", demote_unpooled, None),
            ("demote_copy", demote_copy, None),
            ("demote_kv_copy", kv_copy, None),
            ("reload", reload, None),
            ("new_psi", lambda: model.new_psi(prefix), None),
        ]
        if timer.cuda:
            ops += primitive_ops(acc, copy_stream)  # type: ignore[arg-type]
            ops += graph_ops(args, model, prefixes, suffixes, psis, keys)
        for condition in ("alone", "gil_contended"):
            timer.condition = condition
            with gil_contention(condition == "gil_contended", args.gil_switch_ms):
                for name, op, after in ops:
                    timer.measure(name, op, after)
    return [dict(row, device=acc.name, prefix_len=args.prefix_len, psi_bytes=nbytes) for row in timer.rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--preset", default="bench")
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--recent", type=int, default=64)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--arena-mb", type=int, default=1024, help="the pinned arena's size (at least one psi)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    p.add_argument(
        "--timer-slack-us",
        type=float,
        default=None,
        help="this process's timer slack (Linux; default: the kernel's, 50 us; the ranker's is 1)",
    )
    p.add_argument(
        "--gil-switch-ms",
        type=float,
        default=0.5,
        help="the interpreter's switch interval while contended (0.5: the ranker's default before 0.05)",
    )
    args = p.parse_args(argv)
    if args.reps < 1 or args.prefix_len < 32:
        p.error("--reps must be >= 1 and --prefix-len >= 32")
    if args.timer_slack_us is not None:
        if args.timer_slack_us < 0:
            p.error("--timer-slack-us must be >= 0")
        # The measuring thread's (and the contender's, started after): how late a timed wait for
        # the interpreter may end (services/ranker/config.py timer_slack_us).
        set_timer_slack(round(args.timer_slack_us * 1e3))
    rows = run(args)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    columns = ["op", "condition", "wall_us_p50", "wall_us_p90", "cpu_us_p50", "cpu_us_p90", "reps"]
    for path in write_result("host-costs", config, rows, columns, out_dir=args.out_dir, tag=args.tag):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
