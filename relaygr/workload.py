"""A seeded, reproducible end-to-end workload: who asks for a ranking, when, and with how many tokens.

Pure: no I/O except reading relaygr/data/ml100k_shape.json. `generate(config)` plans the requests
(times, users, prefix versions, lengths); `Materializer` turns a planned request into model inputs
and protobuf messages on demand.

The model (state it in reports as written here):

- Sessions. Session starts form a Poisson process ("poisson") or a two-state Markov-modulated
  Poisson process with the same mean rate ("bursty": a high state whose rate is `burst_factor` x
  the low state's, exponential dwell times with means `burst_high_mean_s` / `burst_low_mean_s`,
  the first state drawn from the stationary split). A session belongs to a user drawn uniformly
  from ids 1..`users` and holds k requests, k geometric on {1, 2, ...} with mean
  `session_mean_requests`, so a fraction about 1 - 1/`session_mean_requests` of requests are
  returning ones. The session rate is `rate_rps / session_mean_requests`, except that with
  `compensate_truncation` (the default) it is `rate_rps / kept`, kept being the expected number of
  a session's requests that fall inside the horizon (a seeded Monte Carlo estimate): sessions cut
  by the horizon (below) would otherwise leave the offered rate under `rate_rps` (measured:
  7% under for one hour, 13% for three minutes, at the defaults).
- Requests. Each request is a retrieval event at t and its ranking call at t + gap, gap uniform in
  [`gap_min_ms`, `gap_max_ms`]. The next request of the session comes a think time after the
  previous ranking call: think times follow MovieLens-100K's non-zero gaps between one user's
  consecutive ratings (inverse CDF through the stored quantiles, interpolated in log space because
  they span seven decades; the smallest non-zero gap is 1 s) multiplied by `think_scale`
  (default 0.1: median ~3.7 s, p90 ~17 s, with ML-100K's tail of days, so that reuse across
  requests happens within a replay of minutes). Requests whose retrieval falls at or after
  the plan's end (`duration_s`, after any lead-in) are dropped, which ends those sessions early (with ML-100K's tail of days, about
  5% of think times fall past any replay of minutes): the returning fraction comes out a few
  points under 1 - 1/`session_mean_requests` over a replay of minutes (describe() states it).
  Over seconds the cut is deep: a 10 s plan at the defaults has 32% returning requests, because
  most sessions' later requests fall past its end and no session began before its start.
- Lead-in. With `lead_in_s` > 0 the plan starts that long before the measured window: sessions
  start over [0, lead_in_s + duration_s), every request is sent, and those whose retrieval falls
  in the first `lead_in_s` seconds are marked `lead_in` (replayed, not measured). The measured
  window then meets users returning from sessions that began before it, as steady-state traffic
  does (10 s window at the defaults: 53% returning with a 10 s lead-in, 61% with 20 s, against
  32% without). Times stay relative to the replay's start (lead-in included); `rate_rps` is the
  measured window's rate (with `compensate_truncation`).
- Prefix versions. (user, prefix_version) names one prefix [U, S_l]. A user's version is the same
  for all requests of a session and one higher for each later session of that user (the long-term
  history changed in between); the first session has version `version_base` + 1. Two sessions of
  one user may overlap in time (rare when `users` is large); they still get distinct versions.
- Lengths. A user's prefix length (profile tokens included) is fixed for the whole run. With
  `fixed_prefix_len` every user has exactly that many tokens (the max-length sweep). Otherwise
  (the real-data mix) a user's length is an ML-100K history length resampled, times
  `length_scale` (a uniform jitter within one scaled unit, so lengths are not all multiples of the
  scale), clipped to `max_prefix_len`; and since ML-100K dropped users with under 20 ratings, a
  fraction `short_head_fraction` of users (an assumption, not data) get lengths uniform in
  [1, 20 x length_scale). With `length_histogram` ((upper length, weight) bins, lengths
  increasing) a user's length is drawn from the bins by weight, uniform within its bin (above the
  previous bin's upper length, at most its own): an operator's own distribution (`relaygr plan
  --lengths FILE`, read by read_length_histogram). Lengths never drop below `profile_tokens` + 1.
- Tokens. Each request carries `recent_tokens` recent behaviours eS_l and `candidates` candidates.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from services.ranker.sequences import Behaviors, RankingSuffix, UserPrefix
from services.ranker.wire import prefix_to_proto, suffix_fields
from shared.protos import events_pb2 as ev
from shared.protos import ranker_pb2 as pb
from shared.stats import percentile

SHAPE_PATH = Path(__file__).resolve().parent / "data" / "ml100k_shape.json"
ML100K_MIN_HISTORY = 20  # ML-100K keeps only users with >= 20 ratings: the short head is missing
EPOCH = 1_700_000_000  # seconds; behaviour timestamps are drawn after it (as relaygr/synthetic.py)
HISTORY_SPAN_S = 90 * 86_400  # a prefix's long-term behaviours span 90 days
RECENT_SPAN_S = 3_600  # recent behaviours: the hour after the prefix
EVENT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class WorkloadConfig:
    """Every knob of the workload (see the module docstring for the model)."""

    seed: int = 0  # everything below is a pure function of the config, seed included
    duration_s: float = 60.0  # the measured window; requests past lead_in_s + this are dropped
    rate_rps: float = 20.0  # mean offered ranking requests per second (open loop)
    arrivals: Literal["poisson", "bursty"] = "poisson"  # the session-start process
    burst_factor: float = 4.0  # bursty: high-state rate / low-state rate
    burst_high_mean_s: float = 5.0  # bursty: mean dwell in the high state (exponential)
    burst_low_mean_s: float = 15.0  # bursty: mean dwell in the low state (exponential)
    users: int = 100_000  # population; user ids are 1..users, drawn uniformly per session
    fixed_prefix_len: int | None = None  # every prefix [U, S_l] exactly this long (None: real-data mix)
    # (upper length, weight) bins instead of the real-data mix (module docstring, Lengths); ()
    length_histogram: tuple[tuple[int, float], ...] = ()
    length_scale: float = 16.0  # real-data mix: ML-100K history length x this (p50 65 -> ~1k tokens)
    max_prefix_len: int = 16_384  # real-data mix: clip
    short_head_fraction: float = 0.2  # real-data mix: users with lengths in [1, 20 x length_scale)
    profile_tokens: int = 8  # |U|, part of the prefix length
    recent_tokens: int = 64  # |eS_l| per request
    candidates: int = 256  # |I| per request
    gap_min_ms: float = 20.0  # retrieval -> ranking gap, uniform in [min, max]
    gap_max_ms: float = 200.0
    session_mean_requests: float = 3.0  # mean of the geometric session size (>= 1)
    think_scale: float = 0.1  # ML-100K non-zero gaps (seconds) x this = think time
    compensate_truncation: bool = True  # raise the session rate so that ~rate_rps survive the horizon
    version_base: int = 0  # first session of a user has version base + 1 (distinct runs: distinct bases)
    lead_in_s: float = 0.0  # planned and sent before the measured window, not measured (steady state)
    request_id_prefix: str = ""  # "" -> f"w{seed}.{version_base}-"

    def __post_init__(self) -> None:
        problems = []
        if self.duration_s <= 0 or self.rate_rps <= 0:
            problems.append("duration_s and rate_rps must be positive")
        if self.arrivals not in ("poisson", "bursty"):
            problems.append(f"arrivals must be 'poisson' or 'bursty', not {self.arrivals!r}")
        if self.burst_factor < 1 or self.burst_high_mean_s <= 0 or self.burst_low_mean_s <= 0:
            problems.append("burst_factor must be >= 1 and the dwell means positive")
        if self.users < 1:
            problems.append("users must be >= 1")
        if self.profile_tokens < 0 or self.recent_tokens < 0 or self.candidates < 1:
            problems.append("profile_tokens and recent_tokens must be >= 0, candidates >= 1")
        if self.fixed_prefix_len is not None and self.fixed_prefix_len <= self.profile_tokens:
            problems.append("fixed_prefix_len must exceed profile_tokens (at least one behaviour)")
        if self.length_histogram:
            problems += _histogram_problems(self.length_histogram, self.profile_tokens)
            if self.fixed_prefix_len is not None:
                problems.append("fixed_prefix_len and length_histogram are two length models: give one")
        if self.length_scale <= 0 or self.max_prefix_len <= self.profile_tokens:
            problems.append("length_scale must be positive and max_prefix_len > profile_tokens")
        if not 0 <= self.short_head_fraction <= 1:
            problems.append("short_head_fraction must be in [0, 1]")
        if not 0 <= self.gap_min_ms <= self.gap_max_ms:
            problems.append("need 0 <= gap_min_ms <= gap_max_ms")
        if self.session_mean_requests < 1:
            problems.append("session_mean_requests must be >= 1")
        if self.think_scale <= 0:
            problems.append("think_scale must be positive")
        if self.version_base < 0:
            problems.append("version_base must be >= 0")
        if not self.lead_in_s >= 0:
            problems.append("lead_in_s must be >= 0")
        if problems:
            raise ValueError("WorkloadConfig: " + "; ".join(problems))

    @property
    def id_prefix(self) -> str:
        return self.request_id_prefix or f"w{self.seed}.{self.version_base}-"

    @property
    def horizon_s(self) -> float:
        """The whole plan's length: the lead-in, then the measured window."""
        return self.lead_in_s + self.duration_s


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of the plan: its retrieval event at t_retrieval_s and its ranking call at
    t_rank_s (seconds from the replay's start)."""

    request_id: str
    t_retrieval_s: float
    t_rank_s: float
    user_id: int
    prefix_version: int
    prefix_len: int  # tokens in [U, S_l], profile included
    recent_len: int
    candidates: int
    session_index: int  # 0: the session's first request; > 0: a returning request
    lead_in: bool = False  # sent before the measured window (WorkloadConfig.lead_in_s), not measured

    @property
    def returning(self) -> bool:
        return self.session_index > 0


@dataclass(frozen=True)
class Workload:
    """The planned requests, sorted by retrieval time (ties by plan order)."""

    config: WorkloadConfig
    requests: list[PlannedRequest]
    sessions: int  # sessions started (each has at least its first request)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def measured(self) -> list[PlannedRequest]:
        """The requests of the measured window (all of them without a lead-in)."""
        return [r for r in self.requests if not r.lead_in]

    def think_times_s(self) -> list[float]:
        """Realized think times: previous ranking call -> next retrieval, within a session."""
        by_session: dict[tuple[int, int], list[PlannedRequest]] = collections.defaultdict(list)
        for r in self.requests:
            by_session[(r.user_id, r.prefix_version)].append(r)
        out = []
        for reqs in by_session.values():
            reqs.sort(key=lambda r: r.session_index)
            out += [b.t_retrieval_s - a.t_rank_s for a, b in itertools.pairwise(reqs)]
        return out

    def describe(self) -> dict[str, Any]:
        """Summary statistics of the plan (what a report states about its workload)."""
        c = self.config
        reqs = self.measured
        n = len(reqs)
        lengths = [float(r.prefix_len) for r in reqs]
        gaps = [(r.t_rank_s - r.t_retrieval_s) * 1e3 for r in reqs]
        think = self.think_times_s()
        returning = sum(r.returning for r in reqs)
        return {
            "requests": n,
            "sessions": self.sessions,
            "duration_s": c.duration_s,
            "lead_in_s": c.lead_in_s,
            "lead_in_requests": len(self.requests) - n,
            "rate_rps": c.rate_rps,
            "realized_rps": n / c.duration_s,
            "arrivals": c.arrivals,
            "session_rps": self.sessions / c.horizon_s,
            "compensate_truncation": c.compensate_truncation,
            "returning_fraction": returning / n if n else 0.0,
            "distinct_users": len({r.user_id for r in reqs}),
            "distinct_prefixes": len({(r.user_id, r.prefix_version) for r in reqs}),
            "prefix_len_p50": percentile(lengths, 50),
            "prefix_len_p90": percentile(lengths, 90),
            "prefix_len_p99": percentile(lengths, 99),
            "prefix_len_max": max(lengths, default=float("nan")),
            "prefix_tokens_mean": sum(lengths) / n if n else float("nan"),
            "recent_tokens": c.recent_tokens,
            "candidates": c.candidates,
            "gap_ms_p50": percentile(gaps, 50),
            "gap_ms_p99": percentile(gaps, 99),
            "think_s_p50": percentile(think, 50),
            "think_s_p90": percentile(think, 90),
            "think_s_p99": percentile(think, 99),
        }


# ---------------------------------------------------------------------- the ML-100K shape


@functools.lru_cache(maxsize=1)
def ml100k_shape() -> dict[str, Any]:
    """The stored MovieLens-100K statistics (bench/data/derive_ml100k.py)."""
    shape: dict[str, Any] = json.loads(SHAPE_PATH.read_text())
    return shape


@functools.lru_cache(maxsize=1)
def _think_knots() -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(conditional CDF levels in [0, 1], log gap seconds) of ML-100K's non-zero gaps."""
    shape = ml100k_shape()
    zero = float(shape["gap_zero_fraction"])
    pts = sorted((float(q) / 100.0, float(v)) for q, v in shape["gap_seconds_quantiles"].items())
    # The smallest non-zero gap is 1 s (timestamps are whole seconds): that is the CDF's start.
    knots = [(0.0, 1.0)] + [((q - zero) / (1.0 - zero), v) for q, v in pts if q > zero and v >= 1.0]
    levels = np.array([k[0] for k in knots])
    logs = np.log(np.array([k[1] for k in knots]))
    return levels, np.maximum.accumulate(logs)


def think_time_s(u: npt.ArrayLike, think_scale: float) -> npt.NDArray[np.float64]:
    """Inverse CDF of the think time at levels u in [0, 1): ML-100K non-zero gaps x think_scale."""
    levels, logs = _think_knots()
    return np.exp(np.interp(np.asarray(u, dtype=np.float64), levels, logs)) * think_scale


def _histogram_problems(bins: tuple[tuple[int, float], ...], profile_tokens: int) -> list[str]:
    uppers = [int(u) for u, _ in bins]
    weights = [float(w) for _, w in bins]
    problems = []
    if any(b <= a for a, b in itertools.pairwise(uppers)):
        problems.append("length_histogram: upper lengths must increase")
    if uppers[0] <= profile_tokens:
        problems.append(f"length_histogram: lengths must exceed profile_tokens ({profile_tokens})")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not sum(weights) > 0:
        problems.append("length_histogram: weights must be finite, >= 0, and not all 0")
    return problems


def read_length_histogram(path: Path) -> tuple[tuple[int, float], ...]:
    """A length histogram from a text file: one bin a line, `upper_length,weight` (weights in any
    unit: counts or shares), '#' comments and blank lines skipped, a first line of names allowed.
    ValueError, one line, naming the file and line, for anything else; validated as
    WorkloadConfig validates it (lengths increasing, weights >= 0, not all 0)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the length histogram {path}: {exc}") from None
    bins: list[tuple[int, float]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        try:
            if len(fields) != 2:
                raise ValueError
            upper, weight = int(fields[0]), float(fields[1])
        except ValueError:
            if not bins and number == 1 and not any(c.isdigit() for c in line):
                continue  # a header
            raise ValueError(f"{path}:{number}: expected 'upper_length,weight', got {line!r}") from None
        bins.append((upper, weight))
    if not bins:
        raise ValueError(f"{path}: no 'upper_length,weight' lines")
    problems = _histogram_problems(tuple(bins), 0)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    return tuple(bins)


def user_prefix_lengths(config: WorkloadConfig) -> npt.NDArray[np.int64]:
    """Prefix length of every user (index user_id - 1): a function of the seed and the length
    knobs only, so changing the rate or duration keeps each user's length."""
    if config.fixed_prefix_len is not None:
        return np.full(config.users, config.fixed_prefix_len, dtype=np.int64)
    rng = np.random.default_rng([config.seed, 0x1E46])
    if config.length_histogram:
        uppers = np.array([u for u, _ in config.length_histogram], dtype=np.float64)
        weights = np.array([w for _, w in config.length_histogram], dtype=np.float64)
        lowers = np.concatenate(([float(config.profile_tokens)], uppers[:-1]))
        lowers = np.maximum(lowers, config.profile_tokens)  # a first bin starts past the profile
        drawn = rng.choice(len(uppers), size=config.users, p=weights / weights.sum())
        # Uniform in (lower, upper]: the bin's own lengths, its upper one included.
        lengths = np.floor(lowers[drawn] + 1 + rng.random(config.users) * (uppers[drawn] - lowers[drawn]))
        return np.minimum(lengths, uppers[drawn]).astype(np.int64)
    hist = np.asarray(ml100k_shape()["history_lengths"], dtype=np.float64)
    scaled = np.floor((rng.choice(hist, size=config.users) + rng.random(config.users)) * config.length_scale)
    head_hi = ML100K_MIN_HISTORY * config.length_scale
    short = rng.random(config.users) < config.short_head_fraction
    head = np.floor(1 + rng.random(config.users) * (head_hi - 1))
    lengths = np.where(short, head, scaled)
    return np.clip(lengths, config.profile_tokens + 1, config.max_prefix_len).astype(np.int64)


# ---------------------------------------------------------------------- planning


def _session_starts(config: WorkloadConfig, rate: float, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """Session start times in [0, horizon_s): Poisson or MMPP with mean rate `rate`."""
    d = config.horizon_s
    if config.arrivals == "poisson":
        return np.sort(rng.uniform(0.0, d, rng.poisson(rate * d)))
    # MMPP: the low rate is set so that the stationary mean rate equals `rate`.
    hi_mean, lo_mean = config.burst_high_mean_s, config.burst_low_mean_s
    p_hi = hi_mean / (hi_mean + lo_mean)
    lo_rate = rate / (1.0 - p_hi + config.burst_factor * p_hi)
    high = bool(rng.random() < p_hi)
    t = 0.0
    chunks = []
    while t < d:
        end = min(d, t + rng.exponential(hi_mean if high else lo_mean))
        r = lo_rate * (config.burst_factor if high else 1.0)
        chunks.append(rng.uniform(t, end, rng.poisson(r * (end - t))))
        t, high = end, not high
    return np.sort(np.concatenate(chunks)) if chunks else np.zeros(0)


def _versions(users: npt.NDArray[np.int64], base: int) -> npt.NDArray[np.int64]:
    """Per session (in start order): base + 1 + how many earlier sessions the same user had."""
    order = np.argsort(users, kind="stable")
    sorted_users = users[order]
    first = np.r_[True, sorted_users[1:] != sorted_users[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(users)), 0))
    rank = np.empty(len(users), dtype=np.int64)
    rank[order] = np.arange(len(users)) - group_start
    return base + 1 + rank


def _request_times(
    config: WorkloadConfig,
    starts: npt.NDArray[np.float64],
    sizes: npt.NDArray[np.int64],
    gap_rng: np.random.Generator,
    think_rng: np.random.Generator,
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(t_retrieval, gap, session, position in session) of every request of the sessions, kept or not."""
    n = int(sizes.sum())
    session = np.repeat(np.arange(len(sizes)), sizes)
    first_idx = np.cumsum(sizes) - sizes  # index of each session's first request
    position = np.arange(n) - np.repeat(first_idx, sizes)
    gaps_s = gap_rng.uniform(config.gap_min_ms, config.gap_max_ms, n) / 1e3
    think_s = think_time_s(think_rng.random(n), config.think_scale)
    # Request j > 0 of a session comes the previous gap plus a think time after request j - 1.
    prev_gap = np.concatenate([[0.0], gaps_s[:-1]])[:n]
    step = np.where(position > 0, prev_gap + think_s, 0.0)
    cum = np.cumsum(step)
    t_retrieval = starts[session] + cum - np.repeat(cum[first_idx], sizes)
    return t_retrieval, gaps_s, session, position


def kept_per_session(config: WorkloadConfig, samples: int = 20_000) -> float:
    """Measured requests per session, scaled to the measured window: the expected requests of a
    session (starts uniform over the horizon) that fall inside the measured window, x horizon /
    window (a seeded Monte Carlo estimate). The session rate that offers `rate_rps` in the window
    is rate_rps / this. Without a lead-in: the requests kept per session, less than
    session_mean_requests because sessions are cut at the end."""
    rng = np.random.default_rng([config.seed, 0xC0FF])
    horizon = config.horizon_s
    starts = rng.uniform(0.0, horizon, samples)
    sizes = rng.geometric(1.0 / config.session_mean_requests, samples).astype(np.int64)
    t, _, _, _ = _request_times(config, starts, sizes, rng, rng)
    measured = np.count_nonzero((t >= config.lead_in_s) & (t < horizon))
    return float(measured) / samples * horizon / config.duration_s


def generate(config: WorkloadConfig) -> Workload:
    """Plans the workload: a pure function of `config` (same config, same requests)."""
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence([config.seed, 0x5E55]).spawn(5)]
    arrivals_rng, users_rng, size_rng, gap_rng, think_rng = streams
    session_rate = config.rate_rps / (
        kept_per_session(config) if config.compensate_truncation else config.session_mean_requests
    )
    starts = _session_starts(config, session_rate, arrivals_rng)
    n_sessions = len(starts)
    users = users_rng.integers(1, config.users + 1, n_sessions).astype(np.int64)
    sizes = size_rng.geometric(1.0 / config.session_mean_requests, n_sessions).astype(np.int64)
    versions = _versions(users, config.version_base)
    t_retrieval, gaps_s, session, position = _request_times(config, starts, sizes, gap_rng, think_rng)
    keep = t_retrieval < config.horizon_s

    lengths = user_prefix_lengths(config)
    idx = np.flatnonzero(keep)
    idx = idx[np.argsort(t_retrieval[idx], kind="stable")]
    prefix = config.id_prefix
    requests = [
        PlannedRequest(
            request_id=f"{prefix}{i}",
            t_retrieval_s=float(t_retrieval[j]),
            t_rank_s=float(t_retrieval[j] + gaps_s[j]),
            user_id=int(users[session[j]]),
            prefix_version=int(versions[session[j]]),
            prefix_len=int(lengths[users[session[j]] - 1]),
            recent_len=config.recent_tokens,
            candidates=config.candidates,
            session_index=int(position[j]),
            lead_in=bool(t_retrieval[j] < config.lead_in_s),
        )
        for i, j in enumerate(idx)
    ]
    return Workload(config, requests, n_sessions)


# ---------------------------------------------------------------------- token content


@dataclass
class _CachedPrefix:
    prefix: UserPrefix
    proto: pb.UserPrefix | None = None


@dataclass
class Materializer:
    """Model inputs and messages for planned requests, deterministic in the seed.

    Contract: the prefix is a function of (seed, user_id, prefix_version) alone (its length is the
    user's, fixed by the plan), so one (user, version) always names the same tokens, as the psi
    cache assumes. Recent behaviours, candidates and the query time are a function of (seed, user,
    version, session_index): they differ between the requests of a session. Timestamps increase:
    long-term history, then recent behaviours (the hour after it), then the query time.

    Prefixes (tensors and their protobuf, ~44 bytes a token: 8M tokens ~ 350 MB) are kept in an
    LRU bounded by `max_cached_tokens`, because building a 16k-token prefix costs ~1.7 ms (0.2 ms
    from the cache) and every request of a session asks for it again.
    Not thread-safe: use it from one thread (the replayer's event loop).
    """

    seed: int
    profile_tokens: int = 8
    max_cached_tokens: int = 8_000_000
    hits: int = 0
    misses: int = 0
    _cache: collections.OrderedDict[tuple[int, int], _CachedPrefix] = field(
        default_factory=collections.OrderedDict, repr=False
    )
    _cached_tokens: int = field(default=0, repr=False)

    @classmethod
    def for_workload(cls, workload: Workload, max_cached_tokens: int = 8_000_000) -> Materializer:
        c = workload.config
        return cls(c.seed, c.profile_tokens, max_cached_tokens)

    def _history_end(self, prefix_version: int) -> int:
        # A later version's history ends later (bounded so timestamps stay far below MAX_TIMESTAMP).
        return EPOCH + HISTORY_SPAN_S + (prefix_version % 100_000) * 3_600

    def _entry(self, user_id: int, prefix_version: int, prefix_len: int) -> _CachedPrefix:
        key = (user_id, prefix_version)
        entry = self._cache.get(key)
        if entry is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            if entry.prefix.length != prefix_len:
                raise ValueError(
                    f"user {user_id} version {prefix_version}: prefix_len {prefix_len} "
                    f"!= {entry.prefix.length} seen before (one (user, version) names one prefix)"
                )
            return entry
        self.misses += 1
        if prefix_len <= self.profile_tokens:
            raise ValueError(f"prefix_len {prefix_len} must exceed profile_tokens {self.profile_tokens}")
        rng = np.random.default_rng([self.seed, 0x9E1F, user_id, prefix_version])
        n = prefix_len - self.profile_tokens
        end = self._history_end(prefix_version)
        prefix = UserPrefix(
            user_id=user_id,
            prefix_version=prefix_version,
            profile=torch.from_numpy(rng.integers(0, 10**6, self.profile_tokens, dtype=np.int64)),
            long_term=_behaviors(rng, n, end - HISTORY_SPAN_S, end),
        )
        entry = _CachedPrefix(prefix)
        self._cache[key] = entry
        self._cached_tokens += prefix_len
        while self._cached_tokens > self.max_cached_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= old.prefix.length
        return entry

    def prefix(self, user_id: int, prefix_version: int, prefix_len: int) -> UserPrefix:
        """The prefix [U, S_l] named by (user_id, prefix_version), prefix_len tokens long."""
        return self._entry(user_id, prefix_version, prefix_len).prefix

    def prefix_proto(self, user_id: int, prefix_version: int, prefix_len: int) -> pb.UserPrefix:
        """The same prefix as a protobuf message (built once per cached prefix; do not mutate)."""
        entry = self._entry(user_id, prefix_version, prefix_len)
        if entry.proto is None:
            entry.proto = prefix_to_proto(entry.prefix)
        return entry.proto

    def suffix(self, planned: PlannedRequest) -> RankingSuffix:
        """This request's recent behaviours, candidates and query time."""
        rng = np.random.default_rng(
            [self.seed, 0x5FF1, planned.user_id, planned.prefix_version, planned.session_index]
        )
        end = self._history_end(planned.prefix_version)
        return RankingSuffix(
            recent=_behaviors(rng, planned.recent_len, end + 1, end + RECENT_SPAN_S),
            candidates=torch.from_numpy(rng.integers(0, 10**9, planned.candidates, dtype=np.int64)),
            query_time=end + RECENT_SPAN_S + 60 * planned.session_index + int(rng.integers(1, 60)),
        )

    def materialize(self, planned: PlannedRequest) -> tuple[UserPrefix, RankingSuffix]:
        """(prefix, suffix) of a planned request."""
        return self.prefix(planned.user_id, planned.prefix_version, planned.prefix_len), self.suffix(planned)

    def rank_request(self, planned: PlannedRequest) -> pb.RankRequest:
        """The RankRequest of a planned request (prefix included: the fallback on a miss)."""
        prefix = self.prefix_proto(planned.user_id, planned.prefix_version, planned.prefix_len)
        return pb.RankRequest(
            request_id=planned.request_id,
            user_id=planned.user_id,
            prefix_version=planned.prefix_version,
            prefix=prefix,
            **suffix_fields(self.suffix(planned)),  # type: ignore[arg-type]
        )

    def retrieval_event(
        self, planned: PlannedRequest, event_time_unix_ms: int = 0, ranking_deadline_unix_ms: int = 0
    ) -> ev.RetrievalEvent:
        """The RetrievalEvent of a planned request (times may be stamped later, before serializing)."""
        return ev.RetrievalEvent(
            schema_version=EVENT_SCHEMA_VERSION,
            request_id=planned.request_id,
            event_time_unix_ms=event_time_unix_ms,
            user_id=planned.user_id,
            prefix_version=planned.prefix_version,
            prefix_len=planned.prefix_len,
            prefix=self.prefix_proto(planned.user_id, planned.prefix_version, planned.prefix_len),
            ranking_deadline_unix_ms=ranking_deadline_unix_ms,
        )


def _behaviors(rng: np.random.Generator, n: int, t0: int, t1: int) -> Behaviors:
    """n behaviours with timestamps sorted in [t0, t1)."""
    items = rng.integers(0, 10**9, n, dtype=np.int64)
    actions = rng.integers(0, 64, n, dtype=np.int64)
    times = np.sort(rng.integers(t0, max(t1, t0 + 1), n, dtype=np.int64))
    return Behaviors(torch.from_numpy(items), torch.from_numpy(actions), torch.from_numpy(times))
