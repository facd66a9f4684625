"""The goodput search as a pure state machine over measurements: step the rate up a grid until the
first miss, then bisect between the last rate that met and the first that missed (EVALUATION.md's
protocol). bench.goodput drives it with runs on a stack; relaygr.sim with the model. No I/O, no
clock."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

RATE_TOL = 1e-6  # two rates this close (relative) are one

__all__ = [
    "RATE_TOL",
    "LimitSearch",
    "Point",
    "SearchConfig",
    "SearchResult",
    "find_limit",
    "recorded_beyond_reach",
    "recorded_client_bound",
]
CLIENT_LAG_BOUND_MS = 10.0  # bench.goodput's default --client-lag-bound-ms


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured rate. `record` holds everything else the report keeps about it."""

    rate_rps: float
    p99_ms: float
    meets_slo: bool
    record: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The load generator fell behind its schedule: the point measured the client, not the system,
    # and says nothing of the system's limit at this rate (a miss here is not the system's).
    client_bound: bool = False
    # The stack was broken when the point ran (bench.goodput: a service did not come back after
    # the broker was renewed, so the relay ran without its trigger or router): the point says
    # nothing of the configuration either, and nothing after it can be trusted (H200, k16e: the
    # relay's trigger lost the renewed broker after its overload point, and the bisection's
    # three points ran without pre-inference).
    stack_broken: bool = False

    @property
    def beyond_reach(self) -> bool:
        """The point measured something other than the configuration: no miss, no met rate."""
        return self.client_bound or self.stack_broken


def recorded_client_bound(record: dict[str, Any], bound_ms: float = CLIENT_LAG_BOUND_MS) -> bool:
    """Whether a goodput file's point measured the load generator: its `client_bound`, or, in
    files written before that field, its send lag P99 over `bound_ms`."""
    if "client_bound" in record:
        return bool(record["client_bound"])
    return float(record.get("lag_ms_p99", 0.0)) > bound_ms


def recorded_beyond_reach(record: dict[str, Any], bound_ms: float = CLIENT_LAG_BOUND_MS) -> bool:
    """Whether a goodput file's point measured something other than its configuration: the load
    generator (recorded_client_bound) or a broken stack (`stack_broken`)."""
    return recorded_client_bound(record, bound_ms) or bool(record.get("stack_broken", False))


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    grid: tuple[float, ...]  # ascending rates every configuration steps through
    precision: float = 0.10  # bisect until first_miss <= goodput x (1 + precision)
    growth: float = 2.0  # geometric step past the grid's top, and under its bottom
    cap_rps: float = 10_000.0  # the grid is never extended past this
    floor_rps: float = 0.0  # stepping down stops under this (0: grid[0] / 64)

    def __post_init__(self) -> None:
        problems = []
        if not self.grid or any(r <= 0 for r in self.grid) or list(self.grid) != sorted(set(self.grid)):
            problems.append("grid must be distinct positive rates in ascending order")
        if not 0 < self.precision < 1:
            problems.append("precision must be in (0, 1)")
        if self.growth <= 1:
            problems.append("growth must be > 1")
        if self.grid and self.cap_rps < self.grid[-1]:
            problems.append("cap_rps must be >= the grid's top")
        if self.floor_rps < 0 or (self.grid and self.floor_rps > self.grid[0]):
            problems.append("floor_rps must be in [0, grid[0]]")
        if problems:
            raise ValueError("SearchConfig: " + "; ".join(problems))

    @property
    def floor(self) -> float:
        return self.floor_rps or self.grid[0] / 64

    def ladder(self) -> list[float]:
        """The grid and its extension up to the cap (the cap itself last)."""
        rates = list(self.grid)
        while rates[-1] < self.cap_rps:
            rates.append(min(self.cap_rps, rates[-1] * self.growth))
        return rates


@dataclasses.dataclass(frozen=True)
class SearchResult:
    goodput_rps: float  # the highest rate that met below the first miss (0: none met)
    first_miss_rps: float | None  # None only when censored
    censored: bool  # the limit is above goodput_rps: the cap met, the load generator fell behind, or the stack broke
    points: list[tuple[str, Point]]  # (phase, point) in measurement order
    # The lowest rate the load generator could not offer on time (censored then: the search
    # stopped there, and the system's limit lies somewhere above goodput_rps).
    client_bound_rps: float | None = None
    # The highest rate that met above the first miss (None: none did): the limit is set by a
    # miss that a higher rate did not repeat, so the run's spread, not the system's cost,
    # decided it (H200, k14c: the relay missed 200 req/s and met 250).
    met_above_miss_rps: float | None = None
    # The lowest rate measured with the stack broken (censored then, as for the client).
    stack_broken_rps: float | None = None


