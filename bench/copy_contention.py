"""What a psi copy in flight costs the ranking stream's own small copies and kernels.

    python -m bench.copy_contention --device cuda                    # 512 MiB psi (16384 tokens)
    python -m bench.copy_contention --device cpu --psi-mb 4 --reps 3 # smoke run (no streams)

At 16384 tokens on an H200 (k22a, k22b, 2026-11-30) calls against psi never took over 4.2 ms of
device time in a ranker without a host tier, and took 9-11 ms (one psi copy to host DRAM lasts
9.75 ms) and up to 29 ms in one with a host tier; the new users' pre-inferences finished after
their calls half again as often. This measures the suspected mechanism alone. A psi-sized copy
(`--psi-mb`) is issued on a copy stream: device -> page-locked host (`to_host`, a demotion) or
back (`to_device`, a reload), whole or in pieces (`--pieces-mb`, the ranker's --copy-piece-mb:
transfer.copy_in_pieces). After `--lead-ms` an operation is issued on the otherwise idle compute
stream. The time from its issue to its end is measured there (CUDA events around it), with the
big copy in flight and with none:

  scores_out  a batch's scores to page-locked host memory (graphs.RankGraphs._launched)
  inputs_in   a batch's staged inputs from page-locked host memory (RankGraphs._stage)
  kv_d2d      a chunk's K/V copied into a psi block on the device, as a memcpy (launch_full, and
              the pre-inference graphs' K/V out)
  kernel      an elementwise kernel over as many bytes (no copy engine)
  scores_then_kernel
              scores_out, then a small kernel on the same stream: whether the stream (the next
              batch, a pre-inference step) waits for the scores' copy
  scores_aside_then_kernel
              the scores copied aside on the device by a kernel and out from there on a stream of
              their own, then the small kernel: whether that frees the compute stream
  inputs_then_kernel
              inputs_in, then the small kernel: whether the stream waits for the inputs' copy
              (behind a reload: a batch's or a pre-inference step's inputs)
  inputs_by_kernel_then_kernel, scores_by_kernel_then_kernel
              the same bytes moved by a kernel through a device view of the page-locked host
              buffer (kernels.host_view: zero-copy, no copy engine), then the small kernel

Big copies `to_host_paced` and `to_device_paced` are issued in pieces of `--paced-pieces-mb` by a
thread that keeps at most `--paced-in-flight` of them queued (it waits for the oldest piece's
event before it queues the next): a small copy then waits behind that many pieces at most.

`added_ms_p50` is the median over the same operation with no copy in flight. Off CUDA everything
runs in turn on the host (no streams): the smoke run exercises the code, its times mean nothing.
The arena is a memfd mapping registered as page-locked, as the ranker maps the expander's.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.host_costs import pinned_arena
from bench.report import RESULTS_DIR, write_result
from kernels.device import Accelerator, DeviceUnavailableError, accelerator
from kernels.host_view import copy_by_kernel, device_view
from services.ranker.transfer import copy_in_pieces
from shared.stats import median, percentile

BIG = ("none", "to_host", "to_device", "to_host_paced", "to_device_paced")
SMALL = (
    "scores_out",
    "inputs_in",
    "kv_d2d",
    "kernel",
    "scores_then_kernel",
    "scores_aside_then_kernel",
    "inputs_then_kernel",
    "inputs_by_kernel_then_kernel",
    "scores_by_kernel_then_kernel",
)
SCORES_BYTES = 8 * 256 * 4  # a batch of 8 calls x 256 candidates, float32
INPUTS_BYTES = 256 << 10  # a batch's staged int64 inputs, about


def _small_ops(acc: Accelerator, kv_bytes: int) -> dict[str, Callable[[], Any]]:
    """Each small operation, issued on the current stream, on buffers allocated once."""
    dev = acc.device
    pin = acc.backend == "cuda"
    scores_dev = torch.ones(SCORES_BYTES // 4, dtype=torch.float32, device=dev)
    scores_host = torch.empty(SCORES_BYTES // 4, dtype=torch.float32, pin_memory=pin)
    inputs_host = torch.ones(INPUTS_BYTES // 8, dtype=torch.int64, pin_memory=pin)
    inputs_dev = torch.empty(INPUTS_BYTES // 8, dtype=torch.int64, device=dev)
    kv_src = torch.ones(kv_bytes // 2, dtype=torch.bfloat16, device=dev)
    kv_dst = torch.empty_like(kv_src)
    aside = torch.empty_like(scores_dev)
    spare = torch.empty_like(
        scores_dev
    )  # the small kernel's output: not `aside`, which a copy may still read
    side = torch.cuda.Stream(dev) if pin else None
    copied_aside = torch.cuda.Event() if pin else None

    def scores_out() -> None:
        scores_host.copy_(scores_dev, non_blocking=pin)

    def kernel() -> None:
        torch.mul(scores_dev, 1.0, out=spare)

    def scores_aside() -> None:
        torch.mul(scores_dev, 1.0, out=aside)  # a kernel: the graph's logits are free again
        if side is None or copied_aside is None:
            scores_host.copy_(aside)
            return
        copied_aside.record()
        side.wait_event(copied_aside)
        with torch.cuda.stream(side):
            scores_host.copy_(aside, non_blocking=True)

    # Device views of the page-locked buffers (None off CUDA: the plain copy stands in).
    inputs_view = device_view(inputs_host, dev)
    scores_view = device_view(scores_host, dev)

    def inputs_by_kernel() -> None:
        if inputs_view is None:
            inputs_dev.copy_(inputs_host)
        else:
            copy_by_kernel(inputs_dev, inputs_view)

    def scores_by_kernel() -> None:
        if scores_view is None:
            scores_host.copy_(scores_dev)
        else:
            copy_by_kernel(scores_view, scores_dev)

    def inputs_in() -> None:
        inputs_dev.copy_(inputs_host, non_blocking=pin)

    def then_kernel(first: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            first()
            kernel()

        return both

    return {
        "scores_out": scores_out,
        "inputs_in": inputs_in,
        "kv_d2d": lambda: kv_dst.copy_(kv_src),
        "kernel": lambda: torch.mul(kv_src, 1.0, out=kv_dst),
        "scores_then_kernel": then_kernel(scores_out),
        "scores_aside_then_kernel": then_kernel(scores_aside),
        "inputs_then_kernel": then_kernel(inputs_in),
        "inputs_by_kernel_then_kernel": then_kernel(inputs_by_kernel),
        "scores_by_kernel_then_kernel": then_kernel(scores_by_kernel),
    }


def issue_paced(
    dst: torch.Tensor, src: torch.Tensor, piece_bytes: int, in_flight: int, stream: torch.cuda.Stream
) -> None:
    """dst <- src in pieces on `stream`, at most `in_flight` of them queued at a time (this
    blocks between pieces: run it on a thread of its own)."""
    queued: deque[torch.cuda.Event] = deque()
    n = src.numel()
    for start in range(0, n, piece_bytes):
        if len(queued) >= in_flight:
            queued.popleft().synchronize()
        end = min(start + piece_bytes, n)
        with torch.cuda.stream(stream):
            dst[start:end].copy_(src[start:end], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        queued.append(done)


def run(args: argparse.Namespace, acc: Accelerator) -> list[dict[str, Any]]:
    cuda = acc.backend == "cuda"
    psi_bytes = int(args.psi_mb * 2**20)
    kv_bytes = int(args.kv_mb * 2**20)
    psi = torch.ones(psi_bytes, dtype=torch.uint8, device=acc.device)
    ops = _small_ops(acc, kv_bytes)
    copy_stream = torch.cuda.Stream(acc.device) if cuda else None
    rows: list[dict[str, Any]] = []
    with pinned_arena(acc, psi_bytes) as host:
        cases = [("none", 0.0)] + [(big, mb) for big in BIG[1:3] for mb in args.pieces_mb]
        if cuda:  # pacing needs streams and events
            cases += [(big, mb) for big in BIG[3:] for mb in args.paced_pieces_mb]
        for big, piece_mb in cases:
            piece_bytes = int(piece_mb * 2**20)

            def issue_big(big: str = big, piece_bytes: int = piece_bytes) -> None:
                if big == "to_host":
                    copy_in_pieces(host, psi, piece_bytes)
                elif big == "to_device":
                    copy_in_pieces(psi, host, piece_bytes)

            def issue_big_paced(big: str = big, piece_bytes: int = piece_bytes) -> threading.Thread:
                assert copy_stream is not None
                dst, src = (host, psi) if big == "to_host_paced" else (psi, host)
                args_ = (dst, src, piece_bytes, args.paced_in_flight, copy_stream)
                pacer = threading.Thread(target=issue_paced, args=args_, daemon=True)
                pacer.start()
                return pacer

            for small in SMALL:
                took, big_took = [], []
                for rep in range(args.reps + 2):  # two warm-up repetitions
                    acc.synchronize()
                    if cuda:
                        assert copy_stream is not None
                        big_start, big_end = (
                            torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True),
                        )
                        start, end = (
                            torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True),
                        )
                        pacer = None
                        with torch.cuda.stream(copy_stream):
                            big_start.record()
                            if big.endswith("_paced"):
                                pacer = issue_big_paced()
                            else:
                                issue_big()
                                big_end.record()
                        time.sleep(args.lead_ms / 1e3)  # the big copy under way
                        start.record()
                        ops[small]()
                        end.record()
                        if pacer is not None:
                            pacer.join()
                            big_end.record(copy_stream)
                        acc.synchronize()
                        ms, big_ms = start.elapsed_time(end), big_start.elapsed_time(big_end)
                    else:
                        b0 = time.perf_counter()
                        issue_big()
                        t0 = time.perf_counter()
                        ops[small]()
                        ms, big_ms = (time.perf_counter() - t0) * 1e3, (t0 - b0) * 1e3
                    if rep >= 2:
                        took.append(ms)
                        big_took.append(big_ms)
                rows.append({
                    "big": big, "piece_mb": piece_mb, "small": small, "ms_p50": median(took),
                    "ms_p90": percentile(took, 90), "ms_max": max(took),
                    "big_copy_ms_p50": median(big_took) if big != "none" else 0.0, "reps": args.reps,
                })  # fmt: skip
                r = rows[-1]
                print(f"{big:9s} pieces {piece_mb:6g} MiB  {small:10s}  p50 {r['ms_p50']:8.3f} ms  "
                      f"p90 {r['ms_p90']:8.3f}  max {r['ms_max']:8.3f}  (big copy {r['big_copy_ms_p50']:.2f} ms)",
                      flush=True)  # fmt: skip
    alone = {r["small"]: r["ms_p50"] for r in rows if r["big"] == "none"}
    for r in rows:
        r["added_ms_p50"] = r["ms_p50"] - alone[r["small"]]
        r.update(device=acc.name, psi_bytes=psi_bytes, kv_bytes=kv_bytes, lead_ms=args.lead_ms)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--psi-mb", type=float, default=512.0, help="the big copy (512: 16384 tokens, bench preset)"
    )
    p.add_argument("--pieces-mb", type=float, nargs="+", default=[0.0, 16.0, 64.0],
                   help="piece sizes of the big copy (0: one copy)")  # fmt: skip
    p.add_argument("--paced-pieces-mb", type=float, nargs="+", default=[16.0, 4.0],
                   help="piece sizes of the paced big copies (CUDA)")  # fmt: skip
    p.add_argument("--paced-in-flight", type=int, default=2,
                   help="pieces a paced big copy keeps queued at most")  # fmt: skip
    p.add_argument(
        "--kv-mb", type=float, default=32.0, help="kv_d2d's and kernel's bytes (32: a 1024-token chunk)"
    )
    p.add_argument(
        "--lead-ms", type=float, default=1.0, help="the big copy's start ahead of the small operation"
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps: at least 1")
    if args.psi_mb <= 0 or args.kv_mb <= 0:
        p.error("--psi-mb and --kv-mb: more than 0")
    if any(mb < 0 for mb in args.pieces_mb):
        p.error("--pieces-mb: 0 (one copy) or more")
    if any(mb <= 0 for mb in args.paced_pieces_mb):
        p.error("--paced-pieces-mb: more than 0")
    if args.paced_in_flight < 1:
        p.error("--paced-in-flight: at least 1")
    if args.lead_ms < 0:
        p.error("--lead-ms: 0 or more")
    try:
        acc = accelerator(args.device)
    except (ValueError, DeviceUnavailableError) as exc:
        p.error(f"--device: {exc}")
    rows = run(args, acc)
    config = {k: v for k, v in vars(args).items() if k != "out_dir"}
    columns = [
        "big",
        "piece_mb",
        "small",
        "ms_p50",
        "ms_p90",
        "ms_max",
        "added_ms_p50",
        "big_copy_ms_p50",
        "reps",
    ]
    for path in write_result("copy-contention", config, rows, columns, out_dir=args.out_dir, tag=args.tag):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
