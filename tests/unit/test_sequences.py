"""The model's validated inputs: values are checked once, where they come in. Built in the
service from tensors of its own, every rule runs; built at the wire edge (services/ranker/wire.py),
the edge has checked the same rules on the wire's arrays and the scans are not run twice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker import sequences
from services.ranker.sequences import Behaviors, InvalidSequenceError, RankingSuffix, UserPrefix
from services.ranker.wire import rank_inputs, rank_request
from shared.wire import I64, RequestLimits, WireError


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_inputs_built_in_the_service_are_checked_rule_by_rule():
    with pytest.raises(InvalidSequenceError, match="non-negative"):
        Behaviors(ids(1, -2), ids(0, 0), ids(5, 6))
    with pytest.raises(InvalidSequenceError, match="timestamps"):
        Behaviors(ids(1, 2), ids(0, 0), ids(5, -6))
    with pytest.raises(InvalidSequenceError, match="as many"):
        Behaviors(ids(1, 2), ids(0), ids(5, 6), checked=True)  # lengths: always checked
    with pytest.raises(InvalidSequenceError, match="profile"):
        UserPrefix(1, 1, ids(-1), Behaviors.empty())
    with pytest.raises(InvalidSequenceError, match="candidates"):
        RankingSuffix(Behaviors.empty(), ids(3, -4), 0)


def test_values_checked_at_the_edge_are_not_scanned_again(monkeypatch):
    prefixes, suffixes = batch(3, [Shape(3, 300, 8, 16)])
    request = rank_request(prefixes[0], suffixes[0], "r")
    scans: list[torch.Tensor] = []
    real = sequences._any_negative
    monkeypatch.setattr(sequences, "_any_negative", lambda t: scans.append(t) or real(t))
    prefix, suffix = rank_inputs(request, RequestLimits())
    tensors = prefix.tensors()
    assert scans == []  # the edge checked every array once (shared/prefix_check.py)
    assert torch.equal(tensors.long_term.items, prefixes[0].long_term.items)
    assert torch.equal(suffix.candidates, suffixes[0].candidates)
    assert tensors.fingerprint == prefixes[0].fingerprint
    Behaviors(ids(1), ids(0), ids(5))  # built from tensors of the service's own: scanned
    assert len(scans) == 3


def test_the_edge_refuses_negative_values_it_does_not_scan_again():
    prefixes, suffixes = batch(4, [Shape(3, 300, 8, 16)])
    request = rank_request(prefixes[0], suffixes[0], "r")
    bad = np.frombuffer(request.recent.items_le, dtype=I64).copy()
    bad[2] = -7
    request.recent.items_le = bad.tobytes()
    with pytest.raises(WireError, match=r"recent\.items: values must be non-negative"):
        rank_inputs(request, RequestLimits())
    request = rank_request(prefixes[0], suffixes[0], "r")
    bad = np.frombuffer(request.prefix.long_term.timestamps_le, dtype=I64).copy()
    bad[0] = -1
    request.prefix.long_term.timestamps_le = bad.tobytes()
    with pytest.raises(WireError, match=r"prefix\.long_term\.timestamps"):
        rank_inputs(request, RequestLimits())
