"""psi blocks in size classes (services/ranker/psi.py, PsiSizeClasses; the ranker's
--psi-size-classes): every reader sees exact, contiguous psi at the front of a class-sized
allocation, the scores are those of full inference, reloads land in class-sized blocks too, and
the HBM budget counts the class's bytes."""

from __future__ import annotations

import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker.config import RankerConfig
from services.ranker.hbm_cache import EntryState
from services.ranker.model import HSTURanker
from services.ranker.psi import Psi, PsiKey, PsiSizeClasses, psi_memory
from services.ranker.relay_cache import Served
from services.ranker.transfer import host_meta, host_nbytes, issue_from_host, issue_to_host
from shared.config import ConfigError, load_config
from shared.modelspec import preset
from tests.unit.test_relay_cache import Relay

MIB = 1 << 20
TOL = 1e-5


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_a_class_holds_its_psi_within_its_ratio_on_2_mib():
    classes = PsiSizeClasses(1.125)
    for nbytes in (3 * MIB, 100 * MIB + 1, 134_250_496, 268_500_992, 537_001_984):
        got = classes.footprint(nbytes)
        assert got >= nbytes
        assert got % (2 * MIB) == 0
        assert got <= nbytes * 1.125 + 2 * MIB
    assert classes.footprint(1000) == 2 * MIB  # below the floor: the floor
    # Every size of a class takes that class's bytes: a freed block fits the next psi of its class.
    top = classes.footprint(200 * MIB)
    assert classes.footprint(top) == top
    assert classes.footprint(top - MIB) == top
    assert classes.footprint(top + 1) > top


@pytest.mark.parametrize("ratio", [1.0, 0.5, 2.5, float("nan")])
def test_a_ratio_outside_1_to_2_is_refused(ratio):
    with pytest.raises(ValueError, match="ratio"):
        PsiSizeClasses(ratio)


def test_psi_memory_in_classes_is_the_exact_psi_at_the_front_of_its_class():
    classes = PsiSizeClasses(1.25)
    kv, ts, block = psi_memory(3, 777, 64, torch.bfloat16, "cpu", classes)
    exact = 3 * 2 * 777 * 64 * 2 + 777 * 8
    assert block is not None
    assert block.numel() == exact
    assert storage_bytes(block) == classes.footprint(exact)
    assert kv.shape == (3, 2, 777, 64)
    assert kv.is_contiguous()
    assert kv.data_ptr() == block.data_ptr()
    assert ts.data_ptr() == block.data_ptr() + 3 * 2 * 777 * 64 * 2
    Psi(PsiKey(1, 1, "m", 1), kv, ts, block)  # a valid psi block: [K/V | timestamps], nothing else
    # Without classes, exactly its bytes.
    _, _, plain = psi_memory(3, 777, 64, torch.bfloat16, "cpu")
    assert plain is not None
    assert storage_bytes(plain) == exact


def test_a_reload_lands_in_a_class_sized_block_with_the_same_bytes():
    classes = PsiSizeClasses(1.125)
    key = PsiKey(1, 2, "m", 3)
    kv, ts, block = psi_memory(2, 300, 32, torch.bfloat16, "cpu")
    kv.copy_(torch.randn(2, 2, 300, 32).to(torch.bfloat16))
    ts.copy_(torch.arange(300) * 7)
    psi = Psi(key, kv, ts, block)
    meta = host_meta(psi)
    host = torch.zeros(host_nbytes(meta), dtype=torch.uint8)
    issue_to_host(psi, host)
    back = issue_from_host(host, meta, key, torch.device("cpu"), classes=classes)
    assert torch.equal(back.kv, psi.kv)
    assert torch.equal(back.timestamps, psi.timestamps)
    assert back.block is not None
    assert storage_bytes(back.block) == classes.footprint(psi.nbytes)


def test_psi_built_in_a_class_sized_block_ranks_as_full_inference():
    model = HSTURanker.from_seed(preset("tiny"), seed=0)
    model.psi_classes = PsiSizeClasses(1.125)
    prefixes, suffixes = batch(16, [Shape(4, 600, 9, 7), Shape(2, 90, 30, 16)])
    want = model.full(prefixes, suffixes)
    psis = [model.new_psi(p) for p in prefixes]
    for psi in psis:
        assert psi.block is not None
        assert storage_bytes(psi.block) == model.psi_classes.footprint(psi.nbytes)
    got = model.full(prefixes, suffixes, psis)  # the full ranking writes the kept psi
    for g, w in zip(got, want, strict=True):
        assert float((g - w).abs().max()) <= TOL
    again = model.rank_cached(suffixes, psis, [p.key for p in psis])
    for a, w in zip(again, want, strict=True):
        assert float((a - w).abs().max()) <= TOL


@pytest.fixture
async def classed():
    model = HSTURanker.from_seed(preset("tiny"), seed=0)  # its own: the classes are set on it
    model.psi_classes = PsiSizeClasses(1.125)
    r = Relay(model, delay_s=100.0, ranking_psi_min_tokens=512)
    r.rebuild(psi_footprint=lambda n: model.psi_classes.footprint(model.spec.psi_bytes(n)))
    r.engine.start()
    yield r
    r.engine.stop()


async def test_the_hbm_budget_counts_a_kept_psis_class_bytes(classed):
    key, prefix, suffix, want = classed.inputs(41, 700)
    first = await classed.rank(key, prefix, suffix)
    assert first.served is Served.FULL_RECOMPUTE
    assert float((first.result.scores - want).abs().max()) <= TOL
    view = classed.cache.lookup(key)
    assert view is not None
    assert view.state is EntryState.CONSUMED
    exact = classed.model.spec.psi_bytes(700)
    assert view.nbytes == classed.model.psi_classes.footprint(exact) == 2 * MIB  # not `exact`
    assert classed.cache.used_bytes == 2 * MIB
    again = await classed.rank(key, prefix, suffix)
    assert again.served is Served.HBM_HIT
    assert float((again.result.scores - want).abs().max()) <= TOL


def test_the_ranker_takes_0_or_a_ratio_and_refuses_the_rest():
    assert load_config(RankerConfig, [], env={}).psi_size_classes == 0.0
    assert load_config(RankerConfig, ["--psi-size-classes", "1.125"], env={}).psi_size_classes == 1.125
    for wrong in ("1", "2.5", "-1"):
        with pytest.raises(ConfigError, match=r"psi-size-classes|PSI_SIZE_CLASSES|ratio"):
            load_config(RankerConfig, ["--psi-size-classes", wrong], env={})
