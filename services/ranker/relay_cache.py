"""The relay cache: where a ranking call's psi comes from, and what happens to psi afterwards. One
object owns the cache policy over the HBM cache (services/ranker/hbm_cache.py: budget, leases,
entry states) and the host-DRAM tier (services/ranker/host_tier.py); the engine owns the device.

  produce   a PreInfer signal's psi: admitted under a lease, then reloaded from host DRAM when the
            cost model says that beats recomputing, else pre-inferred by the engine (in chunks);
  claim     a ranking call's psi: resident (HBM_HIT), being pre-inferred here (the engine joins
            it or takes it over: INFLIGHT_JOIN, PARTIAL_PREFIX, or FULL_RECOMPUTE when nothing
            was built yet: psi is still produced by the call), being reloaded (join the reload
            within the deadline: INFLIGHT_JOIN), in host DRAM (reload when that beats
            recomputing: DRAM_RELOAD), else the whole sequence (FULL_RECOMPUTE), which also
            leaves its prefix's psi when rankings keep psi (below);
  convert   a consumed psi's lease ends (RESIDENT -> CONSUMED) and it stays as an evictable hot
            copy; with a host tier it is demoted to host DRAM (below);
  expire    leased psi nobody consumed before its deadline (its device time counts as unused).

Rankings keep psi (`ranking_psi_min_tokens` > 0): a full recompute of a prefix that long is
admitted into the HBM cache like a pre-inference and writes the prefix's K/V into a psi block in
the same pass (engine.rank_full(keep_psi=True)); the psi is then consumed by that call and goes
the way of any consumed psi (demoted to host DRAM, kept as a hot copy). Why: the full ranking
computes exactly the K/V a pre-inference would; dropping them made every returning user's
prefix computed twice, and a pre-inference only to keep them costs the device a pre-inference
plus a call against psi where one full ranking does (issue "Relay never loses", GPU runs of
2026-11-27: P 3.8 + C 1.6 ms against F 4.3 ms at 4096 tokens on an H100).

Demotion (copy to host DRAM, off the critical path, after the reply is sent):
  * under pressure (default): once admitting `demotion_reserve_bytes` more psi would evict
    entries without a host copy, the least recently used consumed psi are copied first
    (HbmCache.demotion_candidates); eviction takes DEMOTED entries first, so DRAM receives what
    HBM is about to drop and the two tiers' capacities add up. Measured on H100 leases
    (2026-11-27, L4096): with every consumed psi copied at once, a 40 GiB arena beside a 60 GB
    HBM budget held only psi still in HBM and served no reload in any point;
  * on consumption (`demote_under_pressure` False): every consumed psi is copied at once; DRAM
    then duplicates HBM and adds capacity only where it is larger.
Under pressure, a `demotion_gate` (services/ranker/demotion_gate.py; the default) copies a
candidate only while the tier earns its copies: reloads per demotion (measured) times the device
time a reload saves against the host time a copy costs (the device loop's issue and the event
loop's own steps, `host_ms_per_demotion`); otherwise one candidate in its sample,
and the rest are evicted without a copy. On an H200 with 120 GB of HBM beside a 64 GiB arena,
the length mix made ~2000 demotions a point and 0-5 reloads. Before the gate is asked, a
candidate whose reload the reload decision would never choose (its copy slower than 1.5x what it
saves: CostModel.may_reload) is evicted without a copy, whatever the gate says: on the mix (k25b)
~660- and ~1600-token psi took 0.6 and 1.2 ms to copy back and saved 0.2 and 0.8.

Shedding (`host_pressed`, services/ranker/loop_lag.py): while the event loop is behind, full
rankings keep no psi and no psi is copied to DRAM. Both are work the baseline does not do, paid
on the host that then binds, for a return that comes later if at all.

Every cached path is an optimisation: any failure falls back to ranking the whole sequence. Only
bad input (the caller's) and Overdue (the call's admission budget ran out) propagate, and a
device out of memory twice: an allocation the device refuses (the processes sharing it take more
than the budget left them) lowers the HBM budget and frees psi (`_device_memory_short`), a full
ranking whose psi block is refused answers without keeping it, and a refused full pass runs once
more before the error reaches the caller.

Driven from one asyncio loop (like the HBM cache it wraps). Testable on the CPU without gRPC:
tests/unit/test_relay_cache.py runs it over a real engine and cache, without a host tier.
`on_event(kind, label)` reports what the service counts: ("reload_decision", reason),
("reload", "ok" | "failed"), ("fallback", reason), ("demotion", "ok" | "failed" | "skipped" |
"shed"), ("ranking_psi", "kept" | "declined" | "shed"), ("device_memory_short", path),
("content_mismatch", ""), ("prefetch", "issued" | "used" | "wasted" | "failed").

A prefetch is a PreInfer signal answered by a reload from host DRAM (psi already computed once,
brought back ahead of its ranking call): `used` when a ranking call then reads that psi (a hit
or a join), `wasted` when its lease ends unconsumed, `failed` when the reload failed (the psi is
then pre-inferred instead).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from services.ranker.copy_stages import RELOAD_PATH_STAGES, CopyStages
from services.ranker.cost_model import CostModel
from services.ranker.demotion_gate import DemotionGate
from services.ranker.engine import Engine, NonFiniteScores, Overdue, PreinferExpired, RankResult
from services.ranker.hbm_cache import Admission, AdmitResult, Claim, ClaimResult, HbmCache, Lease
from services.ranker.keep_gate import KeepGate, probed
from services.ranker.psi import Psi, PsiKey
from services.ranker.sequences import RankingSuffix, UserPrefix
from services.ranker.task_cpu import CpuMeter, metered
from services.ranker.wire import FallbackPrefix, PrefixReference, PrefixRequired
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.ranker.host_tier import HostTier

log = get_logger("ranker.relay_cache")

_MAX_PREFETCHED = 100_000  # prefetched keys awaiting an outcome (each ends used, wasted or failed)

Spawn = Callable[[Awaitable[None], str], "asyncio.Task[None]"]
OnEvent = Callable[[str, str], None]
# Registers work to run once the reply has been sent (gRPC's done callback).
AfterReply = Callable[[Callable[[Any], None]], None]


class Served(enum.StrEnum):
    HBM_HIT = "hbm_hit"
    INFLIGHT_JOIN = "inflight_join"
    PARTIAL_PREFIX = "partial_prefix"
    DRAM_RELOAD = "dram_reload"
    FULL_RECOMPUTE = "full_recompute"


class Produce(enum.Enum):
    """What a PreInfer signal started (or found)."""

    ACCEPTED = "accepted"  # pre-inference started
    RELOAD_SCHEDULED = "reload_scheduled"  # reload from host DRAM started
    ALREADY_RESIDENT = "already_resident"
    ALREADY_PRODUCING = "already_producing"
    REFUSED = "refused"


@dataclass(frozen=True)
class Ranked:
    """A ranking call's answer and where it came from. `prefix_reused`: the fraction of the
    prefix's tokens read from psi rather than computed."""

    served: Served
    result: RankResult
    cache_ms: float  # lookup, waiting for an in-flight psi, reload
    prefix_reused: float


