"""CUDA graphs for the ranker's forward passes: one captured pass per shape bucket, replayed.

Five families, each bucketed by (sequences, tokens, longest sequence):
  * cached: ranking against psi (rank_cached's [eS_l, I] per user);
  * full: a full ranking ([U, S_l, eS_l, I] per user: the same pass against empty psi);
  * full_keep (with `full_keeps_kv`): a full ranking that also writes every layer's K/V to the
    static K/V buffer, copied into the psi blocks it keeps after the replay. Apart from the
    full family so that a full ranking that keeps nothing does not pay for the K/V's writes:
    16 more kernels and every layer's K and V copied, which made the relay's plain full
    rankings of under 1000 tokens 0.17 ms (13%) slower on the device than the baseline's same
    calls (k30c, H100, the length mix);
  * preinfer: a pre-inference step whose chunks each start at their prefix's first token (the
    pass over [U, S_l] tokens, every layer's K/V written to one static buffer, then copied into
    each user's psi block);
  * chunk (with `chunks_reading_psi`): a pre-inference step whose chunks read the psi built
    before them (in place: a block's first `start` tokens), as the cached family reads psi, and
    write their K/V as the preinfer family does. Without it such steps run eagerly (at 16384
    tokens on an H200 two of every three steps, 3.5 ms of fixed cost each against 0.8 for a
    replay: k18a).

Why: the ranker's passes are bound by the host. Against psi, ~70 kernel launches issued from
Python cost milliseconds, several times the GPU time; in full, a 4096-token ranking on an H100
spent about as long issuing its kernels as the device spent on them (launch_ms ~ compute_ms,
6-17 ms). A replay issues them in one call.

How any batch fits a captured graph: every per-batch value the kernels read (sequence offsets,
psi addresses and lengths, timestamps) lives in static device buffers that
the host fills before each replay (kernels.hstu_attention StaticBatch); only sizes are baked in,
as upper bounds: a bucket (sequences, tokens, longest sequence). Kernel programs beyond the batch's
sizes exit at once; token rows beyond its tokens go through the row-wise layers (LayerNorm,
linear, SiLU) and are ignored; attention's masked key tiles may reach into them, and zero their V
rows (kernels.hstu_attention: 0 x NaN is NaN), so they cannot leak into real rows. psi blocks are
addressed relative to one fixed anchor allocation.

A batch that does not fit (more sequences or tokens than the largest bucket, prefixes longer than
the prefix-timestamp buffer) or whose bucket has no graph
yet returns None: the caller ranks it eagerly (model.rank_cached), which is always correct. Missing
buckets are remembered and captured by `capture_pending()`, which the engine calls when idle, so a
capture (~0.1-1 s) never delays a ranking call.

All methods run on the engine thread (the one that owns the device and its ranking stream).
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.registry import Collector

from kernels.host_view import copy_by_kernel, device_view
from services.ranker.config import BatchCopies
from services.ranker.events import wait_until_done
from services.ranker.model import HostTokens, HSTURanker, PrefixChunk
from services.ranker.psi import Psi, PsiKey
from services.ranker.sequences import InvalidSequenceError, RankingSuffix, UserPrefix
from shared.logging import get_logger

if TYPE_CHECKING:  # triton exists only where CUDA does: imported by RankGraphs at run time
    from kernels.hstu_attention.triton_impl import StaticBatch

# A function that allocates the kept psi blocks once a full ranking's replay is issued
# (RankGraphs.full): called with whether to write each block's timestamps (False: the graph
# copies them from its staged batch).
KeptPsis = Callable[[bool], Sequence[Psi | None]]

log = get_logger("ranker.graphs")

_MIN_TOKENS = 64


@dataclass(frozen=True)
class GraphLimits:
    max_batch: int = 8  # sequences per graph (the engine's max_batch)
    max_tokens: int = 4096  # new tokens per batch
    max_prefix_tokens: int = 16_384  # per user; longer prefixes rank eagerly (GPU-bound anyway)
    rab_index_mb: float = 64.0  # static bias-index buffer
    max_graphs: int = 64
    # Full rankings and pre-inference steps: tokens in all (0: no graphs for them), sequences,
    # and graphs of each of the two families.
    max_full_tokens: int = 0
    max_full_batch: int = 2
    max_full_graphs: int = 40  # 26 one-sequence sizes up to 17408 tokens, and two-sequence ones
    # Full rankings of 2..max_full_batch sequences totalling at most this many tokens get graphs
    # captured at start-up (warm_full_keys), over and above max_full_graphs; 0: none. Without
    # them the scheduler, which batches full rankings only into shapes a graph holds, ran every
    # full ranking alone: on an H200's length mix (k26b) all 3818 of a point's calls, a third
    # of them queued over 5 ms, each paying a launch of its own on a ranker bound by its host.
    full_batch_tokens: int = 0

    def validate(self) -> GraphLimits:
        if min(self.max_batch, self.max_tokens, self.max_prefix_tokens, self.max_graphs) < 1:
            raise ValueError(f"graph limits must be >= 1: {self}")
        if self.max_full_tokens < 0 or min(self.max_full_batch, self.max_full_graphs) < 1:
            raise ValueError(f"full graph limits: tokens >= 0, batch and graphs >= 1: {self}")
        if not 0 <= self.full_batch_tokens <= self.max_full_tokens:
            raise ValueError(f"full_batch_tokens must be within 0..max_full_tokens: {self}")
        if self.rab_index_mb <= 0:
            raise ValueError("rab_index_mb must be > 0")
        return self


# Graph families (BucketKey.mode).
CACHED, FULL, FULL_KEEP, PREINFER, CHUNK = "cached", "full", "full_keep", "preinfer", "chunk"
# The families of full rankings: the same buckets, the same limits.
FULL_FAMILIES = (FULL, FULL_KEEP)
# How a batch's inputs and scores cross between host and device (RankGraphs' batch_copies).
BATCH_COPIES = tuple(b.value for b in BatchCopies)


@dataclass(frozen=True, order=True)
class BucketKey:
    """Upper bounds a captured graph was sized for, and its family."""

    batch: int
    tokens: int
    max_len: int
    mode: str = CACHED


@functools.lru_cache(maxsize=16)
def _ladder(max_tokens: int) -> tuple[int, ...]:
    """Token capacities of the buckets, up to and including max_tokens: every multiple of 64 up to
    1024 (a single user's suffix pads by less than one attention row block), then steps of a
    quarter of the power of two below (padding under 25%)."""
    sizes = set(range(_MIN_TOKENS, min(max_tokens, 1024) + 1, _MIN_TOKENS))
    base = 1024
    while base < max_tokens:
        sizes.update(s for s in range(base + base // 4, 2 * base + 1, base // 4) if s <= max_tokens)
        base *= 2
    sizes.add(max_tokens)
    return tuple(sorted(s for s in sizes if s <= max_tokens))


@functools.lru_cache(maxsize=16)
def _full_ladder(max_tokens: int) -> tuple[int, ...]:
    """Token capacities of the full and preinfer families: 256, then steps of a quarter of the
    power of two below (padding under 25%), up to and including max_tokens. Coarser than the
    cached family's at the short end (full passes are prefix-long), so that every size fits the
    family's graph cap and all of them are captured at start-up (21 graphs up to 8192 tokens, 26 up to 17408)."""
    sizes = {256}
    base = 256
    while base < max_tokens:
        sizes.update(range(base + base // 4, 2 * base + 1, base // 4))
        base *= 2
    sizes.add(max_tokens)
    return tuple(sorted(s for s in sizes if s <= max_tokens))


def warm_full_keys(
    limits: GraphLimits, chunks_reading_psi: bool = False, full_keeps_kv: bool = False
) -> list[BucketKey]:
    """The full and preinfer buckets (and the chunk family's, with `chunks_reading_psi`; the
    full_keep family's, with `full_keeps_kv`) of one sequence at every size of their ladder
    (what the ranker captures at start-up, so that no capture stalls the device thread
    mid-serving), at most max_full_graphs per family; and the full families' buckets of several
    sequences up to `full_batch_tokens` (multi_full_keys)."""
    if limits.max_full_tokens <= 0:
        return []
    sizes = _full_ladder(limits.max_full_tokens)[: limits.max_full_graphs]
    modes = (
        [FULL, PREINFER] + ([CHUNK] if chunks_reading_psi else []) + ([FULL_KEEP] if full_keeps_kv else [])
    )
    multi = list(multi_full_keys(limits))
    if full_keeps_kv:
        multi += [BucketKey(k.batch, k.tokens, k.max_len, FULL_KEEP) for k in multi]
    return [BucketKey(1, t, t, mode) for mode in modes for t in sizes] + multi


@functools.lru_cache(maxsize=16)
def multi_full_keys(limits: GraphLimits) -> tuple[BucketKey, ...]:
    """Every full-family bucket that bucket_for gives a batch of 2..max_full_batch full rankings
    totalling at most `full_batch_tokens`: for each batch bucket and token size of the ladder,
    each longest-sequence bucket such a batch can have (its longest sequence holds at least an
    even share of more tokens than the size below). A few per size: 27 for two sequences up
    to 2048 tokens."""
    if limits.full_batch_tokens <= 0 or limits.max_full_batch < 2:
        return ()
    ladder = _full_ladder(limits.max_full_tokens)
    keys: set[BucketKey] = set()
    for n in range(2, limits.max_full_batch + 1):
        below = 0  # the ladder's size below t: a batch in t's bucket has more tokens than it
        for t in ladder:
            if t > limits.full_batch_tokens:
                break
            longest = _pow2_at_least(-(-(below + 1) // n))  # ceil: the longest of n sequences
            while True:
                key = bucket_for(n, t, min(longest, t), limits, FULL)
                if key is not None:
                    keys.add(key)
                if longest >= t:
                    break
                longest *= 2
            below = t
    return tuple(sorted(keys))


def family_graph_cap(limits: GraphLimits, mode: str) -> int:
    """The most graphs a family holds: max_graphs for the cached family, max_full_graphs for the
    others, the full family's also the several-sequence buckets captured at start-up."""
    if mode == CACHED:
        return limits.max_graphs
    return limits.max_full_graphs + (len(multi_full_keys(limits)) if mode in FULL_FAMILIES else 0)


def token_ladder(max_tokens: int) -> list[int]:
    """The bucket token capacities for max_tokens (see _ladder)."""
    return list(_ladder(max_tokens))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_for(
    batch: int, tokens: int, max_len: int, limits: GraphLimits, mode: str = CACHED
) -> BucketKey | None:
    """The smallest bucket of `mode`'s family holding a batch of `batch` sequences, `tokens` new
    tokens in all and `max_len` in its longest sequence; None when it exceeds the limits."""
    if mode == CACHED:
        max_batch, max_tokens = limits.max_batch, limits.max_tokens
    else:
        max_batch, max_tokens = limits.max_full_batch, limits.max_full_tokens
    if batch < 1 or batch > max_batch or tokens > max_tokens or max_len > tokens:
        return None
    ladder = _ladder(max_tokens) if mode == CACHED else _full_ladder(max_tokens)  # both lru-cached
    t = ladder[bisect.bisect_left(ladder, tokens)]
    b = min(_pow2_at_least(batch), max_batch)
    length = min(t, max(_MIN_TOKENS, _pow2_at_least(max_len)))
    if mode != CACHED and b == 1:
        length = t  # one sequence: its bucket is its size (the graphs captured at start-up)
    return BucketKey(b, t, length, mode)


def prefix_reads(blocks: Sequence[int], reads: Sequence[int] | None) -> tuple[list[int], np.ndarray]:
    """What the kernels read of each sequence's psi block (`blocks`: their lengths, a layer's
    stride in each): its first reads[b] tokens (psi built in part, read in place), or all of
    them (`reads` None); and where each one's timestamps start in the staged prefix timestamps
    (B + 1 offsets). Raises ValueError for a read past its block (it would read another layer)."""
    plens = list(blocks) if reads is None else list(reads)
    if len(plens) != len(blocks) or any(not 0 <= r <= b for r, b in zip(plens, blocks, strict=True)):
        raise ValueError(f"reads {plens} of psi blocks of {list(blocks)} tokens")
    return plens, np.concatenate([[0], np.cumsum(plens, dtype=np.int64)])


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor | None  # [key.tokens] float32: the candidate rows' scores, padded (None: preinfer)
    replays: int = 0


class PendingScores:
    """A ranking batch's scores, on their way to the host: `wait()` returns them (float32 on the
    host, one tensor per user). A graph replay's scores are copied into page-locked memory
    behind the replay on the ranking stream, with an event after the copy, so that the device
    thread can stage and launch the next batch before this one is done (Engine: launch-ahead);
    an eager batch's are complete when made (`PendingScores.done`)."""

    def __init__(
        self, host: torch.Tensor | None, counts: Sequence[int], event: torch.cuda.Event | None = None
    ) -> None:
        self._host = host
        self._counts = list(counts)
        self._event = event
        self._scores: list[torch.Tensor] | None = None
        # Whether every score is finite, checked once over the batch when wait() copies them
        # out (~2 us); None where nobody checked (the caller checks each call's).
        self.all_finite: bool | None = None

    @classmethod
    def done(cls, scores: list[torch.Tensor]) -> PendingScores:
        pending = cls(None, [s.numel() for s in scores])
        pending._scores = scores
        return pending

    @property
    def event(self) -> torch.cuda.Event | None:
        """The event after the scores' copy (None: complete when made). It is the slot's, recorded
        again two launches later, once these scores have been waited for."""
        return self._event

    def ready(self) -> bool:
        """Whether wait() would return without waiting for the device."""
        return self._scores is not None or self._event is None or bool(self._event.query())

    def wait(self) -> list[torch.Tensor]:
        if self._scores is None:
            if self._event is not None:
                wait_until_done(self._event)
            assert self._host is not None
            # One copy (the page-locked buffer is reused by a later launch), then a view per user:
            # a copy per user cost the device loop ~0.1 ms a batch on an H200 (py-spy).
            flat = self._host[: sum(self._counts)].clone()
            self.all_finite = bool(np.isfinite(flat.numpy()).all())
            self._scores = list(flat.split(self._counts))
            self._host = None
        return self._scores


@dataclass
class _Slot:
    """One of the two sets of page-locked buffers a launch uses: its staged inputs and its
    scores. `event` follows the last launch's copies out of and into them; the next launch on
    this slot waits for it before writing (two batches may be in flight, never three)."""

    staging: torch.Tensor
    staging_np: np.ndarray
    scores: torch.Tensor
    # With batch_copies "scores_aside" (RankGraphs): the scores on the device, copied out of the
    # graph's buffer (which its next replay overwrites), and the event after that copy.
    aside: torch.Tensor | None = None
    # With batch_copies "kernel": device views of `staging` and `scores` (kernels.host_view).
    staging_view: torch.Tensor | None = None
    scores_view: torch.Tensor | None = None
    aside_done: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    event: torch.cuda.Event | None = None  # recorded at the last launch, until the next reuse
    pending: PendingScores | None = None  # the last launch's scores, read from `scores`
    # The slot's one event, recorded again at each launch: a new event a launch cost the device
    # loop ~45 us of host time on an H200 (services/ranker/events.py).
    marker: torch.cuda.Event = field(default_factory=torch.cuda.Event)

    def close(self, device: torch.device) -> torch.cuda.Event:
        """After a launch's last copy into or out of these buffers: marks where they are free."""
        self.marker.record(torch.cuda.current_stream(device))
        self.event = self.marker
        return self.marker

    def reuse(self) -> None:
        """Before writing: the last launch's copies are done and its scores are taken (before
        the marker is recorded again)."""
        if self.pending is not None:
            self.pending.wait()  # copies them out of `scores`
            self.pending = None
        if self.event is not None:
            wait_until_done(self.event)
            self.event = None


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    capture_ms: list[float] = field(default_factory=list)
    # Batches run eagerly, by reason: "no_graph_yet", "too_large", "prefix_too_long",
    # "graph_limit", "capture_failed", "chunk_reads_psi" (a pre-inference chunk after a prefix's
    # first token).
    fallbacks: dict[str, int] = field(default_factory=dict)
    # By family (CACHED, FULL, FULL_KEEP, PREINFER, CHUNK): replays, and batches that ran eagerly.
    replays_by_family: dict[str, int] = field(default_factory=dict)
    eager_by_family: dict[str, int] = field(default_factory=dict)
    # Host CPU seconds issuing the copies of full rankings' K/V into the psi they keep
    # (launch_full with psis): part of what keeping psi costs (keep_gate.py).
    keep_copy_cpu_s: float = 0.0

    def counts(self) -> dict[str, dict[str, int]]:
        """{family: {"replays": n, "eager": n}} for every family (0 where none ran)."""
        return {
            f: {"replays": self.replays_by_family.get(f, 0), "eager": self.eager_by_family.get(f, 0)}
            for f in (CACHED, FULL, FULL_KEEP, PREINFER, CHUNK)
        }


class RankGraphs:
    """Captured forward passes of one model on one CUDA device: ranking against psi, full
    ranking, pre-inference steps (module docstring)."""

    def __init__(
        self,
        model: HSTURanker,
        limits: GraphLimits,
        full_keeps_kv: bool = False,
        chunks_reading_psi: bool = False,
        batch_copies: str = BatchCopies.KERNEL.value,
    ) -> None:
        """`full_keeps_kv`: full rankings that keep psi replay graphs of the full_keep family, which
        also write every layer's K/V to the static K/V buffer, so that a full ranking can leave
        its prefix's psi (full(..., psis)); those that keep none replay the plain full family.
        `chunks_reading_psi`: pre-inference steps after a prefix's first chunk replay graphs of
        the chunk family too (module docstring) instead of running eagerly.
        `batch_copies`: how a batch's staged inputs reach the device and a replay's scores the
        host. A copy engine serves each direction's copies in order, whatever their stream: a
        batch's few-KiB copy queued while a 512 MiB psi copy (~10 ms at 16384 tokens on an H200)
        is in flight waits for all of it, and the ranking stream waits with it (k22; k23:
        8.1-8.6 ms, pieces or no pieces). "engine": both are copies on the ranking stream.
        "scores_aside": the scores are copied aside on the device by a kernel, then to the host
        on a stream of their own (the ranking stream no longer waits behind a demotion; the call
        still does, and inputs still wait behind a reload). "kernel": both are moved by
        kernels through device views of the page-locked buffers (kernels.host_view: zero-copy,
        no copy engine; k23: 0.05-0.2 ms beside any psi copy; the default since k24); where the
        device gives no such view, "engine"."""
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        from kernels.hstu_attention import triton_impl

        self._kernels = triton_impl
        self.model = model
        self.limits = limits.validate()
        if batch_copies not in BATCH_COPIES:
            raise ValueError(f"batch_copies must be one of {', '.join(BATCH_COPIES)}, not {batch_copies!r}")
        scores_aside = batch_copies == "scores_aside"
        self.full_keeps_kv = full_keeps_kv
        self.chunks_reading_psi = chunks_reading_psi
        self.stats = GraphStats()
        dev = model.device
        spec = model.spec
        b = max(limits.max_batch, limits.max_full_batch)
        t = max(limits.max_tokens, limits.max_full_tokens)
        # One int64 staging layout, host (pinned) and device: [item, aux, ts, candidate rows] x T,
        # then [offsets (B+1), n_hist, prefix lens, prefix ts offsets (B+1), kv offsets, block
        # lengths (a layer's stride in a psi block: more than the prefix read where psi is read
        # in place, built in part)] x B.
        sizes = {"item": t, "aux": t, "ts": t, "cand": t, "offsets": b + 1, "n_hist": b, "plens": b,
                 "pts_off": b + 1, "kv_off": b, "pstride": b}  # fmt: skip
        self._slices: dict[str, slice] = {}
        at = 0
        for name, n in sizes.items():
            self._slices[name] = slice(at, at + n)
            at += n
        # Two sets of page-locked staging and score buffers, used in turn: a batch is staged while
        # the one before it may still be on the device (RankGraphs.launch_rank).
        self._slots = [
            _Slot(
                staging,
                staging.numpy(),
                torch.zeros(t, dtype=torch.float32).pin_memory(),
                aside=torch.zeros(t, dtype=torch.float32, device=dev) if scores_aside else None,
            )
            for staging in (torch.zeros(at, dtype=torch.int64).pin_memory() for _ in range(2))
        ]
        if batch_copies == "kernel":
            for slot in self._slots:
                slot.staging_view = device_view(slot.staging, dev)
                slot.scores_view = device_view(slot.scores, dev)
            if any(s.staging_view is None or s.scores_view is None for s in self._slots):
                log.warning("batch_copies_kernel_unavailable", device=str(dev), fallback="engine")
                batch_copies = "engine"
                for slot in self._slots:
                    slot.staging_view = slot.scores_view = None
        self.batch_copies = batch_copies  # as it runs: "engine" where "kernel" had no views
        self._scores_stream = torch.cuda.Stream(dev) if scores_aside else None
        self._slot = 0
        self._dev = torch.zeros(at, dtype=torch.int64, device=dev)
        self._prefix_ts = torch.zeros(b * limits.max_prefix_tokens, dtype=torch.int64, device=dev)
        self._anchor = torch.empty(8, dtype=model.item_emb.weight.dtype, device=dev)
        # The weights never change under a serving model: the model's packed table, built once.
        self._table = model.attention_bias().packed
        self._nb_pos, self._nb_time = spec.num_pos_buckets, spec.num_time_buckets
        self._graphs: dict[BucketKey, _Graph] = {}
        self._pending: set[BucketKey] = set()
        self._failed: set[BucketKey] = set()  # captures that raised: run eagerly from then on
        self._pool = torch.cuda.graph_pool_handle()
        # Every preinfer graph (and full graph, with full_keeps_kv) writes its K/V here
        # (allocated at the first such capture): [layers, 2, tokens, hidden], copied into the
        # users' psi blocks after each replay.
        self._kv_out: torch.Tensor | None = None

    # ------------------------------------------------------------------ ranking

    def rank(
        self, suffixes: Sequence[RankingSuffix], psis: Sequence[Psi], keys: Sequence[PsiKey]
    ) -> list[torch.Tensor] | None:
        """Host float32 scores per suffix, as model.rank_cached computes them; None when this
        batch must run eagerly (see the module docstring). Raises what rank_cached raises on bad
        input (PsiMismatchError, InvalidSequenceError)."""
        pending = self.launch_rank(suffixes, psis, keys)
        return pending.wait() if pending is not None else None

    def launch_rank(
        self, suffixes: Sequence[RankingSuffix], psis: Sequence[Psi], keys: Sequence[PsiKey]
    ) -> PendingScores | None:
        """rank() without waiting: the replay is issued and its scores are on their way to the
        host (PendingScores). At most two launches are outstanding: a third waits for the
        first's scores before it stages (its buffers are reused)."""
        model = self.model
        if not len(suffixes) == len(psis) == len(keys):
            raise InvalidSequenceError("rank() needs one psi and one key per suffix")
        for psi, psi_key in zip(psis, keys, strict=True):
            psi.require_match(psi_key)
            self._check_psi(psi)
        if any(p.prefix_len > self.limits.max_prefix_tokens for p in psis):
            self._fallback("prefix_too_long")
            return None
        tokens = model.pack_suffixes(suffixes)
        found = self._graph_for(CACHED, tokens)
        if found is None:
            return None
        key, graph = found
        slot = self._stage(key, tokens, psis)
        self._replay(key, graph)
        return self._launched(slot, graph, tokens)

    def full(
        self,
        prefixes: Sequence[UserPrefix],
        suffixes: Sequence[RankingSuffix],
        psis: Sequence[Psi | None] | KeptPsis | None = None,
    ) -> list[torch.Tensor] | None:
        """Host float32 scores per user, as model.full computes them (the ranking pass against
        empty psi); None when this batch must run eagerly. With `psis` (full_keeps_kv only: else
        None), user b's prefix K/V are copied into psis[b] (None: not kept) after the replay.
        `psis` may be a function that allocates them (KeptPsis): it is called once the replay is
        issued, so that the blocks' allocation (host work, ~0.3 ms a 4096-token psi in a busy
        ranker) overlaps the device's pass instead of delaying its launch. Every kept block's
        timestamps are copied from the staged batch on the device too, so such a function need
        not write them (it is called with False)."""
        pending = self.launch_full(prefixes, suffixes, psis)
        return pending.wait() if pending is not None else None

    @torch.inference_mode()  # psi blocks are inference tensors: written in place only under it
    def launch_full(
        self,
        prefixes: Sequence[UserPrefix],
        suffixes: Sequence[RankingSuffix],
        psis: Sequence[Psi | None] | KeptPsis | None = None,
    ) -> PendingScores | None:
        """full() without waiting for the scores (as launch_rank). The kept psi blocks are
        written by copies queued on the ranking stream: complete once the scores are. A kept
        block's timestamps come from the batch's staged timestamps (profile tokens 0, then the
        long-term behaviours', as HSTURanker.new_psi writes them): a device copy where the host
        would fill a page-locked buffer and copy it over (on an H200 a full ranking that kept
        psi took 0.3 ms more of the device loop's launch than one that did not, k13b)."""
        keep = callable(psis) or (psis is not None and any(p is not None for p in psis))
        if keep and not self.full_keeps_kv:
            self._fallback("kv_not_kept", FULL_KEEP)
            return None
        if keep and not callable(psis):
            assert psis is not None
            self._check_kept(prefixes, psis)
        tokens = self.model.pack_full(prefixes, suffixes)
        found = self._graph_for(FULL_KEEP if keep else FULL, tokens)
        if found is None:
            return None
        key, graph = found
        slot = self._stage(key, tokens, None)
        self._replay(key, graph)
        if keep:
            if callable(psis):
                psis = psis(False)
                self._check_kept(prefixes, psis)
            assert psis is not None
            assert self._kv_out is not None
            copying_from = time.thread_time()
            staged_ts = self._dev[self._slices["ts"]]
            start = 0
            for p, psi, n in zip(prefixes, psis, tokens.lengths, strict=True):
                if psi is not None:
                    psi.kv.copy_(self._kv_out[:, :, start : start + p.length])
                    psi.timestamps.copy_(staged_ts[start : start + p.length])
                start += n
            self.stats.keep_copy_cpu_s += time.thread_time() - copying_from
        return self._launched(slot, graph, tokens)

    def _check_kept(self, prefixes: Sequence[UserPrefix], psis: Sequence[Psi | None]) -> None:
        if len(psis) != len(prefixes):
            raise InvalidSequenceError("full() needs one psi (or None) per prefix")
        for p, psi in zip(prefixes, psis, strict=True):
            if psi is not None:
                self._check_psi(psi)
                if psi.prefix_len != p.length:
                    raise ValueError(f"psi of {psi.key} has {psi.prefix_len} tokens, its prefix {p.length}")

    @torch.inference_mode()  # psi blocks are inference tensors: written in place only under it
    def preinfer(self, chunks: Sequence[PrefixChunk]) -> bool:
        """Builds these chunks into their psi blocks, as model.preinfer_chunks does, when every
        chunk starts at its prefix's first token (nothing to read from psi); False when the step
        must run eagerly (nothing was written then). The copies into psi are issued on the
        current stream: the caller synchronises before psi is read elsewhere. Chunks that read
        psi (a start past 0) replay the chunk family's graphs where `chunks_reading_psi`."""
        reading = any(c.start for c in chunks)
        if reading and not self.chunks_reading_psi:
            self._fallback("chunk_reads_psi", PREINFER)
            return False
        for c in chunks:
            self._check_psi(c.psi)
        if reading and any(c.psi.prefix_len > self.limits.max_prefix_tokens for c in chunks):
            self._fallback("prefix_too_long", CHUNK)
            return False
        tokens = self.model.pack_chunks(chunks)
        found = self._graph_for(CHUNK if reading else PREINFER, tokens)
        if found is None:
            return False
        key, graph = found
        if reading:  # each chunk reads its block's first c.start tokens, in place
            slot = self._stage(key, tokens, [c.psi for c in chunks], [c.start for c in chunks])
        else:
            slot = self._stage(key, tokens, None)
        self._replay(key, graph)
        kv = self._kv_out
        assert kv is not None  # allocated by the capture of any preinfer graph
        start = 0
        for c, n in zip(chunks, tokens.lengths, strict=True):
            c.psi.kv[:, :, c.start : c.start + n].copy_(kv[:, :, start : start + n])
            start += n
        slot.close(self.model.device)
        return True

    def holds_full(self, lengths: Sequence[int]) -> bool:
        """Whether a batch of full rankings of these lengths (prefix plus suffix tokens each)
        would replay a graph captured already (the scheduler batches full rankings only into
        such shapes). Called on the device thread, where captures happen. The full family's
        bucket: the full_keep family holds the same ones (warm_full_keys), a batch that keeps
        psi where its graph is missing runs eagerly."""
        if not lengths:
            return False
        key = bucket_for(len(lengths), sum(lengths), max(lengths), self.limits, FULL)
        return key is not None and key in self._graphs

    def _graph_for(self, mode: str, tokens: HostTokens) -> tuple[BucketKey, _Graph] | None:
        """The captured graph of this batch's bucket; None (counted) when there is none: a bucket
        within the limits is remembered for capture."""
        key = bucket_for(len(tokens.lengths), tokens.total, max(tokens.lengths, default=0), self.limits, mode)
        if key is None:
            self._fallback("too_large", mode)
            return None
        graph = self._graphs.get(key)
        if graph is not None:
            return key, graph
        if key in self._failed:
            self._fallback("capture_failed", mode)
            return None
        cap = family_graph_cap(self.limits, mode)
        held = sum(1 for k in (*self._graphs, *self._pending) if k.mode == mode)
        if held < cap:
            self._pending.add(key)
            self._fallback("no_graph_yet", mode)
        else:
            self._fallback("graph_limit", mode)
        return None

    def _replay(self, key: BucketKey, graph: _Graph) -> None:
        graph.graph.replay()
        graph.replays += 1
        self.stats.replays += 1
        self.stats.replays_by_family[key.mode] = self.stats.replays_by_family.get(key.mode, 0) + 1

    def _launched(self, slot: _Slot, graph: _Graph, tokens: HostTokens) -> PendingScores:
        """Queues the copy of a replay's scores into the slot's page-locked buffer, behind the
        replay on the ranking stream."""
        assert graph.logits is not None
        count = int(tokens.candidate_rows.numel())
        if slot.scores_view is not None:  # a kernel writes them to the host: no copy engine
            copy_by_kernel(slot.scores_view[:count], graph.logits[:count])
            event = slot.close(self.model.device)
        elif slot.aside is None:
            slot.scores[:count].copy_(graph.logits[:count], non_blocking=True)
            event = slot.close(self.model.device)
        else:
            assert self._scores_stream is not None  # both made with scores_aside
            # A kernel, not a device memcpy (which may queue on a copy engine too), then the copy
            # to the host on the scores' stream, ordered after it. The slot's event follows that
            # copy, and so the staging copy and this kernel before it (_Slot.reuse waits for it).
            copy_by_kernel(slot.aside[:count], graph.logits[:count])
            slot.aside_done.record(torch.cuda.current_stream(self.model.device))
            self._scores_stream.wait_event(slot.aside_done)
            with torch.cuda.stream(self._scores_stream):
                slot.scores[:count].copy_(slot.aside[:count], non_blocking=True)
                event = slot.close(self.model.device)
        slot.pending = PendingScores(slot.scores, tokens.candidate_counts, event)
        return slot.pending

    def _check_psi(self, psi: Psi) -> None:
        kv = psi.kv
        spec = self.model.spec
        if kv.device != self.model.device or kv.dtype != self._anchor.dtype:
            raise ValueError(f"psi of {psi.key} is {kv.dtype} on {kv.device}, the model's is "
                             f"{self._anchor.dtype} on {self.model.device}")  # fmt: skip
        if kv.shape[0] != spec.num_layers or kv.shape[3] != spec.hidden or not kv.is_contiguous():
            raise ValueError(f"psi of {psi.key} has shape {tuple(kv.shape)}: not this model's layout")
        if kv.numel() and kv.data_ptr() % 16:
            raise ValueError(f"psi of {psi.key} is not 16-byte aligned")

    def _fallback(self, reason: str, family: str = CACHED) -> list[torch.Tensor] | None:
        """Counts why a batch of `family` runs eagerly; returns None (rank's answer for it)."""
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        self.stats.eager_by_family[family] = self.stats.eager_by_family.get(family, 0) + 1
        return None

    def _copy_staging(self, slot: _Slot) -> None:
        """The slot's staged inputs to the device buffer the graphs read, on the ranking stream."""
        if slot.staging_view is not None:  # a kernel reads them from the host: no copy engine
            copy_by_kernel(self._dev, slot.staging_view)
        else:
            self._dev.copy_(slot.staging, non_blocking=True)

    def _next_slot(self) -> _Slot:
        """The page-locked buffers of the next launch, once the launch before last is done with
        them."""
        self._slot ^= 1
        slot = self._slots[self._slot]
        slot.reuse()
        return slot

    def _stage(
        self,
        key: BucketKey,
        tokens: HostTokens,
        psis: Sequence[Psi] | None,
        reads: Sequence[int] | None = None,
    ) -> _Slot:
        """Fills the static inputs for this batch padded to `key` (psis None: against empty psi;
        `reads`: the tokens read of each block, in place, where not the whole block), then copies
        them to the device (on the current stream: after the kernels of any batch launched
        before, which read the same device buffers). Returns the slot it staged in: the caller
        closes it (_Slot.close) after the launch's last copy."""
        slot = self._next_slot()
        h, s = slot.staging_np, self._slices
        columns, candidate_rows = tokens.columns.numpy(), tokens.candidate_rows.numpy()
        lengths, n_hist = tokens.lengths, tokens.n_hist
        total = columns.shape[1]

        def put(name: str, values: np.ndarray | list[int], pad: int, upto: int) -> None:
            start = s[name].start
            n = len(values)
            h[start : start + n] = values
            h[start + n : start + upto] = pad

        h[s["item"].start : s["item"].start + total] = columns[0]
        h[s["aux"].start : s["aux"].start + total] = columns[1]
        h[s["ts"].start : s["ts"].start + total] = columns[2]
        put("cand", candidate_rows, 0, key.tokens)  # padded rows must index inside the bucket
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        put("offsets", offsets, total, key.batch + 1)
        put("n_hist", n_hist, 0, key.batch)
        blocks = [p.prefix_len for p in psis] if psis is not None else [0] * len(lengths)
        plens, pts_off = prefix_reads(blocks, reads)
        put("plens", plens, 0, key.batch)
        put("pstride", blocks, 0, key.batch)
        put("pts_off", pts_off, int(pts_off[-1]), key.batch + 1)
        anchor, size = self._anchor.data_ptr(), self._anchor.element_size()
        kv_off = [(p.kv.data_ptr() - anchor) // size for p in psis] if psis is not None else []
        put("kv_off", kv_off, 0, key.batch)
        self._copy_staging(slot)
        ts_total = int(pts_off[-1])
        if psis is None or not ts_total:
            return slot
        # Each block's timestamps, or their first reads[b] (no views made on the ranking path).
        stamps = (
            [p.timestamps for p in psis]
            if reads is None
            else [p.timestamps[:n] for p, n in zip(psis, plens, strict=True)]
        )
        if len(stamps) == 1:
            self._prefix_ts[:ts_total].copy_(stamps[0])
        elif ts_total:
            torch.cat(stamps, out=self._prefix_ts[:ts_total])
        return slot

    # ------------------------------------------------------------------ capture

    def pending(self) -> list[BucketKey]:
        return sorted(self._pending)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def request(self, keys: Sequence[BucketKey]) -> None:
        """Buckets to capture at the next capture_pending() (e.g. at warm-up)."""
        for key in keys:
            if key not in self._graphs and key not in self._failed:
                self._pending.add(key)

    def capture_pending(self, limit: int = 1) -> int:
        """Captures up to `limit` remembered buckets; returns how many it captured."""
        done = 0
        while self._pending and done < limit:
            key = min(self._pending)
            self._pending.discard(key)
            cap = family_graph_cap(self.limits, key.mode)
            if key in self._graphs or sum(1 for k in self._graphs if k.mode == key.mode) >= cap:
                continue
            started = time.perf_counter()
            try:
                self._graphs[key] = self._capture(key)
            except Exception as exc:  # that shape stays on the eager path, and is not tried again
                self._failed.add(key)
                log.error("rank_graph_capture_failed", mode=key.mode, batch=key.batch, tokens=key.tokens,
                          max_len=key.max_len, error=repr(exc))  # fmt: skip
                continue
            ms = (time.perf_counter() - started) * 1e3
            self.stats.captured += 1
            self.stats.capture_ms.append(ms)
            log.info("rank_graph_captured", mode=key.mode, batch=key.batch, tokens=key.tokens,
                     max_len=key.max_len, ms=round(ms, 1), graphs=len(self._graphs))  # fmt: skip
            done += 1
        return done

    def _static_batch(self, key: BucketKey) -> StaticBatch:
        d, s = self._dev, self._slices

        def view(name: str, n: int) -> torch.Tensor:
            return d[s[name].start : s[name].start + n]

        k = self._kernels
        # Full and preinfer passes run against empty psi: no prefix splits.
        prefix_tokens = self.limits.max_prefix_tokens if key.mode in (CACHED, CHUNK) else 0
        grid = k.StaticGrid.plan(key.batch, key.max_len, self.model.spec.num_heads, self.model.device,
                                 tokens=key.tokens, prefix_tokens=prefix_tokens)  # fmt: skip
        return k.StaticBatch(
            seq_offsets=view("offsets", key.batch + 1),
            n_hist=view("n_hist", key.batch),
            timestamps=view("ts", key.tokens),
            prefix_lens=view("plens", key.batch),
            prefix_timestamps=self._prefix_ts,
            prefix_ts_offsets=view("pts_off", key.batch + 1),
            kv_offsets=view("kv_off", key.batch),
            kv_anchor=self._anchor,
            grid=grid,
            prefix_strides=view("pstride", key.batch),
        )

    def _forward(self, key: BucketKey, batch: StaticBatch) -> torch.Tensor | None:
        """The captured work: reads only the static buffers, returns padded candidate logits (a
        preinfer pass writes every layer's K/V to the static K/V buffer instead)."""
        model, d, s = self.model, self._dev, self._slices
        k = self._kernels
        plan = k.plan_triton_static(batch, self._table, model.params, self._nb_pos, self._nb_time)
        item = d[s["item"].start : s["item"].start + key.tokens]
        aux = d[s["aux"].start : s["aux"].start + key.tokens]
        x = model.embed(item, aux)

        def attend(q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return k.hstu_attention_static(q, kk, v, batch, plan, layer, model.params)

        if key.mode in (PREINFER, CHUNK):
            assert self._kv_out is not None
            model.layers_writing(x, attend, self._kv_out)
            return None
        if key.mode == FULL_KEEP:
            assert self._kv_out is not None
            x = model.layers_writing(x, attend, self._kv_out, last=True)
        else:
            x = model.layers_forward(x, attend)
        cand = d[s["cand"].start : s["cand"].start + key.tokens]
        return model.score_rows(x, cand)

    @torch.inference_mode()
    def _capture(self, key: BucketKey) -> _Graph:
        if key.mode in (PREINFER, CHUNK, FULL_KEEP) and self._kv_out is None:
            spec = self.model.spec
            self._kv_out = torch.empty(
                spec.num_layers, 2, self.limits.max_full_tokens, spec.hidden,
                dtype=self._anchor.dtype, device=self.model.device,
            )  # fmt: skip
        batch = self._static_batch(key)
        # An empty batch (every sequence of length 0) for the warm-up runs: they compile the
        # kernels and set up cuBLAS without computing anything that matters.
        slot = self._next_slot()
        slot.staging_np[:] = 0
        self._copy_staging(slot)
        slot.close(self.model.device)
        current = torch.cuda.current_stream(self.model.device)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(key, batch)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the pre-inference thread may use the device meanwhile (its own stream).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self._forward(key, batch)
        return _Graph(graph, logits)


class GraphStatsCollector(Collector):
    """Prometheus view of a RankGraphs' GraphStats, read at scrape time: batches per graph family
    (cached, full, preinfer) served by a replay and run eagerly (CUDA only)."""

    def __init__(self, stats: GraphStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        replays = CounterMetricFamily(
            "relaygr_ranker_graph_replays",
            "batches served by a CUDA graph replay, by family",
            labels=["family"],
        )
        eager = CounterMetricFamily(
            "relaygr_ranker_graph_eager_batches",
            "batches of a graph family run eagerly (no graph for the shape yet, too large, or a "
            "pre-inference chunk that reads psi)",
            labels=["family"],
        )
        for family, counts in self._stats.counts().items():
            replays.add_metric([family], counts["replays"])
            eager.add_metric([family], counts["eager"])
        yield replays
        yield eager
