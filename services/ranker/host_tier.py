"""The ranker's side of the host-DRAM tier: a reconnecting expander client plus psi copies.

The expander daemon owns the shared-memory arena and its bookkeeping; this module maps the
arena (registered as pinned memory on CUDA, so copies run at full PCIe speed on the copy engine),
and turns demote / reload into reserve -> copy -> commit and acquire -> copy -> release.

The tier is an optimisation: when the daemon is gone every call returns "not available"
(None / False) at once, the ranker goes on with HBM only, and a background task reconnects
(with backoff) and re-maps the arena of the new daemon generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import torch

from kernels.device import Accelerator
from services.ranker.engine import Engine
from services.ranker.psi import Psi, PsiKey, PsiSizeClasses
from services.ranker.transfer import (
    HOST_FORMATS,
    host_meta,
    host_nbytes,
    issue_from_host,
    issue_to_host,
    stored_nbytes,
)
from shared.expander.client import ExpanderClient, ExpanderRefused, ExpanderUnavailable
from shared.logging import get_logger
from shared.modelspec import ModelSpec

log = get_logger("ranker.host_tier")
_LEASE_S = 10.0


class HostTier:
    def __init__(
        self,
        socket_path: str,
        accel: Accelerator,
        on_change: Callable[[bool], None] | None = None,
        owner: str = "ranker",
        connect_timeout_s: float = 2.0,
        copy_piece_bytes: int = 0,
        psi_format: str = "native",
        spec: ModelSpec | None = None,
        psi_classes: PsiSizeClasses | None = None,
    ) -> None:
        """`copy_piece_bytes`: psi is copied in pieces of at most this many bytes (0: whole).
        `psi_format`: how psi is stored in the arena (transfer.py: "native", or "fp8" with its
        scales per head of the model `spec`, which it needs). Reloads read whatever format each
        psi was stored in. `psi_classes`: a reloaded psi's block in size classes (psi.py), as the
        ranker's other psi."""
        if psi_format not in HOST_FORMATS:
            raise ValueError(f"psi_format must be one of {', '.join(HOST_FORMATS)}, not {psi_format!r}")
        if psi_format != "native" and spec is None:
            raise ValueError(f"psi_format {psi_format!r} needs the model's spec")
        self.socket_path = socket_path
        self.accel = accel
        self.owner = owner
        self.copy_piece_bytes = copy_piece_bytes
        self.psi_format = psi_format
        self.spec = spec
        self.psi_classes = psi_classes
        self._on_change = on_change
        self._timeout = connect_timeout_s
        self._client: ExpanderClient | None = None
        self._arena: torch.Tensor | None = None
        self._pinned_at: int | None = None
        self._users = 0  # copies in flight against the current mapping
        self._idle = asyncio.Event()
        self._idle.set()
        self._reconnect: asyncio.Task[None] | None = None
        self._retiring: asyncio.Future[None] | None = None
        self._watch: asyncio.Future[None] | None = None
        self._closing = False
        self._releases: set[asyncio.Future[None]] = set()  # arena leases being given back

    def stored_nbytes(self, prefix_len: int) -> int | None:
        """Bytes a psi of `prefix_len` tokens takes in the arena, as this tier stores it (what a
        reload copies); None without the model's spec."""
        s = self.spec
        if s is None:
            return None
        return stored_nbytes(s.num_layers, prefix_len, s.hidden, s.dtype_bytes, self.psi_format, s.num_heads)

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def arena_bytes(self) -> int:
        """Size of the mapped arena (0 while not connected)."""
        arena = self._arena
        return 0 if arena is None else int(arena.numel() * arena.element_size())

    async def start(self) -> None:
        """Connects now if the daemon is up, else keeps trying in the background. Never raises."""
        if not await self._connect():
            self._schedule_reconnect()
        self._watch = asyncio.ensure_future(self._watch_loop())

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._reconnect is not None:
            self._reconnect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect
        if self._releases:  # before the connection goes (it would end the leases anyway)
            await asyncio.gather(*self._releases, return_exceptions=True)
        await self._drop()

    # ------------------------------------------------------------------ operations

    @property
    def indexed(self) -> bool:
        """The daemon keeps a presence index: may_hold() is an answer, not only a filter (it can
        still say True for a key it lost meanwhile, or that shares an index slot)."""
        client = self._client
        return client is not None and client.arena.presence is not None

    def may_hold(self, key: PsiKey) -> bool:
        """False when the daemon's presence index says it holds no readable psi under key: a
        lookup would find none (answered here, no round trip). True: ask with lookup()."""
        client = self._client
        return client is not None and client.may_hold(key)

    async def lookup(self, key: PsiKey) -> int | None:
        """Bytes of the psi held in host DRAM, or None. No side effects on the tier. Asks the
        daemon only where its presence index says it may hold the key."""
        client = self._client
        if client is None or not client.may_hold(key):
            return None
        try:
            info = await client.lookup(key)
        except ExpanderUnavailable:
            await self._lost()
            return None
        return None if info is None else int(info.nbytes)

    async def demote(self, key: PsiKey, psi: Psi, engine: Engine) -> bool:
        """Copies psi into the arena (reserve -> copy -> commit). False when not stored."""
        client, arena = self._client, self._arena
        if client is None or arena is None:
            return False
        meta = host_meta(psi, self.psi_format, 1 if self.spec is None else self.spec.num_heads)
        nbytes = host_nbytes(meta)
        try:
            reservation = await client.reserve(key, nbytes, meta, self.owner, _LEASE_S)
        except ExpanderRefused as exc:
            # "exists": an earlier demotion of this very psi is already there; the HBM copy can go.
            log.debug("demotion_refused", user=key.user_id, reason=exc.reason)
            return exc.reason == "exists"
        except ExpanderUnavailable:
            await self._lost()
            return False
        dest = arena[reservation.offset : reservation.offset + nbytes]
        self._use(+1)
        try:
            await engine.copy(lambda: issue_to_host(psi, dest, self.copy_piece_bytes, meta), work="demote")
            await client.commit(reservation.lease_id)
            return True
        except ExpanderUnavailable:
            await self._lost()
            return False
        except BaseException:
            with contextlib.suppress(ExpanderUnavailable, ExpanderRefused):
                await client.abort(reservation.lease_id)
            raise
        finally:
            self._use(-1)

    async def reload(
        self,
        key: PsiKey,
        engine: Engine,
        on_copied: Callable[[int, float], None] | None = None,
        on_acquired: Callable[[], None] | None = None,
    ) -> Psi | None:
        """psi back from the arena (acquire -> copy -> release), or None when not there.
        `on_copied(nbytes, device_seconds)`: the copy's own duration, once it completed;
        `on_acquired()`: the arena's lease on the bytes is held (the copy comes next). The
        release does not hold up the caller: psi is in HBM once the copy is done."""
        client, arena = self._client, self._arena
        if client is None or arena is None:
            return None
        try:
            acquired = await client.acquire(key, self.owner, _LEASE_S)
        except ExpanderUnavailable:
            await self._lost()
            return None
        if acquired is None:
            return None
        if on_acquired is not None:
            on_acquired()
        src = arena[acquired.offset : acquired.offset + acquired.nbytes]
        meta: dict[str, Any] = dict(acquired.meta)
        self._use(+1)
        try:
            nbytes = acquired.nbytes
            return await engine.copy(
                lambda: issue_from_host(
                    src,
                    meta,
                    key,
                    self.accel.device,
                    engine.compute_stream,
                    self.copy_piece_bytes,
                    classes=self.psi_classes,
                ),
                work="reload",
                on_timed=None if on_copied is None else (lambda seconds: on_copied(nbytes, seconds)),
            )
        finally:
            self._use(-1)
            self._release_later(client, acquired.lease_id)

    def _release_later(self, client: ExpanderClient, lease_id: int) -> None:
        async def release() -> None:
            with contextlib.suppress(ExpanderUnavailable, ExpanderRefused):
                await client.release(lease_id)

        task = asyncio.ensure_future(release())
        self._releases.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._releases.discard)

    # ------------------------------------------------------------------ connection management

    def _use(self, delta: int) -> None:
        self._users += delta
        if self._users:
            self._idle.clear()
        else:
            self._idle.set()

    async def _connect(self) -> bool:
        try:
            client = await ExpanderClient.connect(self.socket_path, self._timeout)
        except (ExpanderUnavailable, OSError) as exc:
            log.debug("expander_unreachable", socket=self.socket_path, error=repr(exc))
            return False
        mapping = client.arena
        self._client = client
        self._arena = mapping.tensor(0, mapping.nbytes)
        if self.accel.pin_host_range(mapping.base_address, mapping.nbytes):
            self._pinned_at = mapping.base_address
        log.info("expander_connected", socket=self.socket_path, arena_bytes=mapping.nbytes,
                 generation=mapping.generation, pinned=self._pinned_at is not None)  # fmt: skip
        if self._on_change:
            self._on_change(True)
        return True

    async def _lost(self) -> None:
        """The daemon is gone: stop using it now; unmap once copies against it have finished."""
        if self._client is None:
            return
        log.warning("expander_lost", socket=self.socket_path)
        self._retire()
        if self._on_change:
            self._on_change(False)
        self._schedule_reconnect()

    async def _drop(self) -> None:
        self._retire()
        if self._retiring is not None:
            await self._retiring

    def _retire(self) -> None:
        client, pinned = self._client, self._pinned_at
        self._client, self._arena, self._pinned_at = None, None, None
        if client is None:
            return

        async def release_mapping() -> None:
            await self._idle.wait()  # copies may still target the old mapping
            if pinned is not None:
                self.accel.unpin_host_range(pinned)
            with contextlib.suppress(Exception):
                await client.close()

        self._retiring = asyncio.ensure_future(release_mapping())

    async def _watch_loop(self, interval_s: float = 0.25) -> None:
        """Pings the daemon, so a dead one is noticed (and reported in Stats) without waiting for
        the next demotion or reload to fail."""
        while not self._closing:
            await asyncio.sleep(interval_s)
            client = self._client
            if client is None:
                continue
            try:
                await client.ping()
            except ExpanderUnavailable:
                await self._lost()

    def _schedule_reconnect(self) -> None:
        if self._closing or (self._reconnect is not None and not self._reconnect.done()):
            return
        self._reconnect = asyncio.ensure_future(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay = 0.05
        while not self._closing and self._client is None:
            await asyncio.sleep(delay)
            if await self._connect():
                return
            delay = min(delay * 2, 2.0)
