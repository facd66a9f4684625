"""Internal, validated inputs of the ranking model (tensors on the host).

The wire formats (protobuf, Kafka events) are converted into these at the service edge; nothing
past the edge passes dicts or protobuf messages around.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from shared.fingerprint import PrefixFingerprint, prefix_fingerprint


class InvalidSequenceError(ValueError):
    """A request's token sequence is malformed (a per-request error, never fatal)."""


def _any_negative(t: torch.Tensor) -> bool:
    """True when some value is negative. These are host tensors: numpy answers in a fraction of
    the time of a torch reduction (this runs for every ranking call)."""
    if not t.numel():
        return False
    if t.device.type == "cpu" and not t.requires_grad:
        return bool(t.numpy().min() < 0)
    return bool((t < 0).any())


def _as_ids(values: object, name: str) -> torch.Tensor:
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=torch.int64)
    if t.dim() != 1:
        raise InvalidSequenceError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t


@dataclass(frozen=True)
class Behaviors:
    """A run of behaviour tokens: item id, action type and event time (epoch seconds) each."""

    items: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor
    # True: the values were checked at the edge by the same rules (shared/prefix_check.py), and
    # are not scanned again (three scans a call, every call).
    checked: InitVar[bool] = False

    def __post_init__(self, checked: bool) -> None:
        n = self.items.numel()
        if self.actions.numel() != n or self.timestamps.numel() != n:
            raise InvalidSequenceError(
                f"behaviours need as many actions and timestamps as items "
                f"({n} items, {self.actions.numel()} actions, {self.timestamps.numel()} timestamps)"
            )
        if checked:
            return
        if _any_negative(self.items) or _any_negative(self.actions):
            raise InvalidSequenceError("item ids and actions must be non-negative")
        if _any_negative(self.timestamps):
            raise InvalidSequenceError("timestamps must be non-negative")

    @staticmethod
    def of(items: object, actions: object, timestamps: object) -> Behaviors:
        return Behaviors(
            _as_ids(items, "items"), _as_ids(actions, "actions"), _as_ids(timestamps, "timestamps")
        )

    @staticmethod
    def empty() -> Behaviors:
        z = torch.zeros(0, dtype=torch.int64)
        return Behaviors(z, z, z)

    def __len__(self) -> int:
        return self.items.numel()


def _host(t: torch.Tensor) -> npt.NDArray[np.int64]:
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


@dataclass(frozen=True)
class UserPrefix:
    """The cacheable prefix [U, S_l] of one user: profile tokens and long-term behaviours.

    `fingerprint` names its content (shared/fingerprint.py). The edge that decoded the prefix
    from the wire passes the one it computed there (`known_fingerprint`); otherwise it is
    computed here from the tensors, with the same result (the wire layout: actions as int32)."""

    user_id: int
    prefix_version: int
    profile: torch.Tensor  # profile feature ids
    long_term: Behaviors
    known_fingerprint: InitVar[PrefixFingerprint | None] = None
    checked: InitVar[bool] = False  # the profile's ids were checked at the edge (Behaviors.checked)
    fingerprint: PrefixFingerprint = field(init=False, repr=False, compare=False)

    def __post_init__(self, known_fingerprint: PrefixFingerprint | None, checked: bool) -> None:
        if self.profile.dim() != 1 or (not checked and _any_negative(self.profile)):
            raise InvalidSequenceError("profile must be a 1-D tensor of non-negative ids")
        if known_fingerprint is None:
            lt = self.long_term
            known_fingerprint = prefix_fingerprint(
                _host(self.profile), _host(lt.items), _host(lt.actions), _host(lt.timestamps)
            )
        elif (known_fingerprint.length, known_fingerprint.profile_len) != (self.length, self.profile.numel()):
            raise InvalidSequenceError(
                f"fingerprint of {known_fingerprint.length} tokens for a prefix of {self.length}"
            )
        object.__setattr__(self, "fingerprint", known_fingerprint)  # frozen: set once, here

    @property
    def length(self) -> int:
        return self.profile.numel() + len(self.long_term)


@dataclass(frozen=True)
class RankingSuffix:
    """What a ranking call adds after the prefix: recent behaviours eS_l and candidates I."""

    recent: Behaviors
    candidates: torch.Tensor  # item ids
    query_time: int  # epoch seconds; the candidates' timestamp
    checked: InitVar[bool] = False  # the candidates' ids were checked at the edge (Behaviors.checked)

    def __post_init__(self, checked: bool) -> None:
        if self.candidates.dim() != 1 or (not checked and _any_negative(self.candidates)):
            raise InvalidSequenceError("candidates must be a 1-D tensor of non-negative item ids")
        if self.query_time < 0:
            raise InvalidSequenceError("query_time must be non-negative")

    @property
    def length(self) -> int:
        return len(self.recent) + self.candidates.numel()
