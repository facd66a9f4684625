"""What planning one step of the device loop costs, by how many ranking calls are queued.

    python -m bench.plan_cost                 # depths 1-1024, 0.5 s a depth
    python -m bench.plan_cost --seconds 0.1   # quicker

Near its limit a ranker's queue fills in a burst (k14b, H200, mix: ~250 calls). While a step's
planning grew with the queue, the backlog lowered the rate it drained at and the ranker
collapsed (services/ranker/rank_queue.py). This times IterationScheduler.plan over a backlog like
that one (calls arriving at --rate over the last depth / rate seconds, the older ones past their
SLO, 15% against psi, the rest full rankings of the length mix's sizes; step costs as an H200
ranker fitted them), two ways:

  queue  the engine's way: one RankQueue kept across steps, each step planned from its window
         (the first step finds the doomed calls; the ones after it are what the loop pays);
  list   every queued call handed in afresh at each step and queued anew: a cost that grows
         with the backlog, as the loop's did before the queue (it rebuilt every call's RankItem
         and filtered, sorted and costed them all: ~0.5 ms a step at 244 queued here).

Planning is host work on the loop's thread: the figures are this machine's (the H200 lease's
host ran the loop's planning several times slower than the build machine; compare depths within
one run).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import RESULTS_DIR, machine, write_result
from services.ranker.call_cost import CostFit, CostPrior
from services.ranker.rank_queue import RankQueue
from services.ranker.scheduler import IterationScheduler, PreinferItem, RankItem, RankKind, SchedulerConfig

# The ranking fit of an H200 ranker on the length mix (k14a's log: preinfer_graph_steps_calibrated).
PER_BATCH_S, PER_TOKEN_S, PER_PAIR_S = 0.521e-3, 0.3814e-6, 0.01404e-9
MIX_LENGTHS = (136, 320, 477, 1000, 2000, 4096, 8192, 12000)


def backlog(depth: int, rate_rps: float, slo_s: float, now: float, seed: int) -> list[RankItem]:
    rng = random.Random(seed)
    calls = []
    for i in range(depth):
        arrived = now - (depth - i) / rate_rps
        cached = rng.random() < 0.15
        prefix = rng.choice(MIX_LENGTHS)
        tokens = 320 if cached else prefix + 320
        calls.append(
            RankItem(
                i,
                RankKind.CACHED if cached else RankKind.FULL,
                arrived + 0.6 * slo_s,
                arrived,
                tokens,
                0 if cached else prefix * tokens,
                start_by=arrived + 2.5,
                due_by=arrived + slo_s,
            )
        )
    return calls


def time_steps(plan_step: Callable[[], object], seconds: float) -> float:
    """Mean seconds of plan_step() over about `seconds`."""
    plan_step()  # the first step (the queue finds its doomed calls once)
    n, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        plan_step()
        n += 1
    return (time.perf_counter() - began) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--rate", type=float, default=400.0, help="the backlog's arrival rate, req/s")
    p.add_argument("--slo-ms", type=float, default=50.0)
    p.add_argument("--seconds", type=float, default=0.5, help="timed per depth and way")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if min(args.depths) < 1 or args.rate <= 0 or args.slo_ms <= 0 or args.seconds <= 0:
        p.error("depths, --rate, --slo-ms and --seconds must be positive")
    fit = CostFit(
        CostPrior(
            per_batch_s=PER_BATCH_S, per_token_s=PER_TOKEN_S, per_pair_s=PER_PAIR_S, pairs_measured=True
        )
    )
    scheduler = IterationScheduler(SchedulerConfig(), fit, full_replays=lambda tokens: len(tokens) == 1)
    now = 1000.0
    preinfers = [PreinferItem(10_000 + i, 4096, 0, now - 0.01, need_by=now + 0.1) for i in range(3)]
    rows = []
    for depth in args.depths:
        calls = backlog(depth, args.rate, args.slo_ms / 1e3, now, args.seed)
        queue = RankQueue(calls)
        per_way = {
            "queue": time_steps(functools.partial(scheduler.plan, now, queue, preinfers), args.seconds),
            "list": time_steps(functools.partial(scheduler.plan, now, calls, preinfers), args.seconds),
        }
        doomed = sum(scheduler.doomed(now, c) for c in calls)
        rows.append(
            {
                "queued": depth,
                "doomed": doomed,
                "queue_us": round(per_way["queue"] * 1e6, 1),
                "list_us": round(per_way["list"] * 1e6, 1),
            }
        )
        print(f"{depth:6d} queued ({doomed:4d} doomed): queue {rows[-1]['queue_us']:8.1f} us a step, "
              f"list {rows[-1]['list_us']:8.1f} us", flush=True)  # fmt: skip
    config = {"rate_rps": args.rate, "slo_ms": args.slo_ms, "seconds": args.seconds, "seed": args.seed,
              "fit": {"per_batch_s": PER_BATCH_S, "per_token_s": PER_TOKEN_S, "per_pair_s": PER_PAIR_S}}  # fmt: skip
    info = machine()
    header = "\n\n".join(__doc__.split("\n\n")[2:4]) + "\n\n"
    for path in write_result("plan-cost", config, rows, ["queued", "doomed", "queue_us", "list_us"],
                             out_dir=args.out_dir, tag=args.tag, header=header, info=info):  # fmt: skip
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
