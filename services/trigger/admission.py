"""The trigger's admission policy and its per-instance ledger. Pure: no I/O, clock passed in.

A retrieval event is pre-inferred only if (in this order):
  1. the same (user, prefix version) is not already admitted and still leased  -> ALREADY_RESIDENT
  2. its full ranking is predicted to take more than risk_fraction x SLO x (1 - rho),
     rho the instance's offered full-ranking load (OfferedLoad),
     or pre-inferring it saves device time over the user's expected calls (reuse_pays)
                                                                                 -> else NOT_AT_RISK
     and, when admitted for risk alone, pre-inference plus the call against psi cost the device
     at most (1 + max_extra_work) x the full ranking they replace (adds_little_work)
                                                                                 -> else ADDS_WORK
     unless the key is new, the instance's device has room (`spare`: its measured busy
     share under spare_busy_max) and the call against psi is at most half the full ranking
     and saves at least spare_min_saving x SLO of it (spare_shortens), and (spare_prices_waits)
     more than its pre-inference would make other calls wait (spare_outweighs_waits): then
     step 2 admits it whatever the work term says (below);
  3. its psi fits the instance's HBM budget share (resident + admitted bytes)   -> else FOOTPRINT_BOUND
  4. the instance's pre-inference backlog is under its bound                    -> else LOAD_BOUND
  5. its pre-inference is predicted to start before its ranking call comes (the signal's trip
     and the backlog ahead of it, at the measured pre-inference time, within the event's lead:
     ranking deadline minus SLO minus now; too_late). Ahead of it: the pre-inferences due no
     later than it (InstanceLedger.backlog_ahead), as the ranker builds them in that order
                                                                                    -> else TOO_LATE
  -> ADMITTED.
A returning key (seen within the reuse window) that step 2 turns away is not dropped: with
prefetch on, and while its psi fits the footprint bound, it gets a prefetch-only signal
                                                                                 -> PREFETCH
(the ranker re-leases psi it holds in HBM, so that it is not evicted before the call, or
reloads it from host DRAM ahead of the call; it never computes psi for it).

Why the load term: a request's P99 is its own compute plus the queue it meets, and the queue grows
with the instance's load (as rho / (1 - rho) in the textbook queues). A length that is safe on an
idle instance misses the SLO at 40% load; the threshold shrinks with the load so that the trigger
pre-infers it there. The load is what the trigger itself sees arrive (every event's predicted full
ranking, pre-inferred or not: pre-inference costs the device about as much), so admitting more
does not lower the measured load and make the threshold oscillate.

Why the reuse term: at-risk admission is about this call's latency, but most of the relay's gain
under load is work not done twice. A user who comes back with the same prefix version ranks
against the same psi: with K calls expected, full inference costs K x full while the relay costs
one pre-inference plus K cached calls. On a GPU a 4096-token full ranking (~5 ms, largely host
time) is nowhere near at risk, yet with sessions of 3 calls the relay does about half the work.
How often keys return is measured from the events themselves (ReturnRate), the costs from the
rankers' own batches, so a workload of one-off users, or prefixes so short that a cached call
costs as much as a full one, admits nothing on this ground. Where the rankers' full rankings keep
psi themselves (StatsReply.ranking_psi_min_tokens), a returning user reads psi without any
pre-inference: the term then admits only a pre-inference cheaper than the full ranking it
replaces (never at 4096 tokens on an H100, where it is dearer by the call against psi).

Why the work term: a pre-inference admitted for risk shortens its own call's critical path (a
call against psi instead of the full ranking) but adds device work wherever pre-inference plus
the call against psi cost more than the full ranking, and the load term admits most exactly
when the device has least to spare. At 4096 tokens on an H100 (full ranking 4.3 ms, pre-inference
3.8 ms and a call against psi 1.6 ms, all CUDA graphs) the trigger admitted 93 of 1004 events at
risk at 100 req/s and the relay's P99 went to 113 ms where the baseline's was 40.5 ms. At longer
prefixes, attention dominates both passes and the call against psi is a small share: the work
term lets them through. Where the host is the bottleneck, device time is not the whole price:
the trigger can add to each request it weighs (the signal, the call against psi, the full
ranking) what a request costs the ranker's host (StatsReply.host_ms_per_request; the setting
host_cost, on by default). At 4096 tokens on an H200 a pre-inference for risk added little
by device time (2.1 + 1.15 ms against 3.3), and admitting 1627 of them at 250 req/s took the
relay's limit from 250 to 197.5 req/s on a ranker bound by its host (k11a, k11e); priced with
the host's time, the relay met at least 250 req/s where it met 225 without (k12a, one run). At
16384 tokens, where the device binds, the spare term admits the pre-inferences either way (k12b:
345 and 352 a point, 42.2 and 38.0 req/s met, one step of the search apart).

Why the spare term: the two terms above count device time, but a ranking call's latency is
its queue plus its own compute, and the queue is made by bursts of arrivals (Poisson: at 100
req/s, 15 calls inside 60 ms happen every few seconds) meeting full rankings on the critical
path. A pre-inference runs when no ranking call waits (the ranker's scheduler), 20-200 ms
before its call, so while the device has idle time it moves the prefix off the critical path
for the price of some idle time: at 4096 tokens on an H100 (GPU runs of 2026-11-27, one
lease), pre-inferring every first call (P + C = 5.6 ms of device work where the full ranking
costs 4.1-4.6) halved the device time spent on the critical path and held P99 38.5 ms at 75
req/s where rankings keeping psi (no pre-inference) had 59.7 and the baseline 40.7. Only a
key seen for the first time qualifies (a returning one has psi from its earlier call where
rankings keep psi, and the reuse term decides it otherwise); the busy share is the rankers'
own measurement (StatsReply.device_busy, pre-inference included), so admitting more raises it
and the term turns itself off as the device fills.

Why the spare term weighs waits: "idle" device time is idle only on average. A pre-inference
step, once launched, is not preempted: every ranking call that arrives during it waits for the
rest of it (the ranker counts them: relaygr_ranker_preinfer_held_calls). At a call rate lam and a
pre-inference of d ms those waits add up to about lam x d^2 / 2 (lam d calls, d / 2 each), and
they fall on calls the pre-inference does nothing for, which make the P99. Turned away, the
call does not vanish: its full ranking of f ms runs on the critical path, as unpreempted, and
holds the calls behind it lam x f^2 / 2 just the same. So the saving is the call's own (f - c,
c the call against psi) plus lam x (f^2 - c^2) / 2 of others' waits, against lam x d^2 / 2. On the
length mix on an H200 (k14b, relay at 300 req/s) the spare term pre-inferred 37 of the mix's
longest prefixes a point (13.3 ms of device time each; full rankings ~9.2 ms, calls against psi
~1.2) and their steps held 128 calls for 0.7 s in all (~19 ms a psi; lam d^2 / 2 = 27): the
relay's P99 was 37.7 ms where the baseline's was 18.0; the test turns them away (8 + 12.5 saved
against 26.5). At 8192 tokens and ~90 req/s it admits (5.8 + 2.6 against ~4). At 16384 tokens
the first version of this test counted the call's own saving alone (~17.7 ms against
lam x 24^2 / 2): it turned the first calls away from ~45 req/s on, and they ranked in full
(k17a, H200: at 50.6 req/s the trigger turned 65% of its events away as adding work, 217 of
250 first calls computed their 16k prefix on the critical path, P99 171 ms; the relay's limit
was 35.9 req/s; the capacity model replaying that run put it at 41.2 req/s with the first
version and 46.6 with this one: a prediction). Counted both ways, the test admits them up to
~500 req/s, past where the device's busy share (spare_busy_max) stops the term. d is the
pre-inference's whole planned time (its steps' waits are smaller where it is built in several:
the test errs towards refusing).

Why the lead test: a pre-inference not yet started when its call comes is joined or taken over
by the call (no work twice) but takes nothing off the critical path (one that started leaves the
call its built chunks: partial psi); admitted anyway, a burst of them only lengthens the backlog
the next admissions wait behind. A fixed backlog bound cannot tell that apart from a backlog that
will clear in time: at 125 req/s on an H100 (L4096, lead
20-200 ms, pre-inference ~3.7 ms) the bound of 8 refused 242 of ~2140 events in one point (GPU
run s2, 2026-11-27) while the device was 43% busy, and each refused first call became a full
ranking on the critical path. The count bound stays, larger, against a runaway queue.

Between Stats updates from the rankers, the ledger counts what this trigger admitted on top of the
last reported figures (conservative: an admission counts until its lease ends or a Stats report
taken after it arrives).
"""

