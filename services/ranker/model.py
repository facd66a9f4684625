"""HSTU generative-recommendation ranking model with relay-race (cached-prefix) inference.

Token sequence of one ranking call: [U | S_l | eS_l | I]. Three entry points share the weights
and the attention kernels:

  full(prefixes, suffixes)            scores [U, S_l, eS_l, I] from scratch (the baseline)
  preinfer(prefixes)                  runs [U, S_l] and returns psi (per-layer K/V + timestamps)
  rank_cached(suffixes, psis, keys)   scores [eS_l, I] against psi

and, for psi built in chunks (the engine's scheduler, services/ranker/scheduler.py):

  new_psi(prefix[, timestamps])       psi's block, allocated for the whole prefix, nothing built
  preinfer_chunks(chunks)             prefix tokens [start, end) against psi[:start], their K/V
                                      written in place into psi[start:end]
  rank_partial(prefixes, suffixes, psis, built)
                                      scores [U, S_l, eS_l, I] reading psi[:built] and computing
                                      the rest of the prefix (whose K/V it writes into psi, which
                                      is then complete) and the suffix

A prefix token is a history token like any other (causal, position = its index), so for any
split point c, f([tokens c.. of the prefix, eS_l, I]; psi[:c]) == f([U, S_l, eS_l, I]).

HSTU layer (Zhai et al., arXiv 2402.17152):  U, V, Q, K = split(SiLU(W1 LN(x)));
A = SiLU(QK^T / sqrt(d) + rab_pos + rab_time) / attn_norm, masked;  x += W2 (LN(A V) * U).
Every layer is causal over the history; a candidate sees the whole history and itself only.
Because attn_norm is a constant and attention is causal, the prefix's K/V (psi) are the same
whatever follows it, which is what makes rank_cached(preinfer(p), s) == full(p + s).

All entry points take batches of users with different lengths, concatenated without padding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from kernels.fused_norms import add_norm, norm_gate
from kernels.host_view import HostStaging
from kernels.hstu_attention import (
    AttentionImpl,
    AttentionParams,
    BiasTables,
    PrefixKV,
    SeqLayout,
    hstu_attention,
    prepare_attention,
)
from services.ranker.psi import Psi, PsiKey, PsiSizeClasses, psi_memory
from services.ranker.sequences import Behaviors, InvalidSequenceError, RankingSuffix, UserPrefix
from shared.modelspec import ModelSpec

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HSTULayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        d = spec.hidden
        self.spec = spec
        self.norm_in = nn.LayerNorm(d, eps=spec.layer_norm_eps, dtype=dtype)
        self.uvqk = nn.Linear(d, 4 * d, dtype=dtype)
        self.norm_attn = nn.LayerNorm(d, eps=spec.layer_norm_eps, dtype=dtype)
        self.out = nn.Linear(d, d, dtype=dtype)
        # Relative attention bias per head, kept in float32 (read by the kernels as such).
        self.pos_bias = nn.Parameter(torch.zeros(spec.num_heads, spec.num_pos_buckets))
        self.time_bias = nn.Parameter(torch.zeros(spec.num_heads, spec.num_time_buckets))
        # The norms fused with what is around them on CUDA (kernels/fused_norms.py):
        # HSTURanker.fuse_norms.
        self.fused_norms = False

    def project(
        self, x: torch.Tensor, normed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """u, v, q, k as [T, H*D] views of one SiLU(W1 LN(x)) tensor. `normed`: LN(x) where the
        layer before computed it with x (finish, given this layer's norm_in)."""
        uvqk = F.silu(self.uvqk(self.norm_in(x) if normed is None else normed))
        u, v, q, k = uvqk.split(self.spec.hidden, dim=1)
        return u, v, q, k

    def finish(
        self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor, next_norm: nn.LayerNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output, x + W_o(LN(attn) * u), and with `next_norm` (the next layer's
        norm_in) that norm of it, for the next project (kernels/fused_norms.py: one kernel each
        with fused_norms on CUDA); None without."""
        norm = self.norm_attn
        gate = norm_gate(attn, u, norm.weight, norm.bias, norm.eps, fused=self.fused_norms)
        out = self.out(gate)
        if next_norm is None:
            return x + out, None
        return add_norm(x, out, next_norm.weight, next_norm.bias, next_norm.eps, fused=self.fused_norms)


# The attention of one forward pass: (q, k, v as [T, H, D], layer index) -> [T, H, D].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class HostTokens:
    """A jagged batch's token layout on the host, before any device copy."""

    columns: torch.Tensor  # [3, T] int64: item index, aux index, timestamp
    candidate_rows: torch.Tensor  # [C] int64: row of every candidate token, in request order
    lengths: list[int]
    n_hist: list[int]
    candidate_counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return int(self.columns.shape[1])


@dataclass(frozen=True)
class _HostPart:
    """n tokens of one kind on the host: item index, aux index, timestamp (arrays, or a scalar
    that every token shares)."""

    items: npt.NDArray[np.int64] | int
    aux: npt.NDArray[np.int64] | int
    timestamps: npt.NDArray[np.int64] | int
    n: int

    def slice(self, start: int, end: int) -> _HostPart:
        """Tokens [start, end) of this part (0 <= start <= end <= n)."""

        def cut(values: npt.NDArray[np.int64] | int) -> npt.NDArray[np.int64] | int:
            return values if isinstance(values, int) else values[start:end]

        return _HostPart(cut(self.items), cut(self.aux), cut(self.timestamps), end - start)


def _cut(parts: list[_HostPart], start: int, end: int) -> list[_HostPart]:
    """Tokens [start, end) of parts laid end to end."""
    out: list[_HostPart] = []
    offset = 0
    for part in parts:
        lo, hi = max(start - offset, 0), min(end - offset, part.n)
        if hi > lo:
            out.append(part.slice(lo, hi))
        offset += part.n
    return out


@dataclass(frozen=True)
class PrefixChunk:
    """One pre-inference chunk: prefix tokens [start, end) of `prefix`, computed against
    psi[:start] and written into psi[start:end] (psi: `HSTURanker.new_psi(prefix)`)."""

    prefix: UserPrefix
    psi: Psi
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.prefix.length:
            raise ValueError(f"chunk [{self.start}, {self.end}) of a {self.prefix.length}-token prefix")
        if self.psi.prefix_len != self.prefix.length:
            raise ValueError(f"psi of {self.psi.prefix_len} tokens for a {self.prefix.length}-token prefix")


@dataclass(frozen=True)
class _Tokens:
    """A jagged batch ready for the layers: embeddings' indices and layout, on the model's device."""

    item_idx: torch.Tensor
    aux_idx: torch.Tensor
    seq: SeqLayout
    candidate_rows: torch.Tensor  # global row of every candidate token, in request order
    candidate_counts: tuple[int, ...]


class HSTURanker(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        model_version: str,
        device: torch.device | str = "cpu",
        attention_impl: AttentionImpl = AttentionImpl.AUTO,
    ) -> None:
        super().__init__()
        spec.validate()
        self.spec = spec
        self.model_version = model_version
        self.attention_impl = attention_impl
        dtype = _TORCH_DTYPES[spec.dtype]
        d = spec.hidden
        self.item_emb = nn.Embedding(spec.num_items, d, padding_idx=0, dtype=dtype)
        # aux rows: actions, then the candidate marker, then user-profile features.
        self.aux_emb = nn.Embedding(spec.num_actions + 1 + spec.num_profile_features, d, dtype=dtype)
        self.layers = nn.ModuleList(HSTULayer(spec, dtype) for _ in range(spec.num_layers))
        self.norm_out = nn.LayerNorm(d, eps=spec.layer_norm_eps, dtype=dtype)
        self.head = nn.Sequential(
            nn.Linear(d, spec.head_hidden, dtype=dtype),
            nn.SiLU(),
            nn.Linear(spec.head_hidden, 1, dtype=dtype),
        )
        self._bias_cache: tuple[tuple[tuple[int, int], ...], BiasTables] | None = None
        # Set by an engine whose batches' copies go by kernel (batch_copies "kernel"): a new psi's
        # timestamps reach the device the same way (new_psi), not on a copy engine.
        self.host_staging: HostStaging | None = None
        # Set by a ranker that allocates psi in size classes (--psi-size-classes): new_psi's blocks.
        self.psi_classes: PsiSizeClasses | None = None
        self.params = AttentionParams(
            alpha=spec.head_dim**-0.5,
            inv_norm=1.0 / spec.attn_norm,
            pos_mantissa_bits=spec.pos_mantissa_bits,
            time_mantissa_bits=spec.time_mantissa_bits,
        )
        self.to(device)
        self.eval()

    # ------------------------------------------------------------------ construction and storage

    @classmethod
    def from_seed(
        cls,
        spec: ModelSpec,
        seed: int,
        device: torch.device | str = "cpu",
        attention_impl: AttentionImpl = AttentionImpl.AUTO,
    ) -> HSTURanker:
        """Deterministic weights from a seed (drawn on the CPU, so every device gets the same)."""
        spec_hash = hashlib.sha256(spec.to_json().encode()).hexdigest()[:10]
        model = cls(spec, f"{spec.name}-seed{seed}-{spec_hash}", "cpu", attention_impl)
        gen = torch.Generator().manual_seed(seed)
        d = spec.hidden
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("pos_bias") or name.endswith("time_bias"):
                    values = torch.randn(p.shape, generator=gen) * 0.5
                elif "norm" in name:
                    values = (1.0 if name.endswith("weight") else 0.0) + 0.05 * torch.randn(
                        p.shape, generator=gen
                    )
                elif name.endswith("bias"):
                    values = 0.02 * torch.randn(p.shape, generator=gen)
                elif p.dim() == 2 and ("emb" in name):
                    values = torch.randn(p.shape, generator=gen) * 0.5
                else:
                    values = torch.randn(p.shape, generator=gen) * (
                        p.shape[1] ** -0.5 if p.dim() == 2 else d**-0.5
                    )
                p.copy_(values.to(p.dtype))
            model.item_emb.weight[0].zero_()
        return model.to(device)

    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(
            tensors, str(path), metadata={"model_version": self.model_version, "spec": self.spec.to_json()}
        )

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: torch.device | str = "cpu",
        attention_impl: AttentionImpl = AttentionImpl.AUTO,
    ) -> HSTURanker:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "model_version" not in meta or "spec" not in meta:
            raise ValueError(f"{path}: not a RelayGR checkpoint (no model_version/spec metadata)")
        model = cls(ModelSpec.from_json(meta["spec"]), meta["model_version"], "cpu", attention_impl)
        model.load_state_dict(load_file(str(path)))
        return model.to(device)

    def _stack(self) -> list[HSTULayer]:
        return [cast(HSTULayer, layer) for layer in self.layers]

    def fuse_norms(self, fused: bool) -> None:
        """Whether every layer computes LayerNorm(attn) * u, and its residual sum with the next
        layer's norm of it, as one kernel each on CUDA (kernels/fused_norms.py) or as torch's
        two each. Set before any CUDA graph is captured (a graph keeps the kernels it was
        captured with)."""
        for layer in self._stack():
            layer.fused_norms = fused

    @property
    def fused_norms(self) -> bool:
        return any(layer.fused_norms for layer in self._stack())

    def _next_norms(self) -> list[nn.LayerNorm | None]:
        """Per layer, the next layer's input norm (None after the last): what finish computes
        with the layer's output."""
        stack = self._stack()
        return [layer.norm_in for layer in stack[1:]] + [None]

    @property
    def device(self) -> torch.device:
        return self.item_emb.weight.device

    def psi_key(self, user_id: int, prefix_version: int, fingerprint: int) -> PsiKey:
        """The key of psi this model computes for that prefix (fingerprint: its content digest)."""
        return PsiKey(user_id, prefix_version, self.model_version, fingerprint)

    # ------------------------------------------------------------------ entry points

    @torch.inference_mode()
    def full(
        self,
        prefixes: Sequence[UserPrefix],
        suffixes: Sequence[RankingSuffix],
        psis: Sequence[Psi | None] | None = None,
    ) -> list[torch.Tensor]:
        """Scores of every candidate, computing the whole [U, S_l, eS_l, I] sequence. With
        `psis`, user b's prefix K/V are also written into psis[b] (a block from new_psi; None:
        not kept), which is complete afterwards: the ranking leaves the psi a later call reads."""
        tokens = self._on_device(self.pack_full(prefixes, suffixes))
        if psis is not None and any(p is not None for p in psis):
            if len(psis) != len(prefixes):
                raise InvalidSequenceError("full() needs one psi (or None) per prefix")
            for p, psi in zip(prefixes, psis, strict=True):
                if psi is not None:
                    self._check_block(p, psi)
            writes = [p.length if psi is not None else 0 for p, psi in zip(prefixes, psis, strict=True)]
            x = self._forward_writing(tokens, [(psi, 0) for psi in psis], writes, last=True)
            return self._score(x, tokens)
        x = self._embed(tokens)
        x = self.layers_forward(x, self._prepare(tokens.seq, None))
        return self._score(x, tokens)

    def _check_block(self, p: UserPrefix, psi: Psi) -> None:
        """psi must be this prefix's block (its key names the prefix's content)."""
        if psi.prefix_len != p.length or psi.key != self.psi_key(
            p.user_id, p.prefix_version, p.fingerprint.digest
        ):
            raise ValueError(f"psi of {psi.key} ({psi.prefix_len} tokens) is not this prefix's")

    def preinfer(self, prefixes: Sequence[UserPrefix]) -> list[Psi]:
        """psi for each user's prefix [U, S_l]: per-layer K/V and the prefix timestamps."""
        steps = self.preinfer_steps(prefixes)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return list(done.value)

    def preinfer_steps(self, prefixes: Sequence[UserPrefix]) -> Generator[int, None, list[Psi]]:
        """preinfer() one layer at a time: yields the layer index just finished, returns the psis.

        Lets the engine interleave ranking batches between the layers of a long pre-inference.
        Each step runs under inference mode on its own (generators cannot hold the context).
        """
        with torch.inference_mode():
            tokens = self._tokens(
                [[self._profile_part(p), self._behavior_part(p.long_term)] for p in prefixes], None
            )
            x = self._embed(tokens)
            seq = tokens.seq
            attend = self._prepare(seq, None)
            num_layers, total = self.spec.num_layers, seq.total_tokens
            kv_all = torch.empty(num_layers, 2, total, self.spec.hidden, dtype=x.dtype, device=x.device)
        normed, next_norms = None, self._next_norms()
        for index, layer in enumerate(self._stack()):
            with torch.inference_mode():
                u, v, q, k = layer.project(x, normed)
                normed = None  # consumed: not held through the attention
                kv_all[index, 0].copy_(k)
                kv_all[index, 1].copy_(v)
                if index + 1 < num_layers:  # the last layer's output is never needed: psi is its K/V
                    shape = (total, self.spec.num_heads, self.spec.head_dim)
                    attn = attend(q.view(shape), k.view(shape), v.view(shape), index)
                    x, normed = layer.finish(x, attn.reshape(total, self.spec.hidden), u, next_norms[index])
            yield index
        psis = []
        with torch.inference_mode():
            for b, p in enumerate(prefixes):
                start, end = seq.offsets_host[b], seq.offsets_host[b + 1]
                block = kv_all if len(prefixes) == 1 else kv_all[:, :, start:end].contiguous()
                key = self.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest)
                psis.append(Psi(key, block, seq.timestamps[start:end].clone()))
        return psis

    @torch.inference_mode()
    def rank_cached(
        self, suffixes: Sequence[RankingSuffix], psis: Sequence[Psi], keys: Sequence[PsiKey]
    ) -> list[torch.Tensor]:
        """Scores of [eS_l, I] against each user's psi. Raises PsiMismatchError on a foreign psi."""
        if not len(suffixes) == len(psis) == len(keys):
            raise InvalidSequenceError("rank_cached() needs one psi and one key per suffix")
        for psi, key in zip(psis, keys, strict=True):
            psi.require_match(key)
            if psi.kv.device != self.device:
                raise ValueError(f"psi of {key} is on {psi.kv.device}, the model on {self.device}")
        tokens = self._tokens([[self._behavior_part(s.recent)] for s in suffixes], suffixes)
        prefix = PrefixKV.build([p.kv for p in psis], [p.timestamps for p in psis])
        x = self._embed(tokens)
        x = self.layers_forward(x, self._prepare(tokens.seq, prefix))
        return self._score(x, tokens)

    # ------------------------------------------------------------------ psi built in chunks

    @torch.inference_mode()
    def new_psi(self, prefix: UserPrefix, timestamps: bool = True) -> Psi:
        """psi's block for the whole prefix, on the model's device, with nothing built yet: chunks
        (`preinfer_chunks`) or a ranking call (`rank_partial`) fill it in place. With `timestamps`
        False the prefix's timestamps are left unwritten too: for a caller that copies them from
        a batch already on the device (RankGraphs.launch_full)."""
        n, spec = prefix.length, self.spec
        kv, ts, block = psi_memory(
            spec.num_layers, n, spec.hidden, self.item_emb.weight.dtype, self.device, self.psi_classes
        )
        key = self.psi_key(prefix.user_id, prefix.prefix_version, prefix.fingerprint.digest)
        if not timestamps:
            return Psi(key, kv, ts, block)
        # Profile tokens have timestamp 0, then the long-term behaviours'. On CUDA written into
        # one host buffer, page-locked, then copied: from pageable memory a copy returns only once
        # the stream has run it, behind any replay queued before (a full ranking keeping psi
        # waited for its own pass and the batch launched ahead of it); from page-locked memory
        # (torch's cached host allocator) it is queued and returns at once. (A concatenation, then
        # a copy into page-locked memory, cost ~0.2 ms of the device loop per full ranking on an
        # H200.) On the CPU written in place.
        cuda = self.device.type == "cuda"
        profile = prefix.profile.numel()
        if cuda and self.host_staging is not None:  # moved by a kernel: no copy engine in its way

            def fill(host: np.ndarray) -> None:
                host[:profile] = 0
                host[profile:] = prefix.long_term.timestamps.numpy()

            self.host_staging.copy(ts, fill)
            return Psi(key, kv, ts, block)
        host_ts = torch.empty(n, dtype=torch.int64, pin_memory=True) if cuda else ts
        host = host_ts.numpy()
        host[:profile] = 0
        host[profile:] = prefix.long_term.timestamps.numpy()
        if cuda:
            ts.copy_(host_ts, non_blocking=True)
        return Psi(key, kv, ts, block)

    @torch.inference_mode()
    def preinfer_chunks(self, chunks: Sequence[PrefixChunk]) -> None:
        """Runs each chunk's prefix tokens against the psi built before it and writes their K/V
        into psi in place. Chunks of one batch belong to different users (a chunk reads only
        what earlier batches wrote)."""
        if not chunks:
            return
        if len({id(c.psi) for c in chunks}) != len(chunks):
            raise ValueError("one chunk per psi in a batch: a chunk reads what the one before wrote")
        tokens = self._on_device(self.pack_chunks(chunks))
        self._forward_writing(
            tokens, [(c.psi, c.start) for c in chunks], [c.end - c.start for c in chunks], last=False
        )

    @torch.inference_mode()
    def rank_partial(
        self,
        prefixes: Sequence[UserPrefix],
        suffixes: Sequence[RankingSuffix],
        psis: Sequence[Psi],
        built: Sequence[int],
    ) -> list[torch.Tensor]:
        """Scores of [U, S_l, eS_l, I] for each user, reading the first built[b] prefix tokens'
        K/V from psi and computing the rest of the prefix and the suffix. The K/V of the prefix
        tokens it computes are written into psi, which is complete afterwards. built[b] may be
        anything from 0 (psi is only a block: a full ranking that also produces psi) to the
        prefix length (a ranking against complete psi)."""
        if not len(prefixes) == len(suffixes) == len(psis) == len(built):
            raise InvalidSequenceError("rank_partial() needs one suffix, psi and split per prefix")
        for p, psi, c in zip(prefixes, psis, built, strict=True):
            self._check_block(p, psi)
            if not 0 <= c <= p.length:
                raise ValueError(f"split {c} outside a {p.length}-token prefix")
        history = [
            [*_cut(self._prefix_parts(p), c, p.length), self._behavior_part(s.recent)]
            for p, s, c in zip(prefixes, suffixes, built, strict=True)
        ]
        tokens = self._tokens(history, suffixes)
        rest = [p.length - c for p, c in zip(prefixes, built, strict=True)]
        x = self._forward_writing(tokens, list(zip(psis, built, strict=True)), rest, last=True)
        return self._score(x, tokens)

    def _forward_writing(
        self, tokens: _Tokens, targets: Sequence[tuple[Psi | None, int]], writes: list[int], last: bool
    ) -> torch.Tensor:
        """Every layer over the batch's new tokens, each sequence b against targets[b]'s psi up to
        its split; the K/V of sequence b's first writes[b] new tokens are written into that psi
        from the split on (a None psi: split 0, nothing written). `last`: run the last layer's
        attention too (a ranking needs its output; a chunk only its K/V)."""
        prefix = None
        if any(c for _, c in targets):
            psis = [psi for psi, _ in targets if psi is not None]
            if len(psis) != len(targets):
                raise ValueError("a sequence that reads psi needs its psi")
            # The built part read in place: the first c tokens of each block (the kernels stride
            # its layers by the block's own length), not a contiguous copy of them (320-500 MB a
            # step at 10-16k tokens of the bench preset, allocated while HBM is full).
            splits = [c for _, c in targets]
            prefix = PrefixKV.build(
                [p.kv for p in psis], [p.timestamps[:c] for p, c in zip(psis, splits, strict=True)], splits
            )
        seq = tokens.seq
        attend = self._prepare(seq, prefix)
        x = self._embed(tokens)
        total, num_layers = seq.total_tokens, self.spec.num_layers
        shape = (total, self.spec.num_heads, self.spec.head_dim)
        normed, next_norms = None, self._next_norms()
        for index, layer in enumerate(self._stack()):
            u, v, q, k = layer.project(x, normed)
            normed = None  # consumed: not held through the attention
            for b, ((psi, c), n) in enumerate(zip(targets, writes, strict=True)):
                if n and psi is not None:
                    start = seq.offsets_host[b]
                    psi.kv[index, 0, c : c + n].copy_(k[start : start + n])
                    psi.kv[index, 1, c : c + n].copy_(v[start : start + n])
            if last or index + 1 < num_layers:  # a chunk's last layer: only its K/V are needed
                attn = attend(q.view(shape), k.view(shape), v.view(shape), index)
                x, normed = layer.finish(x, attn.reshape(total, self.spec.hidden), u, next_norms[index])
        return x

    # ------------------------------------------------------------------ internals

    def _prefix_parts(self, p: UserPrefix) -> list[_HostPart]:
        return [self._profile_part(p), self._behavior_part(p.long_term)]

    # Host-side token parts are numpy views of the request's tensors: a batch is packed with a few
    # numpy operations instead of a dozen small torch operations per user (~5x less CPU time on
    # the ranking call's critical path).

    def _profile_part(self, p: UserPrefix) -> _HostPart:
        # Profile tokens carry no item, timestamp 0; aux rows after actions and the candidate marker.
        aux = self.spec.num_actions + 1 + p.profile.numpy() % self.spec.num_profile_features
        return _HostPart(0, aux, 0, len(aux))

    def _behavior_part(self, b: Behaviors) -> _HostPart:
        items = b.items.numpy()
        return _HostPart(
            1 + items % (self.spec.num_items - 1), b.actions.numpy() % self.spec.num_actions,
            b.timestamps.numpy(), len(items),
        )  # fmt: skip

    def pack_suffixes(self, suffixes: Sequence[RankingSuffix]) -> HostTokens:
        """The host-side token layout of rank_cached's new tokens ([eS_l, I] per user)."""
        return self._pack([[self._behavior_part(s.recent)] for s in suffixes], suffixes)

    def pack_full(self, prefixes: Sequence[UserPrefix], suffixes: Sequence[RankingSuffix]) -> HostTokens:
        """The host-side token layout of full()'s sequences ([U, S_l, eS_l, I] per user)."""
        if len(prefixes) != len(suffixes):
            raise InvalidSequenceError("full() needs one suffix per prefix")
        return self._pack(
            [
                [*self._prefix_parts(p), self._behavior_part(s.recent)]
                for p, s in zip(prefixes, suffixes, strict=True)
            ],
            suffixes,
        )

    def pack_chunks(self, chunks: Sequence[PrefixChunk]) -> HostTokens:
        """The host-side token layout of pre-inference chunks (prefix tokens [start, end) each)."""
        return self._pack([_cut(self._prefix_parts(c.prefix), c.start, c.end) for c in chunks], None)

    def layers_writing(
        self, x: torch.Tensor, attend: Attend, kv_out: torch.Tensor, last: bool = False
    ) -> torch.Tensor:
        """Every HSTU layer over new tokens x [T, d], writing layer i's K/V of those tokens into
        kv_out[i, 0 / 1, :T]; returns the last layer's output. Without `last`, the last layer's
        attention is skipped (psi is only its K/V) and its input is returned: what a
        pre-inference step computes; with it, a ranking pass that also keeps its K/V. On buffers
        a CUDA graph can hold."""
        total, num_layers = x.shape[0], self.spec.num_layers
        shape = (total, self.spec.num_heads, self.spec.head_dim)
        normed, next_norms = None, self._next_norms()
        for index, layer in enumerate(self._stack()):
            u, v, q, k = layer.project(x, normed)
            normed = None  # consumed: not held through the attention
            kv_out[index, 0, :total].copy_(k)
            kv_out[index, 1, :total].copy_(v)
            if last or index + 1 < num_layers:
                attn = attend(q.view(shape), k.view(shape), v.view(shape), index)
                x, normed = layer.finish(x, attn.reshape(total, self.spec.hidden), u, next_norms[index])
        return x

    def _pack(
        self, history_parts: list[list[_HostPart]], suffixes: Sequence[RankingSuffix] | None
    ) -> HostTokens:
        """Concatenates every user's [history..., candidates] on the host."""
        n_hist = [sum(p.n for p in parts) for parts in history_parts]
        counts = tuple(s.candidates.numel() for s in suffixes) if suffixes is not None else ()
        lengths = [h + c for h, c in zip(n_hist, counts, strict=True)] if suffixes is not None else n_hist
        too_long = [n for n in lengths if n > self.spec.max_sequence_len]
        if too_long:
            raise InvalidSequenceError(
                f"sequence of {too_long[0]} tokens exceeds {self.spec.max_sequence_len}"
            )
        columns = np.empty((3, sum(lengths)), dtype=np.int64)
        rows = np.empty(sum(counts), dtype=np.int64)
        row = cand = 0
        for b, parts in enumerate(history_parts):
            for part in parts:
                end = row + part.n
                columns[0, row:end] = part.items
                columns[1, row:end] = part.aux
                columns[2, row:end] = part.timestamps
                row = end
            if suffixes is not None:
                s, c = suffixes[b], counts[b]
                # Every candidate carries the query time: SeqLayout's one-timestamp contract.
                columns[0, row : row + c] = 1 + s.candidates.numpy() % (self.spec.num_items - 1)
                columns[1, row : row + c] = self.spec.num_actions
                columns[2, row : row + c] = s.query_time
                rows[cand : cand + c] = np.arange(row, row + c)
                row, cand = row + c, cand + c
        return HostTokens(torch.from_numpy(columns), torch.from_numpy(rows), lengths, n_hist, counts)

    def _tokens(
        self, history_parts: list[list[_HostPart]], suffixes: Sequence[RankingSuffix] | None
    ) -> _Tokens:
        """_pack, then one copy to the device."""
        return self._on_device(self._pack(history_parts, suffixes))

    def _on_device(self, packed_host: HostTokens) -> _Tokens:
        """A packed batch on the model's device (one copy) with its sequence layout."""
        row = packed_host.total
        packed = torch.cat([packed_host.columns.reshape(-1), packed_host.candidate_rows])
        if self.device.type != "cpu":
            packed = packed.pin_memory()  # so the copy below is truly asynchronous
        packed = packed.to(self.device, non_blocking=True)
        item_idx, aux_idx, ts = packed[: 3 * row].view(3, row)
        seq = SeqLayout.build(
            packed_host.lengths, packed_host.n_hist, ts, host_timestamps=packed_host.columns[2]
        )
        return _Tokens(item_idx, aux_idx, seq, packed[3 * row :], packed_host.candidate_counts)

    def _embed(self, tokens: _Tokens) -> torch.Tensor:
        return self.embed(tokens.item_idx, tokens.aux_idx)

    def embed(self, item_idx: torch.Tensor, aux_idx: torch.Tensor) -> torch.Tensor:
        return self.item_emb(item_idx) + self.aux_emb(aux_idx)

    def bias_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's relative-bias tables: pos [L, H, NB_POS], time [L, H, NB_TIME]."""
        layers = self._stack()
        return torch.stack([layer.pos_bias for layer in layers]), torch.stack(
            [layer.time_bias for layer in layers]
        )

    def attention_bias(self) -> BiasTables:
        """The bias tables with their kernel forms, derived once for the current weights: a new
        BiasTables whenever a layer's bias parameter changed in place (load_state_dict, copy_:
        each bumps the tensor's version counter) or moved."""
        layers = self._stack()
        stamp = tuple(
            (p._version, p.data_ptr()) for layer in layers for p in (layer.pos_bias, layer.time_bias)
        )
        cached = self._bias_cache
        if cached is None or cached[0] != stamp:
            pos, time = (t.detach() for t in self.bias_tables())
            cached = (stamp, BiasTables(pos, time, self.spec.pos_mantissa_bits))
            self._bias_cache = cached
        return cached[1]

    def _prepare(self, seq: SeqLayout, prefix: PrefixKV | None) -> Attend:
        bias = self.attention_bias()
        batch = prepare_attention(
            seq, prefix, bias.pos, bias.time, self.params, self.spec.head_dim, self.attention_impl, bias
        )
        return lambda q, k, v, index: hstu_attention(q, k, v, batch, index)

    def layers_forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Every HSTU layer over new tokens x [T, d]; attend(q, k, v, layer) is the attention,
        q/k/v as [T, H, D] views."""
        shape = (x.shape[0], self.spec.num_heads, self.spec.head_dim)
        normed, next_norms = None, self._next_norms()
        for index, layer in enumerate(self._stack()):
            u, v, q, k = layer.project(x, normed)
            normed = None  # consumed: not held through the attention
            attn = attend(q.view(shape), k.view(shape), v.view(shape), index)
            x, normed = layer.finish(x, attn.reshape(x.shape[0], self.spec.hidden), u, next_norms[index])
        return x

    def score_rows(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits of the tokens at `rows` of x."""
        return self.head(self.norm_out(x.index_select(0, rows))).squeeze(-1).float()

    def _score(self, x: torch.Tensor, tokens: _Tokens) -> list[torch.Tensor]:
        return list(self.score_rows(x, tokens.candidate_rows).split(list(tokens.candidate_counts)))