@dataclass
class PrefetchCounts:
    """Since start (module docstring): reloads ahead of the call, and what became of them."""

    issued: int = 0
    used: int = 0
    wasted: int = 0
    failed: int = 0


@dataclass
class _Production:
    """A psi being produced (pre-inference or reload); ranking calls wait on `done`."""

    done: asyncio.Event
    reload: bool
    task: asyncio.Task[None] | None = None
    compute_fallback: bool = True  # a failed reload is pre-inferred instead (not for a prefetch-only signal)
    # Its lease's end (time.monotonic()): a pre-inference not started by then is dropped.
    expires_at: float = math.inf
    # When its ranking call is due (time.monotonic()): pre-inferences are built in this order.
    need_by: float = math.inf
    # A call's reload: time.perf_counter() at each step, for the reload path's stages
    # (RELOAD_PATH_STAGES): decided, started, acquired, copied, done.
    stamps: dict[str, float] | None = None


class RecentIds:
    """The request ids seen in the last `ttl_s` seconds (at most `max_ids`, the oldest dropped
    first): which ranking calls have arrived, for the signals that come after them."""

    def __init__(
        self, ttl_s: float, max_ids: int = 200_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl_s, self._max_ids, self._clock = ttl_s, max_ids, clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    def add(self, request_id: str) -> None:
        if not request_id:
            return  # an id-less call cannot be matched to its signal
        now = self._clock()
        self._seen[request_id] = now
        self._seen.move_to_end(request_id)
        while self._seen and (
            len(self._seen) > self._max_ids or next(iter(self._seen.values())) < now - self._ttl_s
        ):
            self._seen.popitem(last=False)

    def seen(self, request_id: str) -> bool:
        at = self._seen.get(request_id) if request_id else None
        return at is not None and at >= self._clock() - self._ttl_s

    def __len__(self) -> int:
        return len(self._seen)


class RelayCache:
    def __init__(
        self,
        cache: HbmCache,
        engine: Engine,
        costs: CostModel,
        psi_bytes: Callable[[int], int],
        spawn: Spawn,
        *,
        join_margin_ms: float,
        keep_demoted: bool,
        on_event: OnEvent = lambda kind, label: None,
        ranking_psi_min_tokens: int = 0,
        demote_under_pressure: bool = True,
        demotion_reserve_bytes: int = 0,
        demotion_gate: DemotionGate | None = None,
        keep_gate: KeepGate | None = None,
        host_pressed: Callable[[], bool] | None = None,
        arrived_ttl_s: float = 60.0,
        psi_footprint: Callable[[int], int] | None = None,
    ) -> None:
        """`ranking_psi_min_tokens`: full rankings of prefixes at least this long keep their
        psi; `demote_under_pressure`, `demotion_reserve_bytes`, `demotion_gate`: when consumed
        psi is copied to host DRAM, and whether (module docstring; no gate: every candidate is);
        `keep_gate`: whether a full ranking of a prefix that long keeps psi (no gate: every one
        does); `host_pressed`: while it says so, neither (services/ranker/loop_lag.py: the
        event loop is behind, and the relay sheds the work it may skip);
        `arrived_ttl_s`: how long a ranking call's arrival is remembered, to refuse the signal
        of its request that comes after it. `psi_footprint`: the HBM bytes a psi of that many
        tokens takes where the ranker allocates psi in size classes (psi.PsiSizeClasses; default
        `psi_bytes`): what the HBM budget counts. The cache's entries then hold class bytes, and
        the tokens read back from them (a reload's saving, its size in host DRAM) are up to the
        classes' ratio too many."""
        self.cache = cache
        self.engine = engine
        self.costs = costs
        self.host: HostTier | None = None  # attached once connected (RankerService.start)
        self._psi_bytes = psi_bytes
        self._psi_footprint = psi_footprint if psi_footprint is not None else psi_bytes
        self._spawn = spawn
        self._join_margin_ms = join_margin_ms
        self._keep_demoted = keep_demoted
        self._on_event = on_event
        self.ranking_psi_min_tokens = max(0, ranking_psi_min_tokens)
        self._demote_under_pressure = demote_under_pressure
        self._demotion_reserve_bytes = max(0, demotion_reserve_bytes)
        self._demoting: dict[PsiKey, int] = {}  # copies to host DRAM under way: bytes
        self.demotion_gate = demotion_gate
        self.keep_gate = keep_gate
        self._host_pressed = host_pressed
        self.ranking_psi_declined = 0  # full rankings the keep gate ranked without keeping psi
        self.ranking_psi_probed = 0  # left unkept so that a keep's device time stays measurable
        self.ranking_psi_shed = 0  # full rankings that kept no psi while the host was pressed
        self.demotions_shed = 0  # candidates not copied while the host was pressed
        self._keep_loop_cpu_s = 0.0  # the event loop's CPU keeping psi (admission, production, lease)
        self._keep_loop_timed = 0
        self.demotion_cpu = CpuMeter()  # the event loop's CPU copying psi to host DRAM
        self._suffix_tokens = 0.0  # recent calls' suffix length (mean): what a reload would save
        self.demotions_skipped = 0  # candidates the gate did not copy (evicted without a copy)
        self.demotions_never_reloaded = 0  # candidates no reload would take back: not copied
        self._decisions_logged: collections.Counter[str] = collections.Counter()  # reload choices, by reason
        self._largest_admitted = 0  # bytes of the largest psi admitted: the reserve's floor
        self.psi_from_rankings = 0  # full rankings whose psi entered the cache
        self._productions: dict[PsiKey, _Production] = {}
        self.reloads = 0
        self.device_memory_short = 0  # allocations the device refused (out of memory), all paths
        self._budget_lowered_at = -math.inf  # cache clock
        self.late_signals = 0  # PreInfer signals refused: their ranking call had come already
        self._arrived = RecentIds(ttl_s=arrived_ttl_s)
        self.content_mismatches = 0
        self.prefetches = PrefetchCounts()
        self._prefetched: set[PsiKey] = set()  # reloaded ahead of their call, not yet read
        # decided -> copied to host DRAM (ms), recent window: at consumption (eager demotion),
        # or when HBM needs the room (under pressure)
        self.demotion_lag_ms: collections.deque[float] = collections.deque(maxlen=512)
        # A ranking call's reload, miss to resumed, by stage (work "call"; copy_stages.py).
        self.reload_path = CopyStages(RELOAD_PATH_STAGES)

    @property
    def host_usable(self) -> bool:
        return self.host is not None and self.host.connected

    # ------------------------------------------------------------------ produce

    async def produce(
        self,
        key: PsiKey,
        prefix: FallbackPrefix,
        lease: Lease,
        prefetch_only: bool = False,
        need_by: float = math.inf,
    ) -> tuple[Produce, str]:
        """A PreInfer signal: admits psi under `lease` and starts producing it. Returns the
        outcome and, when refused, the reason. `prefetch_only`: only psi already held comes
        back (re-leased in HBM, or reloaded from host DRAM, whatever the cost model says of a
        reload: it runs off the critical path); refused with "not_held" otherwise, and never
        pre-inferred, not even when the reload fails. `need_by` (time.monotonic()): when its
        ranking call is due; the engine builds the psi needed soonest first."""
        if self._arrived.seen(lease.owner):
            # Its ranking call came first (a signal delayed on its way: after an overload the
            # signal path's backlog drains for seconds) and ranked without psi: built now,
            # nothing would read it, and the device time would delay the calls still to come.
            self.late_signals += 1
            self._on_event("late_signal", "")
            return Produce.REFUSED, "call_arrived"
        if prefetch_only and self.cache.lookup(key) is None:
            held = await self.host.lookup(key) if self.host is not None and self.host.connected else None
            if held is None:
                return Produce.REFUSED, "not_held"
        admitted = self._admit(key, self._psi_footprint(prefix.length), lease)
        if admitted.outcome is Admission.REFUSED:
            return Produce.REFUSED, admitted.reason
        if admitted.outcome is Admission.ALREADY_RESIDENT:
            return Produce.ALREADY_RESIDENT, ""
        if admitted.outcome is Admission.ALREADY_PRODUCING:
            return Produce.ALREADY_PRODUCING, ""
        reload = prefetch_only
        if not prefetch_only and self.host is not None and self.host.connected:
            nbytes = await self.host.lookup(key)
            if nbytes is not None:
                busy = self.engine.rank_queue_depth > 0 or self.engine.preinfer_backlog > 0
                decision = self.costs.choose(nbytes, prefix.length, busy)
                self._on_event("reload_decision", decision.reason)
                reload = decision.reload
        if reload:
            self.prefetches.issued += 1
            if len(self._prefetched) > _MAX_PREFETCHED:
                self._prefetched.clear()  # a bound, not an LRU: missed outcomes only skew counts
            self._prefetched.add(key)
            self._on_event("prefetch", "issued")
        # The lease is on the cache's clock, the engine's on time.monotonic().
        expires_at = time.monotonic() + (lease.deadline - self.cache.clock())
        self._start(
            key, prefix, reload, compute_fallback=not prefetch_only, expires_at=expires_at, need_by=need_by
        )
        return (Produce.RELOAD_SCHEDULED if reload else Produce.ACCEPTED), ""

    def _start(
        self,
        key: PsiKey,
        prefix: FallbackPrefix,
        reload: bool,
        compute_fallback: bool = True,
        expires_at: float = math.inf,
        need_by: float = math.inf,
        stamps: dict[str, float] | None = None,
    ) -> None:
        production = _Production(
            asyncio.Event(), reload, compute_fallback=compute_fallback, expires_at=expires_at, need_by=need_by,
            stamps=stamps,
        )  # fmt: skip
        self._productions[key] = production
        name = f"{'reload' if reload else 'produce'}-{key.user_id}"
        production.task = self._spawn(self._produce(key, prefix, production), name)

    async def _produce(self, key: PsiKey, prefix: FallbackPrefix, production: _Production) -> None:
        psi: Psi | None = None
        try:
            stamps = production.stamps
            if stamps is not None:
                stamps["started"] = time.perf_counter()
            if production.reload and self.host is not None:
                # The rate is learnt from the copy's device time. Its wall time also holds the
                # expander's round trips and the wait for the engine's loop (up to a ranking
                # batch): learnt from that, the estimate fell with load until every reload was
                # judged dearer than a recompute, and with no reload left to measure it never
                # came back (H100, L4096: 2.8 -> 5.2 ms for 128 MiB within a second, then 0 of
                # 700 psis found in DRAM reloaded).
                psi = await self.host.reload(
                    key,
                    self.engine,
                    on_copied=self._observe_reload,
                    on_acquired=None
                    if stamps is None
                    else (lambda: stamps.__setitem__("acquired", time.perf_counter())),
                )
                if stamps is not None:
                    stamps["copied"] = time.perf_counter()
                self._on_event("reload", "ok" if psi is not None else "failed")
                self.reloads += psi is not None
                if psi is not None and self.demotion_gate is not None:
                    self.demotion_gate.reloaded()
                if psi is None:
                    self._on_event("fallback", "reload_failed")
                    self._settle_prefetch(key, "failed")
            if psi is None and not production.compute_fallback:
                self.cache.production_failed(key)  # nothing held after all: its call ranks in full
                return
            if psi is None:
                t0 = time.perf_counter()
                psi = await self.engine.preinfer(
                    prefix.tensors(), expires_at=production.expires_at, need_by=production.need_by
                )
                self.costs.observe_preinfer(prefix.length, (time.perf_counter() - t0) * 1e3)
            if not self.cache.produced(key, psi):
                log.debug("psi_dropped", user=key.user_id, reason="entry gone before production finished")
                self._settle_prefetch(key, "wasted")  # its lease ended while it was being reloaded
        except PreinferExpired:
            # Not started within its lease: its call came and went (it ranked without psi).
            self.cache.production_failed(key)
            self._on_event("preinfer_expired", "")
        except PrefixRequired:
            # A reload for a call by reference failed, and there are no tokens to compute from:
            # its call answers prefix_required and comes back with the prefix.
            self.cache.production_failed(key)
            self._settle_prefetch(key, "failed")
        except Exception as exc:
            log.warning("production_failed", user=key.user_id, error=repr(exc))
            self.cache.production_failed(key)
            self._settle_prefetch(key, "failed")
            self._if_out_of_memory(exc, prefix.length, "reload" if production.reload else "preinfer")
        finally:
            if production.stamps is not None and psi is not None:
                production.stamps["done"] = time.perf_counter()
            production.done.set()
            if self._productions.get(key) is production:
                del self._productions[key]

    def _settle_prefetch(self, key: PsiKey, outcome: str) -> None:
        """A prefetched psi's outcome ("used", "wasted" or "failed"), counted once; nothing for a
        key that was not prefetched or is settled already."""
        if key in self._prefetched:
            self._prefetched.discard(key)
            setattr(self.prefetches, outcome, getattr(self.prefetches, outcome) + 1)
            self._on_event("prefetch", outcome)

    # ------------------------------------------------------------------ claim

    async def rank(
        self,
        key: PsiKey,
        request_id: str,
        prefix: FallbackPrefix,
        suffix: RankingSuffix,
        deadline: float,
        after_reply: AfterReply,
        start_by: float = float("inf"),
    ) -> Ranked:
        """Scores one ranking call by the cheapest path its psi allows (module docstring).
        `deadline` (time.monotonic()) orders it on the device and bounds any wait; a call the
        engine has not started by `start_by` (time.perf_counter()) fails with Overdue."""
        self._arrived.add(request_id)
        self._suffix_tokens += 0.05 * (suffix.length - self._suffix_tokens)
        ranked = await self._rank(key, request_id, prefix, suffix, deadline, after_reply, start_by)
        if ranked.served in (Served.HBM_HIT, Served.INFLIGHT_JOIN):
            self._settle_prefetch(key, "used")
        return ranked

    async def _rank(
        self,
        key: PsiKey,
        request_id: str,
        prefix: FallbackPrefix,
        suffix: RankingSuffix,
        deadline: float,
        after_reply: AfterReply,
        start_by: float = float("inf"),
    ) -> Ranked:
        t0 = time.perf_counter()
        served = Served.HBM_HIT
        claim = self.cache.claim(key)
        if claim.outcome is Claim.MISS and self.cache.variants(key):
            # psi of other tokens under this (user, prefix version): not this call's, whatever its
            # state (resident, being produced, a hot copy). Its key differs, so it is neither
            # served, joined nor reloaded; the call goes on as a miss of its own content.
            self._content_mismatch(key)
        if claim.outcome is Claim.IN_FLIGHT:
            relayed = await self._relay(key, prefix, suffix, deadline, after_reply, start_by, t0)
            if relayed is not None:
                return relayed
            served = Served.INFLIGHT_JOIN
            claim = await self._join(key, deadline, prefix.length)
        elif claim.outcome is Claim.MISS:
            started = await self._reload_on_miss(key, request_id, prefix, suffix.length, deadline)
            if started is not None:
                # Another call may have started the same reload meanwhile: then this one joined it.
                served = Served.DRAM_RELOAD if started else Served.INFLIGHT_JOIN
                production = self._productions.get(key)
                claim = await self._join(key, deadline, prefix.length)
                if started and production is not None and production.stamps is not None:
                    self._time_reload_path(production.stamps)
        cache_ms = (time.perf_counter() - t0) * 1e3
        if claim.outcome is Claim.HIT and claim.handle.prefix_len != prefix.length:
            # (user, prefix version) must name one prefix; a caller that broke that gets full inference.
            log.warning(
                "prefix_version_reused", user=key.user_id, psi_len=claim.handle.prefix_len, len=prefix.length
            )
            self._on_event("fallback", "prefix_mismatch")
            self.cache.unpin(key)
        elif claim.outcome is Claim.HIT:
            if self.keep_gate is not None and claim.source == "ranking":
                self.keep_gate.read()
            suspect = False  # psi that scored NaN or infinity: dropped, never read again
            try:
                result = await self.engine.rank_cached(suffix, claim.handle, key, start_by, deadline=deadline)
                return Ranked(served, result, cache_ms, 1.0)
            except Overdue:
                raise  # not a failure of the cached path: the call is out of time
            except Exception as exc:  # the cached path is an optimisation: never an error
                suspect = isinstance(exc, NonFiniteScores)
                log.warning("cached_rank_failed", user=key.user_id, error=repr(exc))
                self._on_event("fallback", "nonfinite_scores" if suspect else "cached_rank_failed")
                self._if_out_of_memory(exc, prefix.length, "cached")
            finally:
                self.cache.unpin(key)
                if suspect:
                    self.cache.release(key)
                else:
                    after_reply(lambda _context: self._after_consume(key))
        tokens = prefix.tensors()  # a call by reference with nothing to read: PrefixRequired
        try:
            if self._keeps_psi(key, prefix.length, suffix.length):
                kept = await self._rank_keeping_psi(
                    key, request_id, tokens, suffix, deadline, after_reply, start_by
                )
                if kept is not None:
                    return Ranked(Served.FULL_RECOMPUTE, kept, cache_ms, 0.0)
            result = await self.engine.rank_full(tokens, suffix, start_by, deadline=deadline)
        except torch.OutOfMemoryError:
            # The device had no room for the pass beside the psi held: psi is what gives way
            # (this process's allocator then serves the pass from the blocks freed), once; a
            # second refusal is the caller's RESOURCE_EXHAUSTED.
            self._device_memory_short(self._psi_footprint(prefix.length), "ranking")
            result = await self.engine.rank_full(tokens, suffix, start_by, deadline=deadline)
        return Ranked(Served.FULL_RECOMPUTE, result, cache_ms, 0.0)

    def _if_out_of_memory(self, exc: BaseException, prefix_len: int, where: str) -> None:
        """A path that fell back on `exc`: where the device refused memory, as below."""
        if isinstance(exc, torch.OutOfMemoryError):
            self._device_memory_short(self._psi_footprint(prefix_len), where)

    def _device_memory_short(self, nbytes: int, where: str) -> None:
        """The device refused an allocation that the HBM budget allowed: the processes sharing
        the device, their CUDA graphs and the allocator's fragments take more than the budget
        left them (four ranker processes on one H200 with 27.5 GB of psi each, k18e: 35 GB a
        process, 482 calls failed). The budget drops to what is held less `nbytes` (psi freed,
        in eviction order, until it fits), at most once a second: the refusals of one shortage
        come together, and each lowering counted alone would empty the cache."""
        self.device_memory_short += 1
        self._on_event("device_memory_short", where)
        now = self.cache.clock()
        if now - self._budget_lowered_at < 1.0:
            return
        self._budget_lowered_at = now
        before = self.cache.budget_bytes
        freed = self.cache.lower_budget(min(before, self.cache.used_bytes) - nbytes)
        log.warning("hbm_budget_lowered", where=where, budget_bytes_before=before, budget_bytes=self.cache.budget_bytes,
                    freed_bytes=freed, held_bytes=self.cache.used_bytes)  # fmt: skip

    def _keeps_psi(self, key: PsiKey, prefix_len: int, suffix_len: int) -> bool:
        """Whether this call's full ranking keeps its prefix's psi: long enough, and the keep gate
        (keep_gate.py) finds that reads of kept psi pay for keeping it at this length."""
        if not self.ranking_psi_min_tokens or prefix_len < self.ranking_psi_min_tokens:
            return False
        if self._pressed():
            self.ranking_psi_shed += 1
            self._on_event("ranking_psi", "shed")
            return False
        gate = self.keep_gate
        if gate is None:
            return True
        if self.engine.keep_needs_plain and probed(key.user_id, gate.sample_every):
            # Left unkept so that a keep's device time stays measurable (keep_gate.py).
            self.ranking_psi_probed += 1
            self._on_event("ranking_psi", "probed")
            return False
        saving_s = self.engine.reload_saving_s(prefix_len, suffix_len)
        if gate.admits(
            key.user_id, None if saving_s is None else saving_s * 1e3, self.cost_ms_per_keep(prefix_len)
        ):
            return True
        self.ranking_psi_declined += 1
        self._on_event("ranking_psi", "declined")
        return False

    def _pressed(self) -> bool:
        """Whether the event loop is behind (loop_lag.py): the relay sheds optional work."""
        return self._host_pressed is not None and self._host_pressed()

    def cost_ms_per_keep(self, prefix_len: int) -> float | None:
        """What keeping psi of `prefix_len` tokens costs, as the keep gate weighs it: the host's
        time (host_ms_per_keep) plus the device's, once the ranking batches tell it (the full
        rankings' extra time, keep_gate.KeepDeviceCost); None before the host's was measured."""
        host = self.host_ms_per_keep()
        if host is None:
            return None
        device = self.engine.device_ms_per_keep(prefix_len)
        return host + (device or 0.0)

    def host_ms_per_keep(self) -> float | None:
        """Host time one psi kept by a full ranking costs: the device loop's (allocation and
        copies, Engine.host_ms_per_keep) and the event loop's (admission, production, lease);
        None before the device loop's was measured."""
        device_loop = self.engine.host_ms_per_keep()
        if device_loop is None:
            return None
        timed = self._keep_loop_timed
        return device_loop + (self._keep_loop_cpu_s / timed * 1e3 if timed else 0.0)

    async def _rank_keeping_psi(
        self,
        key: PsiKey,
        request_id: str,
        prefix: UserPrefix,
        suffix: RankingSuffix,
        deadline: float,
        after_reply: AfterReply,
        start_by: float,
    ) -> RankResult | None:
        """A full ranking that leaves its prefix's psi in the cache, produced and consumed by
        this call (module docstring). None when the cache has no room for it, or the key is
        held meanwhile: the caller ranks without keeping psi. Calls for the same key that come
        meanwhile join this production, as they would a pre-inference's."""
        if self.cache.lookup(key) is not None:
            return None  # held in some state (e.g. a psi of another length): admitting would re-lease it
        admitting_from = time.thread_time()
        admitted = self._admit(
            key, self._psi_footprint(prefix.length), Lease(request_id, deadline), "ranking"
        )
        if admitted.outcome is not Admission.ADMITTED:
            return None
        production = _Production(asyncio.Event(), reload=False)
        self._productions[key] = production
        loop_cpu_s = time.thread_time() - admitting_from
        stored = False
        try:
            result = await self.engine.rank_full(prefix, suffix, start_by, deadline=deadline, keep_psi=True)
            storing_from = time.thread_time()
            if result.psi is not None:
                stored = self.cache.produced(key, result.psi)
        finally:
            if not stored:  # failed, overdue, or its entry is gone: no psi to keep
                self.cache.production_failed(key)
            production.done.set()
            if self._productions.get(key) is production:
                del self._productions[key]
        if result.psi_out_of_memory:  # ranked; the device had no room for the psi it would keep
            self._device_memory_short(self._psi_footprint(prefix.length), "ranking_psi")
        if stored:
            self.psi_from_rankings += 1
            self._on_event("ranking_psi", "kept")
            if self.keep_gate is not None:
                self.keep_gate.kept()
            claim = self.cache.claim(key)
            if claim.outcome is Claim.HIT:  # consumed by this call: its lease ends
                self.cache.unpin(key)
                after_reply(lambda _context: self._after_consume(key))
            self._keep_loop_cpu_s += loop_cpu_s + time.thread_time() - storing_from
            self._keep_loop_timed += 1
        return result

    async def _relay(
        self,
        key: PsiKey,
        prefix: FallbackPrefix,
        suffix: RankingSuffix,
        deadline: float,
        after_reply: AfterReply,
        start_by: float,
        t0: float,
    ) -> Ranked | None:
        """A call whose psi is being pre-inferred here: the engine joins the pre-inference or
        takes it over (services/ranker/engine.py). A call that named its prefix by reference
        takes over with the pre-inference's own tokens (the key names their content). None when
        it is a reload or the pre-inference has just finished: then the call joins the
        production as any other."""
        production = self._productions.get(key)
        if production is None or production.reload:
            return None
        # Bad tokens are the caller's error (WireError), not a fallback.
        tokens = None if isinstance(prefix, PrefixReference) else prefix.tensors()
        try:
            relayed = await self.engine.relay(tokens, suffix, key, deadline, start_by)
            if relayed is None and not production.done.is_set():
                await asyncio.sleep(0)  # spawned this turn: its task submits the pre-inference next
                relayed = await self.engine.relay(tokens, suffix, key, deadline, start_by)
        except Overdue:
            raise
        except Exception as exc:  # e.g. the pre-inference failed: rank without it
            log.warning("relay_failed", user=key.user_id, error=repr(exc))
            self._on_event("fallback", "relay_failed")
            self._if_out_of_memory(exc, prefix.length, "relay")
            if tokens is None:
                raise PrefixRequired("prefix_required: the pre-inference of this prefix failed") from exc
            result = await self.engine.rank_full(tokens, suffix, start_by, deadline=deadline)
            return Ranked(Served.FULL_RECOMPUTE, result, (time.perf_counter() - t0) * 1e3, 0.0)
        if relayed is None:
            return None
        # psi is complete (built, or completed by this call): once its production has stored it,
        # this call consumed it, which ends its lease.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(production.done.wait(), max(0.0, deadline - time.monotonic()))
        claim = self.cache.claim(key)
        if claim.outcome is Claim.HIT:
            self.cache.unpin(key)
            after_reply(lambda _context: self._after_consume(key))
        if relayed.joined:
            served = Served.INFLIGHT_JOIN
        else:
            served = Served.PARTIAL_PREFIX if relayed.reused_tokens else Served.FULL_RECOMPUTE
        result = relayed.result
        waited_ms = (time.perf_counter() - t0) * 1e3 - result.queue_ms - result.compute_ms
        return Ranked(served, result, max(0.0, waited_ms), relayed.reused_fraction)

    def _observe_reload(self, nbytes: int, device_s: float) -> None:
        self.costs.observe_reload(nbytes, self.costs.copy_overhead_ms + device_s * 1e3)

    def _content_mismatch(self, key: PsiKey) -> None:
        self.content_mismatches += 1
        self._on_event("content_mismatch", "")
        log.warning("prefix_content_mismatch", user=key.user_id, prefix_version=key.prefix_version,
                    fingerprint=f"{key.fingerprint:016x}",
                    held=[f"{cast(PsiKey, k).fingerprint:016x}" for k in self.cache.variants(key)])  # fmt: skip

    async def _join(self, key: PsiKey, deadline: float, prefix_len: int) -> ClaimResult:
        """Waits for an in-flight psi while the deadline still leaves room for a full ranking."""
        production = self._productions.get(key)
        if production is not None:
            full_ms = self.costs.recompute_ms(prefix_len) + self._join_margin_ms
            budget = deadline - time.monotonic() - full_ms / 1e3
            if budget > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(production.done.wait(), budget)
            if not production.done.is_set():
                self._on_event("fallback", "join_timeout")
        return self.cache.claim(key)

    # ------------------------------------------------------------------ reload

    async def _reload_on_miss(
        self, key: PsiKey, request_id: str, prefix: FallbackPrefix, suffix_len: int, deadline: float
    ) -> bool | None:
        """On a miss, a reload from host DRAM if that beats recomputing the prefix: True when this
        call started it, False when one was already under way (single flight), None for no reload.
        The recompute it is weighed against is this call's own alternative, a full ranking: the
        device time it costs over a call against psi, from the ranking batches measured so far
        (the step model's estimate before those exist). The step model prices a chunked
        pre-inference, which is not what a call on a miss would run; judged by it, every one
        of 331 psis found in DRAM at L4096 on an H100 was recomputed."""
        if self.host is None or not self.host.connected:
            return None
        if not self.host.may_hold(key):
            # The daemon's index says no: a first call's psi is nowhere, and asking cost the call
            # a round trip to the daemon (0.6 ms at p50, 6.9 at p99 in a loaded ranker, H200).
            self._on_event("host_lookup", "absent_local")
            return None
        if self.host.indexed:
            # The index says yes: the reload's acquire asks anyway, so a lookup first would only
            # add a round trip to the call's path. A key the index holds by mistake (lost
            # meanwhile, or sharing a slot) costs a failed acquire, and the call ranks in full.
            stored = self.host.stored_nbytes(prefix.length)  # in the tier's format (fp8: half)
            nbytes: int | None = stored if stored is not None else self._psi_bytes(prefix.length)
        else:
            nbytes = await self.host.lookup(key)
        self._on_event("host_lookup", "absent" if nbytes is None else "found")
        if nbytes is None:
            return None
        saving_s = self.engine.reload_saving_s(prefix.length, suffix_len)
        busy = self.engine.rank_queue_depth > 0 or self.engine.preinfer_backlog > 0
        decision = self.costs.choose(
            nbytes, prefix.length, busy, None if saving_s is None else saving_s * 1e3
        )
        self._on_event("reload_decision", decision.reason)
        self._decisions_logged[decision.reason] += 1
        if (
            self._decisions_logged[decision.reason] in (1, 2, 3)
            or self._decisions_logged[decision.reason] % 512 == 0
        ):
            log.info("reload_decision", reason=decision.reason, nbytes=nbytes, reload_ms=round(decision.reload_ms, 3),
                     recompute_ms=round(decision.recompute_ms, 3), measured_saving=saving_s is not None,
                     seen=self._decisions_logged[decision.reason])  # fmt: skip
        if not decision.reload:
            return None
        admitted = self._admit(key, self._psi_footprint(prefix.length), Lease(request_id, deadline), "reload")
        if admitted.outcome is Admission.REFUSED:
            self._on_event("host_lookup", "no_hbm_room")
            return None
        if admitted.outcome is not Admission.ADMITTED:
            return False  # produced or being produced meanwhile: join it
        # No compute fallback: should the reload fail, the call is better off ranking in full
        # than waiting for a pre-inference and then ranking against it.
        self._start(key, prefix, reload=True, compute_fallback=False, stamps={"decided": time.perf_counter()})
        return True

    def _time_reload_path(self, stamps: dict[str, float]) -> None:
        """A call's reload, from its decision to the call running again, by stage (only one that
        completed: a failed reload has no copy to time)."""
        steps = ("decided", "started", "acquired", "copied", "done")
        if any(step not in stamps for step in steps):
            return
        at = [stamps[step] for step in steps] + [time.perf_counter()]
        self.reload_path.add("call", *(later - earlier for earlier, later in itertools.pairwise(at)))

    # ------------------------------------------------------------------ convert, demote, expire

    def _after_consume(self, key: PsiKey) -> None:
        """A consumed psi stays in HBM as an evictable hot copy; with a host tier, it is demoted
        now or once HBM needs its room (module docstring)."""
        if not self.host_usable:
            return
        if self._demote_under_pressure:
            self.demote_ahead()
            return
        view = self.cache.lookup(key)
        if view is not None and not view.pins:
            self._start_demotion(key)

    def _admit(self, key: PsiKey, nbytes: int, lease: Lease, source: str = "compute") -> AdmitResult:
        """cache.admit, then the demotions the new entry's room calls for (under pressure)."""
        admitted = self.cache.admit(key, nbytes, lease, source)
        self._largest_admitted = max(self._largest_admitted, nbytes)
        if admitted.outcome is Admission.ADMITTED:
            self.demote_ahead()
        return admitted

    def demote_ahead(self) -> None:
        """Under pressure: starts the copies to host DRAM that admitting the reserve needs
        (HbmCache.demotion_candidates). Called after each consumption and admission. The
        reserve is never less than the largest psi admitted: a smaller one (a small budget, long
        prefixes) leaves the next admission to evict psi whose copy has not begun."""
        if not self._demote_under_pressure or not self.host_usable:
            return
        in_flight = sum(self._demoting.values())
        reserve = max(self._demotion_reserve_bytes, self._largest_admitted)
        # A candidate the gate declines is settled in the cache (HbmCache.settle): covered, and
        # not asked about again until a call reads it. Asked on every admission and consumption,
        # the ~130 of them a full HBM holds on the length mix (a reserve of 6 GB in psi of ~45 MB)
        # cost the event loop ~0.3-0.6 ms a call (2-core build machine; bench.cache_costs).
        candidates = self.cache.demotion_candidates(reserve, in_flight)
        if candidates and self._pressed():
            # Not copied, as a gate's refusal (below), but counted apart: the event loop is
            # behind, and an expander round trip per copy is work every queued call waits on.
            for key in candidates:
                if self.cache.settle(cast(PsiKey, key)):
                    self.demotions_shed += 1
                    self._on_event("demotion", "shed")
            return
        gate = self.demotion_gate
        copy_ms = self.host_ms_per_demotion() if gate is not None and candidates else None
        for key in candidates:
            psi_key = cast(PsiKey, key)
            saving_ms = self._saving_ms(psi_key)
            if saving_ms is not None and not self._may_reload(psi_key, saving_ms):
                # A copy no call would take back (its reload slower than what it saves: the
                # reload decision's own rule) is host time and DRAM spent for nothing, and not
                # an opportunity the gate should weigh: settled, not copied, counted apart.
                if self.cache.settle(psi_key):
                    self.demotions_never_reloaded += 1
                    self._on_event("demotion", "never_reloaded")
                continue
            if gate is not None and not gate.admits(psi_key.user_id, saving_ms, copy_ms):
                # Not copied: the entry stays an evictable hot copy, and the admission that
                # needs its room drops it (counted as evicted without a host copy).
                if self.cache.settle(psi_key):
                    self.demotions_skipped += 1
                    self._on_event("demotion", "skipped")
                continue
            self._start_demotion(psi_key)

    def _saving_ms(self, key: PsiKey) -> float | None:
        """Device time a reload of this psi would save a call (a full ranking against a call
        against psi, at the recent calls' suffix length); None before that was measured."""
        view = self.cache.lookup(key)
        per_token = self._psi_bytes(1)
        if view is None or per_token <= 0:
            return None
        saving_s = self.engine.reload_saving_s(view.nbytes // per_token, max(1, round(self._suffix_tokens)))
        return None if saving_s is None else saving_s * 1e3

    def _may_reload(self, key: PsiKey, saving_ms: float) -> bool:
        """Whether the reload decision could ever take this psi back from host DRAM (CostModel.
        may_reload), its copy sized in the tier's format (fp8: about half)."""
        view = self.cache.lookup(key)
        per_token = self._psi_bytes(1)
        if view is None or per_token <= 0:
            return True
        stored = self.host.stored_nbytes(view.nbytes // per_token) if self.host is not None else None
        return self.costs.may_reload(view.nbytes if stored is None else stored, saving_ms)

    def _start_demotion(self, key: PsiKey) -> None:
        starting_from = time.thread_time()
        view = self.cache.lookup(key)
        handle = self.cache.pin_for_copy(key)
        if view is None or handle is None:
            return
        self._demoting[key] = view.nbytes
        self._spawn(self._demotion(key, handle, time.perf_counter()), f"demote-{key.user_id}")
        self.demotion_cpu.seconds += time.thread_time() - starting_from

    def host_ms_per_demotion(self) -> float | None:
        """Host time one copy of psi to host DRAM costs: the device loop's issue (its `copies`
        section per copy, Engine.host_ms_per_copy) and the event loop's own steps (the expander's
        reserve and commit, the bookkeeping: task_cpu.py); None before the device loop's was
        measured. What the demotion gate weighs a copy at."""
        device_loop = self.engine.host_ms_per_copy()
        if device_loop is None:
            return None
        return device_loop + (self.demotion_cpu.ms_per_run() or 0.0)

    async def _demotion(self, key: PsiKey, psi: Psi, started_at: float) -> None:
        # Metered apart from what it sets off (demote_ahead: the next candidates' decisions).
        if await metered(self._demote(key, psi, started_at), self.demotion_cpu):
            self.demote_ahead()  # admissions meanwhile may need more room

    async def _demote(self, key: PsiKey, psi: Psi, started_at: float) -> bool:
        ok = False
        try:
            assert self.host is not None
            ok = await self.host.demote(key, psi, self.engine)
        except Exception as exc:
            log.warning("demotion_failed", user=key.user_id, error=repr(exc))
        finally:
            self._demoting.pop(key, None)
            self._on_event("demotion", "ok" if ok else "failed")
            if ok:
                self.demotion_lag_ms.append((time.perf_counter() - started_at) * 1e3)
                if self.demotion_gate is not None:
                    self.demotion_gate.demoted()
            self.cache.demoted(key, ok, keep=self._keep_demoted)
        return ok

    def expire(self) -> list[PsiKey]:
        """Leased psi past its deadline, never consumed: dropped, its device time unused."""
        gone = cast(list[PsiKey], self.cache.expire())
        for key in gone:
            self.engine.device_time.expired_unused(key)
            log.debug("psi_expired", key=str(key))
            self._settle_prefetch(key, "wasted")
        return gone