from __future__ import annotations

import bisect
import collections
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.wire import MAX_PREINFER_DUES


class Reason(enum.Enum):
    NOT_AT_RISK = "not_at_risk"
    FOOTPRINT_BOUND = "footprint_bound"
    LOAD_BOUND = "load_bound"
    ALREADY_RESIDENT = "already_resident"
    ADDS_WORK = "adds_work"  # at risk, but pre-inferring it would add device work (module docstring)
    ADMITTED = "admitted"
    PREFETCH = "prefetch"  # returning, not pre-inferred: psi re-leased or reloaded where held
    TOO_LATE = "too_late"  # its pre-inference would not start before its ranking call comes


class Policy(enum.Enum):
    SEQUENCE_AWARE = "sequence"  # the trigger as designed
    ALL = "all"  # pre-infer every request (ablation: no trigger)
    OFF = "off"  # never pre-infer (baseline)


@dataclass(frozen=True)
class Bounds:
    slo_ms: float
    risk_fraction: float  # at risk when predicted full latency > risk_fraction x slo_ms
    footprint_fraction: float  # of each instance's HBM budget that admitted psi may fill
    max_backlog: int  # pre-inferences queued or running per instance


@dataclass
class _Admitted:
    psi_bytes: int
    admitted_at: float
    lease_deadline: float
    queued_until: float  # when its pre-inference is expected to have left the instance's queue
    due: float = math.inf  # its ranking deadline: the order the ranker builds pre-inferences in


