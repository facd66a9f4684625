"""CUDA graphs for ranking against psi: one captured forward pass per shape bucket, replayed.

Why: with a few hundred new tokens per user, rank_cached is bound by the host: ~70 kernel launches
issued from Python cost milliseconds, several times the GPU time. A replay issues them in one call.

How any batch fits a captured graph: every per-batch value the kernels read (sequence offsets,
psi addresses and lengths, timestamps) lives in static device buffers that
the host fills before each replay (kernels.hstu_attention StaticBatch); only sizes are baked in,
as upper bounds: a bucket (sequences, tokens, longest sequence). Kernel programs beyond the batch's
sizes exit at once; token rows beyond its tokens go through the row-wise layers (LayerNorm,
linear, SiLU) and are ignored, and attention only ever reads rows inside sequences, so they cannot
leak into real rows. psi blocks are addressed relative to one fixed anchor allocation.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.ranker.model import HSTURanker
from services.ranker.psi import Psi, PsiKey
from services.ranker.sequences import InvalidSequenceError, RankingSuffix
from shared.logging import get_logger

if TYPE_CHECKING:  # triton exists only where CUDA does: imported by RankGraphs at run time
    from kernels.hstu_attention.triton_impl import StaticBatch

log = get_logger("ranker.graphs")

_MIN_TOKENS = 64


@dataclass(frozen=True)
class GraphLimits:
    max_batch: int = 8  # sequences per graph (the engine's max_batch)
    max_tokens: int = 4096  # new tokens per batch
    max_prefix_tokens: int = 16_384  # per user; longer prefixes rank eagerly (GPU-bound anyway)
    rab_index_mb: float = 64.0  # static bias-index buffer
    max_graphs: int = 64

    def validate(self) -> GraphLimits:
        if min(self.max_batch, self.max_tokens, self.max_prefix_tokens, self.max_graphs) < 1:
            raise ValueError(f"graph limits must be >= 1: {self}")
        if self.rab_index_mb <= 0:
            raise ValueError("rab_index_mb must be > 0")
        return self


@dataclass(frozen=True, order=True)
class BucketKey:
    """Upper bounds a captured graph was sized for."""

    batch: int
    tokens: int
    max_len: int


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


def token_ladder(max_tokens: int) -> list[int]:
    """The bucket token capacities for max_tokens (see _ladder)."""
    return list(_ladder(max_tokens))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_for(batch: int, tokens: int, max_len: int, limits: GraphLimits) -> BucketKey | None:
    """The smallest bucket holding a batch of `batch` sequences, `tokens` new tokens in all and
    `max_len` in its longest sequence; None when it exceeds the limits."""
    if batch < 1 or batch > limits.max_batch or tokens > limits.max_tokens or max_len > tokens:
        return None
    ladder = _ladder(limits.max_tokens)  # cached: this runs for every ranking batch
    t = ladder[bisect.bisect_left(ladder, tokens)]
    b = min(_pow2_at_least(batch), limits.max_batch)
    length = min(t, max(_MIN_TOKENS, _pow2_at_least(max_len)))
    return BucketKey(b, t, length)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [key.tokens] float32: the scores of the candidate rows, padded
    replays: int = 0


@dataclass
class GraphStats:
    captured: int = 0
    replays: int = 0
    capture_ms: list[float] = field(default_factory=list)
    # Batches ranked eagerly, by reason: "no_graph_yet", "too_large", "prefix_too_long",
    # "graph_limit".
    fallbacks: dict[str, int] = field(default_factory=dict)


class RankGraphs:
    """Captured rank_cached forward passes of one model on one CUDA device."""

    def __init__(self, model: HSTURanker, limits: GraphLimits) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        from kernels.hstu_attention import triton_impl

        self._kernels = triton_impl
        self.model = model
        self.limits = limits.validate()
        self.stats = GraphStats()
        dev = model.device
        spec = model.spec
        b, t = limits.max_batch, limits.max_tokens
        # One int64 staging layout, host (pinned) and device: [item, aux, ts, candidate rows] x T,
        # then [offsets (B+1), n_hist, prefix lens, prefix ts offsets (B+1), kv offsets] x B.
        sizes = {"item": t, "aux": t, "ts": t, "cand": t, "offsets": b + 1, "n_hist": b, "plens": b,
                 "pts_off": b + 1, "kv_off": b}  # fmt: skip
        self._slices: dict[str, slice] = {}
        at = 0
        for name, n in sizes.items():
            self._slices[name] = slice(at, at + n)
            at += n
        self._host = torch.zeros(at, dtype=torch.int64).pin_memory()
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(at, dtype=torch.int64, device=dev)
        self._prefix_ts = torch.zeros(b * limits.max_prefix_tokens, dtype=torch.int64, device=dev)
        self._anchor = torch.empty(8, dtype=model.item_emb.weight.dtype, device=dev)
        # The weights never change under a serving model: the model's packed table, built once.
        self._table = model.attention_bias().packed
        self._nb_pos, self._nb_time = spec.num_pos_buckets, spec.num_time_buckets
        self._graphs: dict[BucketKey, _Graph] = {}
        self._pending: set[BucketKey] = set()
        self._pool = torch.cuda.graph_pool_handle()

    # ------------------------------------------------------------------ ranking

    def rank(
        self, suffixes: Sequence[RankingSuffix], psis: Sequence[Psi], keys: Sequence[PsiKey]
    ) -> list[torch.Tensor] | None:
        """Host float32 scores per suffix, as model.rank_cached computes them; None when this
        batch must run eagerly (see the module docstring). Raises what rank_cached raises on bad
        input (PsiMismatchError, InvalidSequenceError)."""
        model = self.model
        if not len(suffixes) == len(psis) == len(keys):
            raise InvalidSequenceError("rank() needs one psi and one key per suffix")
        for psi, psi_key in zip(psis, keys, strict=True):
            psi.require_match(psi_key)
            self._check_psi(psi)
        if any(p.prefix_len > self.limits.max_prefix_tokens for p in psis):
            return self._fallback("prefix_too_long")
        tokens = model.pack_suffixes(suffixes)
        key = bucket_for(len(suffixes), tokens.total, max(tokens.lengths, default=0), self.limits)
        if key is None:
            return self._fallback("too_large")
        graph = self._graphs.get(key)
        if graph is None:
            if len(self._graphs) + len(self._pending) < self.limits.max_graphs:
                self._pending.add(key)
                return self._fallback("no_graph_yet")
            return self._fallback("graph_limit")
        self._stage(key, tokens.columns.numpy(), tokens.candidate_rows.numpy(), tokens.lengths,
                    tokens.n_hist, psis)  # fmt: skip
        graph.graph.replay()
        graph.replays += 1
        self.stats.replays += 1
        count = int(tokens.candidate_rows.numel())
        return list(graph.logits[:count].cpu().split(list(tokens.candidate_counts)))

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

    def _fallback(self, reason: str) -> list[torch.Tensor] | None:
        """Counts why a batch runs eagerly; returns None (rank's answer for it)."""
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        return None

    def _stage(
        self,
        key: BucketKey,
        columns: np.ndarray,
        candidate_rows: np.ndarray,
        lengths: list[int],
        n_hist: list[int],
        psis: Sequence[Psi],
    ) -> None:
        """Fills the static inputs for this batch padded to `key`, then copies them to the device."""
        h, s = self._host_np, self._slices
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
        plens = [p.prefix_len for p in psis]
        put("plens", plens, 0, key.batch)
        pts_off = np.concatenate([[0], np.cumsum(plens)])
        put("pts_off", pts_off, int(pts_off[-1]), key.batch + 1)
        anchor, size = self._anchor.data_ptr(), self._anchor.element_size()
        put("kv_off", [(p.kv.data_ptr() - anchor) // size for p in psis], 0, key.batch)
        self._dev.copy_(self._host, non_blocking=True)
        ts_total = int(pts_off[-1])
        if len(psis) == 1:
            self._prefix_ts[:ts_total].copy_(psis[0].timestamps)
        elif ts_total:
            torch.cat([p.timestamps for p in psis], out=self._prefix_ts[:ts_total])

    # ------------------------------------------------------------------ capture

    def pending(self) -> list[BucketKey]:
        return sorted(self._pending)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def request(self, keys: Sequence[BucketKey]) -> None:
        """Buckets to capture at the next capture_pending() (e.g. at warm-up)."""
        for key in keys:
            if key not in self._graphs:
                self._pending.add(key)

    def capture_pending(self, limit: int = 1) -> int:
        """Captures up to `limit` remembered buckets; returns how many it captured."""
        done = 0
        while self._pending and done < limit:
            key = min(self._pending)
            self._pending.discard(key)
            if key in self._graphs or len(self._graphs) >= self.limits.max_graphs:
                continue
            started = time.perf_counter()
            self._graphs[key] = self._capture(key)
            ms = (time.perf_counter() - started) * 1e3
            self.stats.captured += 1
            self.stats.capture_ms.append(ms)
            log.info("rank_graph_captured", batch=key.batch, tokens=key.tokens, max_len=key.max_len,
                     ms=round(ms, 1), graphs=len(self._graphs))  # fmt: skip
            done += 1
        return done

    def _static_batch(self, key: BucketKey) -> StaticBatch:
        d, s = self._dev, self._slices

        def view(name: str, n: int) -> torch.Tensor:
            return d[s[name].start : s[name].start + n]

        k = self._kernels
        grid = k.StaticGrid.plan(key.batch, key.max_len, self.model.spec.num_heads, self.model.device,
                                 tokens=key.tokens, prefix_tokens=self.limits.max_prefix_tokens)  # fmt: skip
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
        )

    def _forward(self, key: BucketKey, batch: StaticBatch) -> torch.Tensor:
        """The captured work: reads only the static buffers, returns padded candidate logits."""
        model, d, s = self.model, self._dev, self._slices
        k = self._kernels
        plan = k.plan_triton_static(batch, self._table, model.params, self._nb_pos, self._nb_time)
        item = d[s["item"].start : s["item"].start + key.tokens]
        aux = d[s["aux"].start : s["aux"].start + key.tokens]
        x = model.embed(item, aux)
        x = model.layers_forward(
            x, lambda q, kk, v, layer: k.hstu_attention_static(q, kk, v, batch, plan, layer, model.params)
        )
        cand = d[s["cand"].start : s["cand"].start + key.tokens]
        return model.score_rows(x, cand)

    @torch.inference_mode()
    def _capture(self, key: BucketKey) -> _Graph:
        batch = self._static_batch(key)
        # An empty batch (every sequence of length 0) for the warm-up runs: they compile the
        # kernels and set up cuBLAS without computing anything that matters.
        self._host_np[:] = 0
        self._dev.copy_(self._host, non_blocking=True)
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
