"""The iteration scheduler: what the accelerator runs next, one step at a time. Pure policy: no
torch, no threads, no clock of its own (the engine passes `now`), so every decision is testable
on the CPU.

Chunked prefill (vLLM, Sarathi-Serve) applied to relay-race inference. The engine's one device
loop asks `plan()` before every step and runs what it returns:

  * ranking work first, earliest deadline first: one batch of ranking calls of one kind (against
    complete psi, in full, or partial: against psi built in part), up to `max_batch` calls and
    `max_batch_tokens` computed tokens, after waiting at most `max_wait_s` for it to fill. Short
    work (calls against complete psi, or calls far shorter than the earliest one) goes first
    while the earliest call is still predicted to meet its deadline after it (`_lead`); on a GPU
    full rankings are batched only into shapes a captured CUDA graph holds (`full_replays`);
  * when no ranking call is waiting, pre-inference CHUNKS, the psi needed soonest first (by its
    ranking call's deadline, which the retrieval event carries): a prefix is built `chunk_tokens` at a
    time at most (a multiple of the fingerprint's 256-token chunks, so a built part is always a
    run of whole fingerprint chunks), each chunk a causal forward of its tokens against the psi
    built so far. A step's chunks (of up to `preinfer_max_batch` users) are sized by the step-cost
    model so that the step is predicted to last at most its fixed cost plus `max_rank_delay_s`
    (`step_budget_s`): a ranking call that arrives meanwhile waits about one such step. The
    fixed cost is not counted against the budget because a smaller chunk does not save it: on an
    H100 a step costs ~4-5 ms of host time whatever its size (256 to 4096 tokens), so chunks
    sized to a 5 ms budget built a 4096-token psi in 16 steps, 4x the device time of one (and a
    fit that only ever saw small chunks could not learn that larger ones cost little more).
    A step is costed as one batch by the fit of its kind; where first chunks replay CUDA
    graphs, a graph step takes other prefixes only whole (no eager rest left behind) and an
    eager step no prefix's first chunk (`_chunks`);
  * a pre-inference that a ranking call has joined runs with that call's deadline, in the same
    earliest-deadline order as the ranking calls;
  * under overload, work predicted to finish past its caller's SLO even if it ran now
    (`doomed`: RankItem.due_by) waits behind work that can still meet its own, then runs,
    earliest deadline first, before any pre-inference no call waits for. Earliest deadline
    first hands every call the lateness of the ones ahead of it: calls that have missed keep
    the device while each new arrival queues behind them (L8192 on an H200, h7b, relay at 93.75
    req/s: 30 of the point's 32 slow calls within one half second of a burst). A doomed call is still
    served, late (the engine drops one not started by its `start_by`, as before);
  * a step is planned from the earliest PLAN_WINDOW_BATCHES x max_batch live calls of the
    engine's RankQueue (rank_queue.py), so that planning costs the same whatever the backlog:
    while it grew with the queue, a burst near the limit became a collapse (H200, mix, k14b).
    With more calls queued than that, the order is earliest deadline first.

What a ranking call does about a pre-inference of its psi still in the queue (`relay()`):
  * the predicted rest (all of it, if nothing is built yet) fits in one step (`step_budget_s`)
    and the call's deadline: JOIN (the rest runs with the call's deadline, then the call ranks
    against complete psi);
  * the rest too long: TAKE_OVER (the call reads the built chunks, none if it had not started,
    and computes the rest of the prefix and its suffix in its own step, completing psi).
No work is done twice either way. A pre-inference not started used to be taken over whatever
its size; on a GPU a take-over is an eager pass while the pre-inference step and the call
against psi replay CUDA graphs: at 4096 tokens on an H100 take-overs computed 6-18 ms where
the whole pre-inference step (3.5-4 ms) plus the call against psi (~1.6) cost ~5.5. Since
then a take-over of a pre-inference not started replays the full ranking's graph, keeping psi
(Engine._launch_takeover_full); one of a started pre-inference too while eager partial passes
measure dearer than full rankings of their calls (services/ranker/takeover.py), else it is the
eager partial pass.

Step costs come from `services.ranker.call_cost.CostFit` (per batch + per token + per attention
pair), which the engine fits to its own measured steps: one fit of pre-inference steps (what
chunks are sized by), one of ranking batches (what batch composition is judged by), and on a GPU
one of the steps that build a prefix from its first token by a CUDA graph replay (`first_costs`:
such a step costs its device work, an eager one ~4-5 ms of host time besides).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.ranker.call_cost import CostFit
from services.ranker.rank_queue import RankQueue
from shared.fingerprint import CHUNK_TOKENS

__all__ = [
    "Chunk",
    "IterationScheduler",
    "Plan",
    "PreinferItem",
    "RankItem",
    "RankKind",
    "Relay",
    "SchedulerConfig",
    "chunk_work",
]


# Calls a step is planned from, earliest deadline first (RankQueue.window): batches of up to
# max_batch and the calls that may go before the earliest are chosen among them.
PLAN_WINDOW_BATCHES = 4
MIN_PLAN_WINDOW = 16
# A call of the earliest call's kind is short when predicted at most this share of its time
# (it may then run first, in a batch of its own) ...
SHORT_FRACTION = 0.25
# ... and only when the earliest call takes at least this many per-batch fixed costs (below it,
# a batch of its own costs the short calls about what they save).
LONG_CALL_BATCHES = 3.0


class RankKind(enum.Enum):
    CACHED = "cached"  # suffix against complete psi
    FULL = "full"  # the whole sequence
    PARTIAL = "partial"  # psi built in part: the rest of the prefix and the suffix


class Relay(enum.Enum):
    JOIN = "join"
    TAKE_OVER = "take_over"


@dataclass(frozen=True)
class RankItem:
    """A queued ranking call. `tokens`: tokens it computes; `pairs`: (key, query) attention pairs
    over computed prefix tokens (0 against complete psi), as CallWork counts them."""

    id: int
    kind: RankKind
    deadline: float
    submitted: float
    tokens: int
    pairs: int = 0
    start_by: float = float("inf")  # the engine drops it (Overdue) if not started by then
    # When its answer is worthless to its caller (the ranking SLO from its arrival, or sooner its
    # own deadline): predicted to finish past it, the call is `doomed`. `deadline`, the order it
    # is scheduled by, is a latency target short of it.
    due_by: float = float("inf")


@dataclass(frozen=True)
class PreinferItem:
    """A queued pre-inference: `length` prefix tokens, `done` of them built. `joined_deadline`:
    the earliest deadline of a ranking call waiting for it (None: nobody waits yet); `taken`: a
    ranking call has taken it over (no chunk of it may run any more); `need_by`: when its ranking
    call is due (the retrieval event's ranking deadline; inf: unknown)."""

    id: int
    length: int
    done: int
    submitted: float
    joined_deadline: float | None = None
    taken: bool = False
    need_by: float = float("inf")
    # The latest due_by (RankItem) of the calls waiting for it (-inf: none): it serves all of
    # them, so it is doomed only when the last of them is. By the earliest, a session's later
    # calls that joined the same psi (think times near 0) waited behind live work with the first
    # call's: on an H200 (L8192, k8b, relay at 93.75 req/s) joins of three calls waited 45-237 ms
    # for their 7 ms pre-inference.
    joined_due_by: float = -float("inf")

    @property
    def remaining(self) -> int:
        return self.length - self.done

    @property
    def due(self) -> float:
        """When its psi is needed: a joined call's deadline, else its ranking call's."""
        joined = self.joined_deadline if self.joined_deadline is not None else float("inf")
        return min(joined, self.need_by)


@dataclass(frozen=True)
class Chunk:
    """Build prefix tokens [start, end) of pre-inference `id`."""

    id: int
    start: int
    end: int


def chunk_work(chunks: Iterable[Chunk]) -> tuple[int, int]:
    """(tokens, attention pairs) of a step of these chunks as one batch, as the step-cost fits
    count them: each new token attends to the built tokens and to the new ones before it."""
    tokens = pairs = 0
    for c in chunks:
        tokens += c.end - c.start
        pairs += (c.end - c.start) * c.end
    return tokens, pairs


@dataclass(frozen=True)
class Plan:
    """One step: a ranking batch (ids, earliest deadline first) or pre-inference chunks, or
    nothing; `wait_s` > 0: a ranking batch is filling, plan again after at most that long."""

    rank: tuple[int, ...] = ()
    chunks: tuple[Chunk, ...] = ()
    wait_s: float = 0.0
    predicted_s: float = 0.0  # the step's predicted device time

    @property
    def empty(self) -> bool:
        return not self.rank and not self.chunks


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8
    max_batch_tokens: int = 65_536
    max_wait_s: float = 0.001
    preinfer_max_batch: int = 4
    chunk_tokens: int = 4096
    max_rank_delay_s: float = 0.005
    # A first chunk that a graph holds may pass the budget where that saves a step
    # (IterationScheduler.chunk_size). Off until measured on a GPU: the capacity model's gain at
    # L16384 (45.8 against 41.1 req/s, median of 5 seeds) is inside its seeds' spread.
    first_chunk_absorbs: bool = False
    # A step's budget counts the fixed cost of the kind of step that runs (a graph replay's
    # where one builds the chunk) instead of always the eager step's (step_budget_s). Off until
    # measured on a GPU: with chunks that read psi as graphs, the eager fixed cost (2.7-5.6 ms
    # as two rankers measured it at start-up, k20b) sized graph steps that never pay it to
    # ~10 ms (572 of 708 steps over 10 ms at 42 req/s, 306 calls held 1841 ms).
    budget_by_kind: bool = False

    def __post_init__(self) -> None:
        if self.chunk_tokens < CHUNK_TOKENS or self.chunk_tokens % CHUNK_TOKENS:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of {CHUNK_TOKENS}, got {self.chunk_tokens}"
            )
        if self.max_batch < 1 or self.preinfer_max_batch < 1 or self.max_batch_tokens < 1:
            raise ValueError("batch limits must be >= 1")
        if self.max_wait_s < 0 or self.max_rank_delay_s <= 0:
            raise ValueError("max_wait_s must be >= 0 and max_rank_delay_s > 0")