@dataclass
class InstanceLedger:
    """What the trigger believes about one ranker: last Stats report plus its own admissions since."""

    budget_bytes: int = 0
    reported_resident_bytes: int = 0
    reported_backlog: int = 0
    reported_queue_depth: int = 0
    reported_at: float = float("-inf")
    # The reported backlog's ranking deadlines (same clock as `now`), earliest first; () where
    # the ranker lists none (StatsReply.preinfer_due_in_ms).
    reported_dues: tuple[float, ...] = ()
    _admitted: dict[tuple[int, int], _Admitted] = field(default_factory=dict)

    def report(
        self,
        now: float,
        budget_bytes: int,
        resident_bytes: int,
        backlog: int,
        queue_depth: int,
        dues: Sequence[float] = (),
    ) -> None:
        self.budget_bytes, self.reported_at = budget_bytes, now
        self.reported_resident_bytes, self.reported_backlog, self.reported_queue_depth = (
            resident_bytes,
            backlog,
            queue_depth,
        )
        self.reported_dues = tuple(sorted(dues))

    def forget_expired(self, now: float) -> None:
        for key in [k for k, a in self._admitted.items() if a.lease_deadline < now]:
            del self._admitted[key]

    def _pending(self) -> list[_Admitted]:
        # Admissions made after the last report are not in it yet.
        return [a for a in self._admitted.values() if a.admitted_at >= self.reported_at]

    def resident_bytes(self) -> int:
        return self.reported_resident_bytes + sum(a.psi_bytes for a in self._pending())

    def backlog(self, now: float) -> int:
        """Reported backlog plus this trigger's admissions since the report whose pre-inference is
        not expected to be done yet. Counting every admission since the report instead capped
        admissions at max_backlog per Stats interval (8 per 0.2 s: 40 req/s per instance, where
        the relay missed the SLO at L4096 on an H100 with a 7 ms pre-inference)."""
        return self.reported_backlog + sum(1 for a in self._pending() if a.queued_until >= now)

    def backlog_ahead(self, now: float, due: float) -> int:
        """The backlog a pre-inference due at `due` (its ranking deadline) would wait behind: the
        ranker builds pre-inferences earliest deadline first, so of the reported backlog only
        those due no later than it, and of this trigger's admissions since the report those due
        no later that are not expected done yet. Where the report lists no deadlines although
        it has a backlog (a ranker that does not send them), or lists as many as it may
        (MAX_PREINFER_DUES) and `due` is past the last, the unlisted rest counts as ahead too.
        Counting the whole backlog as ahead (and the rankers then counted each pre-inference
        twice) refused 53% of the events as too late at L8192 on an H200 with the GPU 62% busy
        (h6c, 112.5 req/s)."""
        dues = self.reported_dues
        ahead = bisect.bisect_right(dues, due)
        unlisted = max(0, self.reported_backlog - len(dues))
        if not dues or (len(dues) >= MAX_PREINFER_DUES and due > dues[-1]):
            ahead += unlisted
        return ahead + sum(1 for a in self._pending() if a.queued_until >= now and a.due <= due)

    def is_admitted(self, key: tuple[int, int], now: float) -> bool:
        a = self._admitted.get(key)
        return a is not None and a.lease_deadline >= now

    def admit(
        self,
        key: tuple[int, int],
        psi_bytes: int,
        now: float,
        lease_deadline: float,
        queued_until: float = math.inf,
        due: float = math.inf,
    ) -> None:
        """queued_until: when its pre-inference is expected to be done (default: not before the
        next report); due: its ranking deadline (default: none, built after every one that has)."""
        self._admitted[key] = _Admitted(psi_bytes, now, lease_deadline, queued_until, due)


