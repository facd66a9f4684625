"""What the relay cache's bookkeeping costs the ranker's event loop per call, with HBM full.

    python -m bench.cache_costs                                  # the length mix's psi, 120 GB
    python -m bench.cache_costs --psi-mib 128 --budget-mib 120000  # every prefix 4096 tokens

The event loop that decodes and answers ranking calls also runs the cache policy (admission,
eviction, demotion under pressure, leases), and it shares the interpreter with the device loop:
its time per call is part of the ranker's host time, which bounds the relay on an H200 (k12c).
Two walks of the whole cache per call hid there until a replay like this one timed them
(2026-11-29: declined demotion candidates re-weighed on every admission and consumption, 0.33-0.62
ms a call; eviction walking every consumed psi to reach hot copies, 0.67 ms an admission).

It fills an HbmCache to its budget with consumed psi of --psi-mib each, one in --demoted-every
of them copied to host DRAM and read again (hot copies at the recent end, as a ranker keeping
demoted psi has them), under a RelayCache whose demotion gate is closed (copies measured not to
pay, as on the mix) and keep gate open, and times on this thread (wall and thread CPU, median
and p90 over --reps):

  admit_keep      a full ranking's psi admitted (evicting for its room) and consumed by its
                  call: what keeping psi costs the event loop beyond the ranking
  hit             a call's claim of a resident hot copy and its consumption afterwards
  demote_ahead    the demotion decision after an admission or consumption, alone
  expire          the lease expiry pass (every 50 ms), with one leased psi waiting

The device figures the gates weigh (a copy's host time, a read's device saving) are inputs
here, fixed at k12c's measurements (--copy-ms, --saving-ms): the subject is the cache's own
bookkeeping, not the device. Writes bench/results/cache-costs-<machine>[-tag].json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from bench.report import RESULTS_DIR, write_result
from services.ranker.cost_model import CostModel
from services.ranker.demotion_gate import DemotionGate
from services.ranker.engine import Engine
from services.ranker.hbm_cache import Claim, HbmCache, Lease
from services.ranker.host_tier import HostTier
from services.ranker.keep_gate import KeepGate
from services.ranker.psi import PsiKey
from services.ranker.relay_cache import RelayCache
from shared.modelspec import preset
from shared.stats import median, percentile

MIB = 2**20
FAR = 1e12  # a lease deadline that never comes


class _DeviceFigures:
    """The two measured figures the relay cache asks the engine for on these paths, fixed: what
    a psi copy costs the device loop's host, and what reading psi saves a call's device time."""

    def __init__(self, copy_ms: float, saving_ms: float) -> None:
        self._copy_ms, self._saving_s = copy_ms, saving_ms / 1e3

    def host_ms_per_copy(self) -> float:
        return self._copy_ms

    def reload_saving_s(self, prefix_len: int, suffix_len: int) -> float:
        return self._saving_s


class _HostIndex:
    """A connected host tier whose index holds none of these users."""

    connected = True

    def may_hold(self, key: PsiKey) -> bool:
        return False

    def stored_nbytes(self, prefix_len: int) -> int | None:
        return None  # psi as HBM holds it


def _key(user: int) -> PsiKey:
    # user_id % 8 == 1: never in the demotion gate's sample, so every candidate is declined.
    return PsiKey(user * 8 + 1, 1, "bench", user)


def build(
    budget_mib: int,
    psi_mib: int,
    demoted_every: int,
    copy_ms: float,
    saving_ms: float,
    h2d_gbps: float = 54.0,
) -> RelayCache:
    """A relay cache over a full HBM cache of consumed psi (module docstring)."""
    clock = itertools.count()  # strictly increasing uses: the orders are exact
    cache = HbmCache(budget_mib * MIB, lambda: float(next(clock)))
    gate = DemotionGate(min_demotions=1)
    gate.demoted()  # measured: no reload per copy, so the gate declines
    relay = RelayCache(
        cache,
        cast(Engine, _DeviceFigures(copy_ms, saving_ms)),
        # The reload decision's link (k25: 54 GB/s on an H200): the demotion decision first asks
        # whether a reload could ever pay for each candidate (CostModel.may_reload).
        CostModel(preset("bench"), assumed_tflops=200.0, h2d_gbps=h2d_gbps),
        lambda tokens: tokens * MIB,
        lambda coro, name: None,  # type: ignore[arg-type, return-value]
        join_margin_ms=2.0,
        keep_demoted=True,
        demotion_reserve_bytes=int(0.05 * cache.budget_bytes),
        demotion_gate=gate,
        keep_gate=KeepGate(),
    )
    relay.host = cast(HostTier, _HostIndex())
    users = budget_mib // psi_mib
    for user in range(users):
        key = _key(user)
        cache.admit(key, psi_mib * MIB, Lease("fill", FAR), "ranking")
        cache.produced(key, object())
        cache.claim(key)
        cache.unpin(key)
    for user in range(0, users, demoted_every) if demoted_every else ():  # copied, then read again
        key = _key(user)
        cache.pin_for_copy(key)
        cache.demoted(key, ok=True, keep=True)
        cache.claim(key)
        cache.unpin(key)
    return relay


def timed(step: Callable[[], object], reps: int) -> dict[str, float]:
    walls, cpus = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.thread_time()
        step()
        cpus.append((time.thread_time() - cpu) * 1e6)
        walls.append((time.perf_counter() - wall) * 1e6)
    return {
        "wall_us_p50": median(walls),
        "wall_us_p90": percentile(walls, 90),
        "cpu_us_p50": median(cpus),
        "cpu_us_p90": percentile(cpus, 90),
    }


def hot_copies(budget_mib: int, psi_mib: int, demoted_every: int) -> list[PsiKey]:
    """The keys build() made hot copies read again (none for demoted_every 0)."""
    return [_key(user) for user in range(0, budget_mib // psi_mib, demoted_every)] if demoted_every else []


def measure(relay: RelayCache, psi_mib: int, reps: int, hot: list[PsiKey]) -> list[dict[str, Any]]:
    """Each operation's time on this thread (module docstring); hits read `hot`, else the most
    recently consumed psi."""
    cache = relay.cache
    fresh = itertools.count(10**9)
    hits = itertools.cycle(hot or [_key(user) for user in range(max(0, len(cache) - 64), len(cache))])

    def admit_keep() -> None:
        key = _key(next(fresh))
        relay._admit(key, psi_mib * MIB, Lease("call", FAR), "ranking")
        cache.produced(key, object())
        cache.claim(key)
        cache.unpin(key)
        relay._after_consume(key)

    def hit() -> None:
        key = next(hits)
        if cache.lookup(key) is None:
            return
        assert cache.claim(key).outcome is Claim.HIT
        cache.unpin(key)
        relay._after_consume(key)

    waiting = _key(next(fresh))  # a pre-inference's psi waiting for its call: expire looks at it
    relay._admit(waiting, psi_mib * MIB, Lease("signal", FAR), "compute")
    cache.produced(waiting, object())
    steps: list[tuple[str, Callable[[], object]]] = [
        ("admit_keep", admit_keep), ("hit", hit), ("demote_ahead", relay.demote_ahead), ("expire", relay.expire),
    ]  # fmt: skip
    return [{"op": op, **timed(step, reps), "entries": len(cache), "reps": reps} for op, step in steps]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-mib", type=int, default=120_000, help="the HBM budget for psi")
    p.add_argument(
        "--psi-mib", type=int, default=45, help="each psi (45: the length mix's mean, bench preset)"
    )
    p.add_argument("--demoted-every", type=int, default=8,
                   help="the second case: one psi in this many is a hot copy read again (the first: none)")  # fmt: skip
    p.add_argument(
        "--copy-ms", type=float, default=0.3, help="a copy's host time, as the device loop measures it"
    )
    p.add_argument(
        "--saving-ms", type=float, default=1.6, help="a read's device saving, as the engine measures it"
    )
    p.add_argument("--h2d-gbps", type=float, default=54.0,
                   help="the host-to-device link the reload decision prices a copy at (H200, k25)")  # fmt: skip
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.psi_mib < 1 or args.budget_mib < 4 * args.psi_mib:
        p.error("--psi-mib must be >= 1 and --budget-mib hold at least 4 psi")
    if args.reps < 1 or args.demoted_every < 1 or args.copy_ms < 0 or args.saving_ms < 0:
        p.error("--reps and --demoted-every must be >= 1, --copy-ms and --saving-ms >= 0")
    rows: list[dict[str, Any]] = []
    # No hot copies: nothing covers the demotion reserve, and every admission and consumption
    # asks the closed gate (the mix on an H200); then one psi in --demoted-every a hot copy read
    # again (a gate that copied, or an earlier workload), which covers it.
    for every in (0, args.demoted_every):
        relay = build(args.budget_mib, args.psi_mib, every, args.copy_ms, args.saving_ms, args.h2d_gbps)
        hot = hot_copies(args.budget_mib, args.psi_mib, every)
        case = f"1 in {every}" if every else "none"
        rows += [{"hot_copies": case, **row} for row in measure(relay, args.psi_mib, args.reps, hot)]
    names = ("budget_mib", "psi_mib", "demoted_every", "copy_ms", "saving_ms", "reps")
    json_path, md_path = write_result(
        "cache-costs", {k: getattr(args, k) for k in names}, rows,
        ["hot_copies", "op", "wall_us_p50", "wall_us_p90", "cpu_us_p50", "cpu_us_p90", "entries"],
        out_dir=args.out_dir, tag=args.tag,
        header=f"HBM budget {args.budget_mib} MiB, full of psi of {args.psi_mib} MiB; demotion gate "
        f"closed. Event-loop time per operation (us), over {args.reps} repetitions.\n\n",
    )  # fmt: skip
    print(md_path.read_text())
    print(f"wrote {json_path} {md_path}")


if __name__ == "__main__":
    main()