class IterationScheduler:
    """Plans the engine's steps (see the module docstring). Holds no queue: the engine passes
    what is queued at each call. Not thread-safe: the engine calls it under its lock."""

    def __init__(
        self,
        config: SchedulerConfig,
        costs: CostFit,
        rank_costs: CostFit | None = None,
        first_costs: CostFit | None = None,
        graph_tokens: int = 0,
        full_replays: Callable[[Sequence[int]], bool] | None = None,
        graph_batch: int = 2,
    ) -> None:
        """`costs`: the fit of pre-inference steps (chunk sizes, join decisions); `rank_costs`:
        the fit of ranking batches (batch composition), `costs` when not given; `first_costs`:
        the fit of steps that build a prefix from its first token in one CUDA graph replay, for
        chunks of at most `graph_tokens` in all, of at most `graph_batch` prefixes (None: every
        step is costed by `costs`);
        `full_replays(tokens of each call)`: whether a batch of full rankings replays a captured
        CUDA graph (None: no graphs, e.g. on the CPU)."""
        self.config = config
        self.costs = costs
        self.rank_costs = rank_costs if rank_costs is not None else costs
        self.first_costs = first_costs
        self.graph_tokens = graph_tokens
        self.graph_batch = graph_batch
        # Whether chunks that read psi replay graphs too (RankGraphs.chunks_reading_psi): then
        # every chunk within the graph limits is costed and capped as a graph step.
        self.graph_reads_psi = False
        self.full_replays = full_replays
        self.window_size = max(MIN_PLAN_WINDOW, PLAN_WINDOW_BATCHES * config.max_batch)
        self._window_costs: object = None  # the ranking fit's coefficients at the last window
        # First chunks that absorb a step (chunk_size), by (remaining, budget, the fits'
        # coefficients): planned per step and per queued prefix, each search ~100 fits.
        self._chunk_memo: dict[tuple[object, ...], int] = {}

    # ------------------------------------------------------------------ costs

    def chunk_seconds(self, done: int, tokens: int) -> float:
        """Predicted device time of building `tokens` prefix tokens after `done` built ones, as
        one batch: each new token attends to the built ones and to the new ones before it. A
        chunk from the prefix's first token that a graph holds is costed by the graph steps' fit:
        on a GPU such a step costs its device work while a later chunk (eager, reading psi) pays
        ~4-5 ms of host time whatever its size, and one fit of both learnt a pair cost that made
        every large first chunk look dear."""
        fit = self.costs
        graphed = done == 0 or self.graph_reads_psi
        if graphed and self.first_costs is not None and tokens <= self.graph_tokens:
            fit = self.first_costs
        return fit.coefficients.seconds(tokens, tokens * (done + tokens))

    def step_graphed(self, chunks: Sequence[Chunk]) -> bool:
        """Whether a step of these chunks replays a CUDA graph: every chunk from its prefix's
        first token (nothing to read from psi; any chunk with `graph_reads_psi`), at most
        `graph_batch` of them and `graph_tokens` in all (the engine's graph limits)."""
        return (
            self.first_costs is not None
            and 0 < len(chunks) <= self.graph_batch
            and (self.graph_reads_psi or all(c.start == 0 for c in chunks))
            and sum(c.end - c.start for c in chunks) <= self.graph_tokens
        )

    def step_seconds(self, chunks: Sequence[Chunk]) -> float:
        """Predicted device time of one step of these chunks, as one batch (one per-step cost),
        by the fit of its kind (graph replay or eager)."""
        fit = self.first_costs if self.first_costs is not None and self.step_graphed(chunks) else self.costs
        return fit.coefficients.seconds(*chunk_work(chunks))

    def chunk_cap(self, done: int) -> int:
        """The most tokens one chunk after `done` built ones may have: `chunk_tokens`; a chunk
        from the prefix's first token up to `graph_tokens` where first chunks replay graphs (the
        step budget still bounds it). A later chunk reads psi and runs eagerly, ~4-5 ms of host
        time whatever its size: at L8192 on an H200 (h6a) the 4096-token cap split every prefix
        into a graph step and an eager one, and a pre-inference cost 10-12.6 ms of device time
        per psi against a full ranking's 8.3-9.7 (the trigger prices pre-inference by it)."""
        if (done == 0 or self.graph_reads_psi) and self.first_costs is not None:
            return max(self.config.chunk_tokens, self.graph_tokens)
        return self.config.chunk_tokens

    def chunk_size(self, done: int, remaining: int, budget_s: float) -> int:
        """The largest chunk after `done` built tokens, in whole fingerprint chunks, at most
        `chunk_cap(done)` and `remaining`, predicted to fit `budget_s`; at least one fingerprint
        chunk (or what remains) whatever the budget, so every pre-inference makes progress.

        With `first_chunk_absorbs`, where first chunks replay CUDA graphs, a prefix's first chunk
        may overrun the budget by less than one (eager) step's fixed cost where that saves a
        step and device time: the budget alone cut 16384 tokens on an H200 (k10b, steps measured
        at start-up) into a graph step of 12032 tokens (8.9 ms), an eager one of 4096 (8.4) and
        an eager one of 256 (4.3 ms, nearly all of it the step's fixed cost); 13568 in the graph
        step (10.5 ms) leaves one eager step of 2816: ~17 ms a psi instead of 21.6, the longest
        step 1.5 ms longer."""
        n = self._fitting_chunk(done, remaining, budget_s)
        if not self.config.first_chunk_absorbs or done > 0 or n >= remaining or self.first_costs is None:
            return n
        key = (remaining, budget_s, self.costs.coefficients, self.first_costs.coefficients)
        absorbing = self._chunk_memo.get(key)
        if absorbing is None:
            if len(self._chunk_memo) > 4096:  # fits change as steps are measured: keep it small
                self._chunk_memo.clear()
            absorbing = self._chunk_memo[key] = self._absorbing_chunk(remaining, budget_s, n)
        return absorbing

    def _fitting_chunk(self, done: int, remaining: int, budget_s: float) -> int:
        """chunk_size by the budget alone."""
        cap = min(self.chunk_cap(done), remaining)
        n = min(CHUNK_TOKENS, remaining)
        while n + CHUNK_TOKENS <= cap and self.chunk_seconds(done, n + CHUNK_TOKENS) <= budget_s:
            n += CHUNK_TOKENS
        if n < cap and cap == remaining and self.chunk_seconds(done, cap) <= budget_s:
            n = cap  # the short tail fits too
        return n

    def _rest(self, done: int, length: int, budget_s: float) -> tuple[int, float]:
        """Steps and predicted seconds of building a prefix from `done` to `length` by the
        budget alone."""
        steps, seconds = 0, 0.0
        while done < length:
            n = self._fitting_chunk(done, length - done, budget_s)
            steps, seconds, done = steps + 1, seconds + self.chunk_seconds(done, n), done + n
        return steps, seconds

    def _absorbing_chunk(self, remaining: int, budget_s: float, fitting: int) -> int:
        """Of the first chunks longer than `fitting` that overrun the budget by less than a
        step's fixed cost and leave fewer steps for the rest of the prefix, the one that builds
        it in the least device time, if less than `fitting`'s plan (chunk_size); else `fitting`."""
        steps, seconds = self._rest(fitting, remaining, budget_s)
        best = self.chunk_seconds(0, fitting) + seconds
        limit = budget_s + self.costs.coefficients.per_batch_s
        cap = min(self.chunk_cap(0), remaining)
        sizes = list(range(fitting + CHUNK_TOKENS, cap + 1, CHUNK_TOKENS))
        if cap == remaining and (not sizes or sizes[-1] != cap):
            sizes.append(cap)
        chosen = fitting
        for m in sizes:
            first = self.chunk_seconds(0, m)
            if first > limit:
                break
            rest_steps, rest_seconds = self._rest(m, remaining, budget_s)
            if rest_steps < steps and first + rest_seconds < best:
                chosen, best = m, first + rest_seconds
        return chosen

    def step_budget_s(self, done: int | None = None) -> float:
        """How long a pre-inference step may be predicted to last: its fixed cost (paid by any
        chunk, however small) plus `max_rank_delay_s`. The fixed cost is the eager step's, or
        with `budget_by_kind` that of the step that builds a chunk after `done` built tokens (a
        graph replay's where one holds it; None: an eager step's)."""
        fixed = self.costs.coefficients.per_batch_s
        if (
            self.config.budget_by_kind
            and done is not None
            and self.first_costs is not None
            and (done == 0 or self.graph_reads_psi)
        ):
            fixed = self.first_costs.coefficients.per_batch_s
        return fixed + self.config.max_rank_delay_s

    def remaining_seconds(self, done: int, length: int) -> float:
        """Predicted device time to build the rest of a prefix at the chunk sizes plan() uses."""
        seconds = 0.0
        while done < length:
            n = self.chunk_size(done, length - done, self.step_budget_s(done))
            seconds += self.chunk_seconds(done, n)
            done += n
        return seconds

    # ------------------------------------------------------------------ decisions

    def relay(self, item: PreinferItem, now: float, deadline: float) -> Relay:
        """What a ranking call with this deadline does about the queued pre-inference of its psi
        (module docstring)."""
        if item.taken:
            return Relay.JOIN  # another call computes the rest: its psi is complete after that step
        rest = self.remaining_seconds(item.done, item.length)
        if rest <= self.step_budget_s(item.done) and now + rest < deadline:
            return Relay.JOIN
        return Relay.TAKE_OVER

    def doomed(self, now: float, item: RankItem | PreinferItem) -> bool:
        """Whether a ranking call, or a pre-inference a call has joined, is predicted to finish
        past its `due_by` even if it ran now (a joined one: the rest of its prefix, by the latest
        of its callers': PreinferItem.joined_due_by)."""
        if isinstance(item, RankItem):
            due_by = item.due_by
            seconds = self.rank_costs.coefficients.seconds(item.tokens, item.pairs)
        else:
            due_by = item.joined_due_by
            if item.joined_deadline is None or due_by in (float("inf"), -float("inf")):
                return False
            seconds = self.remaining_seconds(item.done, item.length)
        return now + seconds > due_by

    def plan(
        self, now: float, ranks: RankQueue | Sequence[RankItem], preinfers: Sequence[PreinferItem]
    ) -> Plan:
        """The next step, from what is queued (calls the caller knows are alive). The engine
        passes its RankQueue, which keeps the calls in deadline order across steps so that a
        step is planned from the earliest PLAN_WINDOW of them whatever the backlog; a sequence
        is queued afresh (tests, the capacity model)."""
        queue = ranks if isinstance(ranks, RankQueue) else RankQueue(ranks)
        runnable = [p for p in preinfers if not p.taken and p.remaining > 0]
        joined = sorted(
            (p for p in runnable if p.joined_deadline is not None),
            key=lambda p: (p.joined_deadline, p.submitted),
        )
        # Doomed work waits while work that can still meet its deadline is queued (module
        # docstring); then it is all there is, and runs earliest deadline first.
        coefficients = self.rank_costs.coefficients
        recheck = coefficients != self._window_costs
        self._window_costs = coefficients
        window = queue.window(self.window_size, lambda r: self.doomed(now, r), recheck=recheck)
        live_joined = [p for p in joined if not self.doomed(now, p)]
        if not window.doomed or live_joined:
            joined = live_joined
        calls = [] if window.doomed and live_joined else window.calls
        first_rank = calls[0] if calls else None
        joined_deadline = joined[0].joined_deadline if joined else None
        if joined_deadline is not None and (first_rank is None or joined_deadline <= first_rank.deadline):
            return self._chunks(joined)  # a waiting call's psi is the most urgent work
        if first_rank is not None:
            # More calls queued than the window holds: the slack is gone (each takes at least
            # a per-batch cost), the order is earliest deadline first (_lead).
            lead, cap_s = (first_rank, float("inf")) if window.more else self._lead(now, calls, first_rank)
            return self._rank_batch(now, calls, lead, cap_s)
        # Earliest need first: the calls come in another order than their signals (the
        # retrieval -> ranking gap varies: 20-200 ms in the benchmarks), and in signal order a
        # burst built psi needed in 200 ms before psi needed in 20 ms, whose call then waited
        # for both (pre-inferring every first call at 150 req/s, L4096, on an H100, 13% of the
        # calls joined a pre-inference and waited 9-57 ms for it at p50). Among equals (no
        # known need), what holds memory first, then signal order.
        return self._chunks(sorted(runnable, key=lambda p: (p.due, p.done == 0, p.submitted)))

    def _lead(self, now: float, ranks: Sequence[RankItem], first: RankItem) -> tuple[RankItem, float]:
        """The call that leads the next batch, and the longest predicted time a call may take to
        join it. Earliest deadline first, except that short work goes before the earliest call
        while every call it would delay is still predicted to meet its deadline after it, and
        the earliest to start within its queue budget:
          * calls against complete psi (a few ms) before calls that compute their prefix (tens
            of ms): EDF alone put hits behind full and partial batches of 20-30 ms (GPU runs at
            4096 tokens: the relay's slowest calls were hits that had waited 20-67 ms);
          * calls of the same kind predicted at most SHORT_FRACTION of the earliest one's time,
            as a batch of their own: batched with a long call, a short one waited for all of it
            (the baseline on the length mix: 136-477-token calls computing 30-44 ms).
        The calls delayed are all those of the kind passed over, each after the ones ahead of it
        in deadline order: judged by the earliest alone, a queue of full rankings was passed over
        again and again while only its head kept its deadline. Under load the slack is gone and
        the order is EDF again."""
        coef = self.rank_costs.coefficients
        first_s = coef.seconds(first.tokens, first.pairs)

        def by_deadline(items: Iterable[RankItem]) -> list[RankItem]:
            return sorted(items, key=lambda r: (r.deadline, r.submitted))

        def fits_ahead(batch: Sequence[RankItem], delayed: Sequence[RankItem]) -> bool:
            done = now + coef.seconds(sum(r.tokens for r in batch), sum(r.pairs for r in batch))
            if done > first.start_by:
                return False
            for r in delayed:  # deadline order: each after the ones ahead of it
                done += coef.seconds(r.tokens, r.pairs)
                if done > r.deadline:
                    return False
            return True

        max_batch = self.config.max_batch
        if first.kind is not RankKind.CACHED:
            cached = by_deadline(r for r in ranks if r.kind is RankKind.CACHED)
            if cached and fits_ahead(
                cached[:max_batch], by_deadline(r for r in ranks if r.kind is not RankKind.CACHED)
            ):
                return cached[0], float("inf")
        if first_s < LONG_CALL_BATCHES * coef.per_batch_s:
            return first, float("inf")  # nothing long enough to be worth a batch of its own
        cap = SHORT_FRACTION * first_s
        short: list[RankItem] = []
        long: list[RankItem] = []
        for r in by_deadline(r for r in ranks if r.kind is first.kind):
            (short if r is not first and coef.seconds(r.tokens, r.pairs) <= cap else long).append(r)
        if short and fits_ahead(short[:max_batch], long):
            return short[0], cap
        return first, float("inf")

    def _rank_batch(
        self, now: float, ranks: Sequence[RankItem], first: RankItem, cap_s: float = float("inf")
    ) -> Plan:
        """A batch of `first`'s kind led by it, earliest deadline first, of calls predicted at
        most `cap_s` each."""
        cfg = self.config
        coef = self.rank_costs.coefficients
        same = sorted((r for r in ranks if r.kind is first.kind), key=lambda r: (r.deadline, r.submitted))
        oldest = min(r.submitted for r in ranks)
        # A full ranking that a captured CUDA graph holds replays it alone; batched with others
        # into a shape no graph holds, the batch runs eagerly, dearer than the replays it
        # replaces: on the length mix on an H100 (mx1, 2026-11-28) batches of two full rankings
        # took 5.0-5.7 ms at p50 and up to 83 ms, full rankings alone 1.4-1.7 ms. Such a call
        # is batched only into shapes a captured graph holds.
        replays = self.full_replays
        graph_bound = first.kind is RankKind.FULL and replays is not None and replays([first.tokens])
        # Wait for the batch to fill only if a call like the lead could join it (the rule below):
        # a call that would run alone anyway (a 4096-token full ranking on a GPU, 4.3 ms against
        # a per-batch cost under 1 ms) waited up to max_wait with the device idle.
        could_batch = coef.seconds(first.tokens, first.pairs) - coef.per_batch_s <= coef.per_batch_s
        if graph_bound and replays is not None and not replays([first.tokens, first.tokens]):
            could_batch = False  # not even a partner of its own size would replay with it
        if could_batch and len(same) < cfg.max_batch and now < oldest + cfg.max_wait_s:
            return Plan(wait_s=oldest + cfg.max_wait_s - now)
        batch: list[RankItem] = []
        tokens = 0
        for r in same:
            if len(batch) == cfg.max_batch:
                break
            if batch and tokens + r.tokens > cfg.max_batch_tokens:
                continue
            if r is not first and coef.seconds(r.tokens, r.pairs) > cap_s:
                continue
            if (
                graph_bound
                and batch
                and replays is not None
                and not replays([*(b.tokens for b in batch), r.tokens])
            ):
                continue
            # A call joins only while batching it saves more than it costs: it delays each call
            # already in the batch by its own time and saves one per-batch cost. On a GPU that
            # time is small beside the per-batch cost and batches fill; on a CPU a batch computes
            # its calls one after another, and a short call batched with later ones waited for
            # all of them (overload scenario, bench/faults.py: 100-600-token recomputes served
            # in 450-600 ms batches of eight).
            if batch and len(batch) * (coef.seconds(r.tokens, r.pairs) - coef.per_batch_s) > coef.per_batch_s:
                continue
            batch.append(r)
            tokens += r.tokens
        predicted = coef.seconds(tokens, sum(r.pairs for r in batch))
        return Plan(rank=tuple(r.id for r in batch), predicted_s=predicted)

    def _chunks(self, ordered: Sequence[PreinferItem]) -> Plan:
        """Chunks of the pre-inferences in this order, as one step predicted within the step
        budget: the first always gets one (progress), the others join while the step fits.
        Where first chunks replay graphs, a step that replays one takes other prefixes only
        whole and stays a shape a graph holds, and an eager step takes no prefix's first chunk:
        on an H200 (L8192, k8b) the step of four 8192-token prefixes that a budget counted with
        the eager fit's per-step cost took 8192 + 5888 + 6144 + 6144 tokens (no graph holds
        four: eager, ~20 ms with ranking calls waiting) and left three eager rests of 4-5 ms
        each; a fresh prefix waits for a graph step of its own instead."""
        chunks: list[Chunk] = []
        budget = self.step_budget_s(ordered[0].done) if ordered else self.step_budget_s()
        # The most urgent few only: the device loop plans before every step, and scanning a
        # backlog of 64 for a partner cost 0.19 ms a plan (256: 0.74 ms) on the build machine.
        for p in ordered[: self.config.preinfer_max_batch]:
            if not chunks:
                chunks.append(Chunk(p.id, p.done, p.done + self.chunk_size(p.done, p.remaining, budget)))
                continue
            joining = self._joining_chunk(chunks, p, budget)
            if joining is not None:
                chunks.append(joining)
        return Plan(chunks=tuple(chunks), predicted_s=self.step_seconds(chunks))

    def _joining_chunk(self, chunks: Sequence[Chunk], p: PreinferItem, budget: float) -> Chunk | None:
        """The largest chunk of `p` (whole fingerprint chunks) that a step of `chunks` can take
        within `budget` (_chunks' rules); None: none."""
        if self.first_costs is not None:
            if self.step_graphed(chunks):
                whole = Chunk(p.id, 0, p.length)
                fits = p.done == 0 and self.step_graphed([*chunks, whole])
                return whole if fits and self.step_seconds([*chunks, whole]) <= budget else None
            if p.done == 0:
                return None  # its first chunk waits for a graph step
        best = None
        n = CHUNK_TOKENS
        while True:
            end = min(p.done + n, p.length, p.done + self.config.chunk_tokens)
            candidate = Chunk(p.id, p.done, end)
            if self.step_seconds([*chunks, candidate]) > budget:
                return best
            best = candidate
            if end == p.length or end == p.done + self.config.chunk_tokens:
                return best
            n += CHUNK_TOKENS