class OfferedLoad:
    """The full-ranking work offered to one instance, as a fraction of its time: predicted
    milliseconds of every event routed to it, summed with exponential decay (time constant
    `window_s`), over the window. Pure: the clock is passed in."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._ms = 0.0
        self._events = 0.0  # events routed, decayed the same way
        self._at: float | None = None

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            decay = math.exp(-(now - self._at) / self.window_s)
            self._ms *= decay
            self._events *= decay
        self._at = now if self._at is None else max(self._at, now)

    def add(self, now: float, full_ms: float) -> None:
        self._decay(now)
        self._ms += full_ms
        self._events += 1.0

    def rate(self, now: float) -> float:
        """Events (ranking calls to come) per second routed to the instance, over the window."""
        self._decay(now)
        return self._events / self.window_s

    def fraction(self, now: float) -> float:
        """rho: the offered work per unit of time (1.0: the instance is saturated)."""
        self._decay(now)
        return self._ms / (self.window_s * 1e3)


class ReturnRate:
    """How often a key (user, prefix version) comes back: the share of recent events whose key was
    already seen within `window_s`, and from it the expected number of later calls on a psi.
    Pure: the clock is passed in. Keys are remembered up to `max_keys` (oldest forgotten first);
    the share is an exponentially weighted average over about `memory_events` events, pulled
    towards 0 by `prior_events` pseudo-events (a fresh trigger expects no returns)."""

    def __init__(
        self,
        window_s: float,
        max_keys: int = 1_000_000,
        memory_events: float = 4096.0,
        prior_events: float = 32.0,
        max_later: float = 16.0,
    ) -> None:
        if window_s < 0 or max_keys < 1 or memory_events < 1 or prior_events < 0 or max_later < 0:
            raise ValueError("window_s, prior_events, max_later >= 0; max_keys, memory_events >= 1")
        self.window_s = window_s
        self.max_keys = max_keys
        self.max_later = max_later
        self._decay = 1.0 - 1.0 / memory_events
        self._prior = prior_events
        self._events = 0.0
        self._returns = 0.0
        self._last_seen: collections.OrderedDict[tuple[int, int], float] = collections.OrderedDict()

    def observe(self, key: tuple[int, int], now: float) -> bool:
        """Counts one event; True if its key was seen within the window (a returning call)."""
        last = self._last_seen.pop(key, None)
        returning = last is not None and now - last <= self.window_s
        self._last_seen[key] = now
        while len(self._last_seen) > self.max_keys:
            self._last_seen.popitem(last=False)
        self._events = self._events * self._decay + 1.0
        self._returns = self._returns * self._decay + (1.0 if returning else 0.0)
        return returning

    def fraction(self) -> float:
        """Share of events that are returns (0 before any)."""
        denominator = self._events + self._prior
        return self._returns / denominator if denominator > 0 else 0.0

    def expected_later(self) -> float:
        """Expected further calls on a key after this one: with a return share r and sessions of
        geometric length (memoryless), r / (1 - r); capped at max_later."""
        r = min(self.fraction(), 1.0 - 1e-9)
        return min(r / (1.0 - r), self.max_later)


def reuse_pays(
    full_ms: float, prefix_ms: float, cached_ms: float, later_calls: float, rankings_keep_psi: bool = False
) -> bool:
    """Whether pre-inferring saves device time over this call and `later_calls` more on the same
    psi: (1 + later) full rankings cost more than one pre-inference plus (1 + later) cached calls.
    Where the ranker's full ranking keeps psi itself (`rankings_keep_psi`), the later calls read
    that psi either way: pre-inferring saves work only if it plus this call against psi cost
    less than the full ranking it replaces, however many calls follow."""
    if rankings_keep_psi:
        return prefix_ms + cached_ms < full_ms
    calls = 1.0 + max(later_calls, 0.0)
    return calls * (full_ms - cached_ms) > prefix_ms


# The spare term admits a new key only where the call against psi is at most this share of the
# full ranking: a short prefix's full ranking costs about what the call against psi does (fixed
# costs per step dominate both), so pre-inferring it would take nothing off the critical path.
SPARE_MAX_CACHED_SHARE = 0.5


def spare_shortens(full_ms: float, cached_ms: float, slo_ms: float = 0.0, min_saving: float = 0.0) -> bool:
    """Whether pre-inferring takes enough off this call's critical path for the spare term: the
    call against psi costs at most SPARE_MAX_CACHED_SHARE of the full ranking it replaces, and
    saves at least `min_saving` x `slo_ms` of it. The second test is what a fast device needs:
    at 4096 tokens on an H200 (k10c) a full ranking computed in 2.8 ms (3.6 where it kept psi)
    and a call against psi in 1.3 (0.46 of it), so the share test admitted 1641 of 2001 signals
    at 200 req/s for a saving of 1.5-2.3 ms, 3-5% of the SLO; the pre-inferences' joins and
    extra device work made the relay's P99 50.3 ms where the baseline's was 20.8, and its limit
    180 req/s against 250. At 8192 tokens the saving was 6-7 ms, at 16384 ~16.5 (where the
    relay met ~3x the baseline's rate): a tenth of the SLO (the default) tells them apart."""
    return cached_ms <= SPARE_MAX_CACHED_SHARE * full_ms and full_ms - cached_ms >= min_saving * slo_ms


def spare_outweighs_waits(full_ms: float, cached_ms: float, preinfer_ms: float, calls_per_s: float) -> bool:
    """Whether a pre-inference for the spare term saves more than it makes other calls wait: at
    `calls_per_s` = lam, a block of d ms of device work that nothing preempts holds the calls
    arriving during it about lam x d x d / 2 in all. Pre-inferred, the call costs its pre-inference's
    waits and the call against psi (c) with its own; turned away, its full ranking (f) runs on the
    critical path and holds the others as long: saved (f - c) + lam (f^2 - c^2) / 2 against
    lam d^2 / 2 (module docstring)."""
    lam = max(calls_per_s, 0.0)
    full, cached = max(full_ms, 0.0), max(cached_ms, 0.0)
    saved_ms = full - cached + lam * (full**2 - cached**2) / 2e3
    waits_ms = lam * max(preinfer_ms, 0.0) ** 2 / 2e3
    return saved_ms > waits_ms


def host_has_spare(host_ms_per_request: float | None, calls_per_s: float, host_max: float) -> bool:
    """Whether the instance's host has room for the spare term: the share of one core its
    requests take (host ms per request x ranking calls per second, as its Stats report them)
    under `host_max`; 0 turns the test off, and so does a host not yet measured (the spare term
    then goes by the device alone, as before the test). The device's busy share says nothing of
    a ranker bound by its host: on the H200's length mix (k27b) the device was 0.50-0.57 busy
    while the ranker took 0.85-0.93 cores, and the spare term admitted 44 pre-inferences a point
    whose steps held 127-195 calls for 0.44-0.74 s, likely among them calls of the bursts that
    decided the points (the relay met 337.5 req/s against the baseline's 398.4 in that call)."""
    if host_max <= 0 or host_ms_per_request is None or host_ms_per_request <= 0:
        return True
    return host_ms_per_request * max(calls_per_s, 0.0) / 1e3 < host_max


def adds_little_work(full_ms: float, prefix_ms: float, cached_ms: float, max_extra: float) -> bool:
    """Whether one pre-inference plus the call against its psi cost the device at most
    (1 + max_extra) x the full ranking they replace (what admitting a call for risk alone adds)."""
    return prefix_ms + cached_ms <= (1.0 + max(max_extra, 0.0)) * full_ms


def risk_threshold_ms(bounds: Bounds, load: float) -> float:
    """Predicted full ranking above which a request is at risk at offered load `load` (rho,
    capped at 0.9 so that a saturated instance still tells long requests from short ones)."""
    return bounds.risk_fraction * bounds.slo_ms * (1.0 - min(max(load, 0.0), 0.9))


def decide(
    policy: Policy,
    bounds: Bounds,
    predicted_full_ms: float,
    psi_bytes: int,
    ledger: InstanceLedger,
    key: tuple[int, int],
    now: float,
    load: float = 0.0,
    pays_by_reuse: bool = False,
    risk_adds_little: bool = True,
    returning: bool = False,
    prefetch: bool = False,
    spare: bool = False,
    late: bool = False,
) -> Reason:
    if policy is Policy.OFF:
        return Reason.NOT_AT_RISK
    if ledger.is_admitted(key, now):
        return Reason.ALREADY_RESIDENT
    if policy is Policy.ALL:
        return Reason.ADMITTED
    over_footprint = bool(
        ledger.budget_bytes
        and ledger.resident_bytes() + psi_bytes > bounds.footprint_fraction * ledger.budget_bytes
    )
    if not pays_by_reuse and not (spare and not returning):
        turned_away = None
        if predicted_full_ms <= risk_threshold_ms(bounds, load):
            turned_away = Reason.NOT_AT_RISK
        elif not risk_adds_little:
            turned_away = Reason.ADDS_WORK
        if turned_away is not None:
            return Reason.PREFETCH if prefetch and returning and not over_footprint else turned_away
    if over_footprint:
        return Reason.FOOTPRINT_BOUND
    if ledger.backlog(now) >= bounds.max_backlog:
        return Reason.LOAD_BOUND
    if late:
        return Reason.TOO_LATE
    return Reason.ADMITTED


def too_late(lead_s: float, trip_s: float, preinfer_ms: float, backlog: int) -> bool:
    """Whether a pre-inference admitted now would not even start before its ranking call comes,
    `lead_s` from now: it starts after the signal's trip (`trip_s`) and the `backlog`
    pre-inferences ahead of it, each `preinfer_ms` long (module docstring, step 5)."""
    return trip_s + preinfer_ms / 1e3 * max(backlog, 0) > lead_s