class LimitSearch:
    """The rate search as a state machine over measurements (the caller measures):

        search = LimitSearch(config, must_reach=..., compare=...)
        while (rate := search.next_rate()) is not None:
            search.observe(measure(rate))
        result = search.result()

    `must_reach`: the grid is stepped at least up to this rate even past the first miss (the
    highest grid rate an earlier configuration met). `compare`: rates measured at the end if not
    measured already (they never move the limit). A client-bound point (Point.client_bound) is a
    ceiling on what can be measured: outside the compare phase it ends the search, censored at
    the highest rate that met below it, unless a real miss below it already bounds the limit.
    Pure: no I/O, no clock."""

    def __init__(self, config: SearchConfig, must_reach: float = 0.0, compare: Sequence[float] = ()) -> None:
        self.config = config
        self.must_reach = must_reach
        self._compare = sorted(set(compare))
        self._ladder = config.ladder()
        self._points: list[tuple[str, Point]] = []
        self._phase = "grid"
        self._next: float | None = self._ladder[0]
        self._censored = False
        self._lo = 0.0
        self._hi: float | None = None
        self._client_bound: float | None = None
        self._stack_broken: float | None = None

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when the search is over."""
        return self._next

    def observe(self, point: Point) -> None:
        """Records the measurement of the rate next_rate() gave; decides the next one."""
        if self._next is None or not math.isclose(point.rate_rps, self._next, rel_tol=RATE_TOL):
            raise ValueError(f"observed rate {point.rate_rps} but {self._next} was asked for")
        self._points.append((self._phase, point))
        self._next = self._advance(point)

    def result(self) -> SearchResult:
        if self._next is not None:
            raise RuntimeError("the search is not over")
        above = [p.rate_rps for _, p in self._points
                 if p.meets_slo and not p.beyond_reach and self._hi is not None and p.rate_rps > self._hi]  # fmt: skip
        return SearchResult(
            self._lo,
            self._hi,
            self._censored,
            list(self._points),
            self._client_bound,
            max(above, default=None),
            self._stack_broken,
        )

    def bounds(self) -> tuple[float, float | None]:
        """What the points measured so far say of the limit, for a search cut short: (the highest
        rate that met below the lowest miss, or 0; the lowest miss, or None)."""
        misses = self._misses()
        hi = min(misses) if misses else None
        met = [p.rate_rps for _, p in self._points
               if p.meets_slo and not p.beyond_reach and (hi is None or p.rate_rps < hi)]  # fmt: skip
        return max(met, default=0.0), hi

    @property
    def client_bound_rps(self) -> float | None:
        """The lowest rate the load generator fell behind at so far (None: none)."""
        return self._client_bound

    @property
    def stack_broken_rps(self) -> float | None:
        """The lowest rate measured with the stack broken so far (None: none)."""
        return self._stack_broken

    def points(self) -> list[tuple[str, Point]]:
        """(phase, point) measured so far."""
        return list(self._points)

    # ------------------------------------------------------------------ transitions

    def _measured(self, rate: float) -> bool:
        return any(math.isclose(p.rate_rps, rate, rel_tol=RATE_TOL) for _, p in self._points)

    def _misses(self) -> list[float]:
        """Rates the system missed (a client-bound point is no miss of the system's)."""
        return [
            p.rate_rps
            for phase, p in self._points
            if phase != "compare" and not p.meets_slo and not p.beyond_reach
        ]

    def _met_below(self, rate: float) -> float:
        return max(
            (p.rate_rps for _, p in self._points if p.meets_slo and not p.beyond_reach and p.rate_rps < rate),
            default=0.0,
        )

    def _advance(self, point: Point) -> float | None:
        if point.beyond_reach:
            rate = point.rate_rps
            if point.client_bound:
                self._client_bound = rate if self._client_bound is None else min(self._client_bound, rate)
            else:
                self._stack_broken = rate if self._stack_broken is None else min(self._stack_broken, rate)
            if self._phase != "compare":
                return self._ceiling(rate)
        if self._phase == "grid":
            i = len([1 for phase, _ in self._points if phase == "grid"])
            missed = bool(self._misses())
            if i < len(self._ladder) and (not missed or self._ladder[i] <= self.must_reach * (1 + RATE_TOL)):
                return self._ladder[i]
            if not missed:  # the cap met
                self._censored = True
                self._lo = point.rate_rps
                return self._start_compare()
            if self._points[0][1].meets_slo:
                return self._start_bisect()
            self._phase = "down"
            return self._step_down(self._ladder[0])
        if self._phase == "down":
            if point.meets_slo:
                return self._start_bisect()
            return self._step_down(point.rate_rps)
        if self._phase == "bisect":
            if point.meets_slo:
                self._lo = point.rate_rps
            else:
                self._hi = point.rate_rps
            return self._bisect_next()
        return self._compare_next()

    def _ceiling(self, rate: float) -> float | None:
        """The load generator could not offer `rate`, or the stack broke there: nothing at or
        above it can be measured."""
        misses = [m for m in self._misses() if m < rate]
        if misses:  # a real miss below the ceiling bounds the limit: bisect up to it
            return self._start_bisect()
        self._censored = True
        self._lo = self._met_below(rate)
        self._hi = None
        return self._start_compare()

    def _step_down(self, rate: float) -> float | None:
        lower = rate / self.config.growth
        floor = self.config.floor
        if lower < floor * (1 - RATE_TOL):
            # The floor itself is the last rate stepped down to: a search whose first miss lay
            # within a step of it read goodput 0 with the floor never measured (k17f: a miss at
            # 42.19 req/s, floor 40, growth 1.25).
            if rate > floor * (1 + RATE_TOL) and not self._measured(floor):
                return floor
            return self._start_bisect()  # nothing met down to the floor: goodput 0
        return lower

    def _start_bisect(self) -> float | None:
        self._phase = "bisect"
        self._hi = min(self._misses())
        self._lo = self._met_below(self._hi)
        return self._bisect_next()

    def _bisect_next(self) -> float | None:
        assert self._hi is not None
        if self._lo <= 0 or self._hi <= self._lo * (1 + self.config.precision):
            return self._start_compare()
        return (self._lo + self._hi) / 2

    def _start_compare(self) -> float | None:
        self._phase = "compare"
        return self._compare_next()

    def _compare_next(self) -> float | None:
        return next((r for r in self._compare if not self._measured(r)), None)


def find_limit(
    measure: Callable[[float], Point],
    config: SearchConfig,
    must_reach: float = 0.0,
    compare: Sequence[float] = (),
) -> SearchResult:
    """Runs a LimitSearch with a synchronous `measure(rate) -> Point`."""
    search = LimitSearch(config, must_reach, compare)
    while (rate := search.next_rate()) is not None:
        search.observe(measure(rate))
    return search.result()
