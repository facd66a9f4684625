"""Where a user goes: rendezvous hashing with a load bound. A pure function (no I/O, no clock).

Every router replica (and the trigger, which accounts pre-inference per instance) computes the
same order from the same inputs, without talking to each other, because the order depends only on
(user id, instance ids, loads) and a stable hash (blake2b, never Python's salted `hash()`).

* Rendezvous / highest-random-weight (HRW) hashing: each instance gets a score
  `stable_hash(user, instance)`; the user's order is by descending score. When an instance leaves,
  only the users whose first choice it was move (each to its own second choice, so they spread
  evenly); when one joins, only the ~1/N users for whom it scores highest move to it.
* Bounded load: an instance whose load exceeds `(1 + load_factor) x mean load (+ slack)` is moved behind
  every instance that is not overloaded (HRW order kept within each group). Affinity that ignores
  load hot-spots an instance with a heavy user mix; the bound keeps every instance within
  `(1 + c) x average + slack + 1` while moving only the users of overloaded instances.
* Ties (equal 64-bit scores) are broken by 64 more per-user pseudo-random bits of the same digest,
  never by list position, so nothing piles onto "instance 0".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Instance", "preference", "stable_hash"]

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Instance:
    """A ranker instance as placement sees it: a stable id (its target, host:port, in the router)
    and a load figure in any unit, as long as every instance uses the same one (non-negative)."""

    id: str
    load: float


def _digest(user_id: int, instance_id: str) -> int:
    """128 bits: the high 64 are the HRW score, the low 64 the per-user tie-break."""
    h = hashlib.blake2b(digest_size=16, person=b"relaygr-hrw")
    h.update((user_id & _U64).to_bytes(8, "big"))
    h.update(instance_id.encode("utf-8"))
    return int.from_bytes(h.digest(), "big")


def stable_hash(user_id: int, instance_id: str) -> int:
    """The 64-bit HRW score of (user, instance): identical in every process and Python version.

    The user id is taken modulo 2**64 (it is a uint64 on the wire).
    """
    return _digest(user_id, instance_id) >> 64


def preference(
    user_id: int, instances: Sequence[Instance], load_factor: float = 0.25, *, slack: float = 0.0
) -> list[str]:
    """Every instance id in preference order for `user_id`: the first is the choice, the rest is
    the retry order. Deterministic in (user_id, the set of instances and their loads): the order of
    `instances` does not matter.

    An instance is overloaded when its load exceeds `(1 + load_factor) x mean + slack`. `slack`
    (default 0: the pure multiplicative bound) is an absolute allowance: with loads that are small
    integers (queue depths), a bound of 1.25 x a mean of 0.5 would otherwise move a user off its
    instance because of one queued call. Every party that must agree on placement (router
    replicas, the trigger) must pass the same `load_factor` and `slack`.

    Raises ValueError for an empty list, duplicate ids, a negative or non-finite load, a negative
    `load_factor` or `slack` (these are caller bugs: the router always has at least one healthy
    instance before it asks).
    """
    if not instances:
        raise ValueError("preference() needs at least one instance (no healthy ranker instance)")
    if not (load_factor >= 0 and math.isfinite(load_factor)):
        raise ValueError(f"load_factor must be a finite number >= 0, got {load_factor!r}")
    if not (slack >= 0 and math.isfinite(slack)):
        raise ValueError(f"slack must be a finite number >= 0, got {slack!r}")
    ids = {inst.id for inst in instances}
    if len(ids) != len(instances):
        raise ValueError("instance ids must be unique")
    for inst in instances:
        if not (inst.load >= 0 and math.isfinite(inst.load)):
            raise ValueError(f"instance {inst.id!r}: load must be finite and >= 0, got {inst.load!r}")
    mean = sum(inst.load for inst in instances) / len(instances)
    # With mean 0 every load is 0: nothing is overloaded and the order is pure HRW.
    bound = (1.0 + load_factor) * mean + slack

    def key(inst: Instance) -> tuple[bool, int, str]:
        overloaded = mean > 0 and inst.load > bound
        # Descending 128-bit digest = descending score, equal scores broken by the per-user tie
        # bits; the id last gives a total order that never depends on the input order.
        return overloaded, -_digest(user_id, inst.id), inst.id

    return [inst.id for inst in sorted(instances, key=key)]
