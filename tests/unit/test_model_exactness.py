"""rank_cached(preinfer(prefix), suffix) == full(prefix + suffix), on the CPU in float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relaygr.synthetic import Shape, batch
from services.ranker.model import HSTURanker
from services.ranker.psi import PsiMismatchError
from services.ranker.sequences import RankingSuffix
from shared.modelspec import preset

TOL = 1e-5


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max((float((x - y).abs().max()) for x, y in zip(a, b, strict=True) if x.numel()), default=0.0)


def relay(model: HSTURanker, prefixes, suffixes) -> list[torch.Tensor]:
    psis = model.preinfer(prefixes)
    keys = [model.psi_key(p.user_id, p.prefix_version, p.fingerprint.digest) for p in prefixes]
    return model.rank_cached(suffixes, psis, keys)


@pytest.fixture(scope="module")
def tiny() -> HSTURanker:
    return HSTURanker.from_seed(preset("tiny"), seed=0)


SPECS = [
    preset("tiny"),
    preset("tiny").with_overrides(name="deep", num_layers=4, num_heads=1, head_dim=32, attn_norm=64.0),
    preset("tiny").with_overrides(name="wide", num_layers=1, num_heads=4, head_dim=8, pos_mantissa_bits=0),
    preset("tiny").with_overrides(name="fine", num_layers=3, num_heads=3, head_dim=16, time_mantissa_bits=5),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("seed", [1, 2])
def test_cached_equals_full_random_configs(spec, seed):
    model = HSTURanker.from_seed(spec, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    shapes = []
    for _ in range(4):
        u, n, m, c = (int(torch.randint(0, hi, (1,), generator=gen)) for hi in (6, 400, 40, 64))
        shapes.append(Shape(u, n, m, c + 1))
    prefixes, suffixes = batch(seed, shapes)
    full = model.full(prefixes, suffixes)
    assert max_diff(full, relay(model, prefixes, suffixes)) <= TOL


@pytest.mark.parametrize(
    "shape",
    [
        Shape(0, 0, 0, 1),  # nothing cached at all, one candidate
        Shape(0, 300, 20, 16),  # empty U
        Shape(4, 300, 0, 16),  # empty eS_l
        Shape(0, 0, 12, 5),  # empty prefix, recent only
        Shape(3, 1, 1, 1),
        Shape(2, 3000, 64, 512),  # a few thousand prefix tokens, 512 candidates
    ],
    ids=str,
)
def test_cached_equals_full_edge_shapes(tiny, shape):
    prefixes, suffixes = batch(7, [shape])
    assert max_diff(tiny.full(prefixes, suffixes), relay(tiny, prefixes, suffixes)) <= TOL


def test_mixed_batch_equals_single_requests(tiny):
    shapes = [Shape(2, 700, 8, 30), Shape(0, 0, 0, 1), Shape(5, 1500, 0, 100), Shape(1, 40, 33, 2)]
    prefixes, suffixes = batch(3, shapes)
    batched = relay(tiny, prefixes, suffixes)
    single = [relay(tiny, [p], [s])[0] for p, s in zip(prefixes, suffixes, strict=True)]
    assert max_diff(batched, single) <= TOL
    assert max_diff(batched, tiny.full(prefixes, suffixes)) <= TOL


def test_candidate_score_independent_of_other_candidates(tiny):
    prefixes, suffixes = batch(4, [Shape(2, 200, 10, 40)])
    s = suffixes[0]
    all_scores = tiny.full(prefixes, suffixes)[0]
    subset = RankingSuffix(s.recent, s.candidates[[5, 17, 3]], s.query_time)
    subset_scores = tiny.full(prefixes, [subset])[0]
    assert torch.allclose(subset_scores, all_scores[[5, 17, 3]], atol=TOL, rtol=0)


def test_scores_depend_on_the_prefix(tiny):
    """Guards the equality tests: a model that ignored the prefix would pass them trivially."""
    prefixes, suffixes = batch(5, [Shape(2, 200, 10, 20)])
    p = prefixes[0]
    items = p.long_term.items.clone()
    items[0] += 1  # the oldest behaviour
    changed = dataclasses.replace(p, long_term=dataclasses.replace(p.long_term, items=items))
    a = tiny.full(prefixes, suffixes)[0]
    b = tiny.full([changed], suffixes)[0]
    assert float((a - b).abs().max()) > 1e-4


def test_psi_of_another_user_version_or_model_is_refused(tiny):
    prefixes, suffixes = batch(6, [Shape(1, 50, 2, 3)])
    (psi,) = tiny.preinfer(prefixes)
    good = tiny.psi_key(prefixes[0].user_id, prefixes[0].prefix_version, prefixes[0].fingerprint.digest)
    tiny.rank_cached(suffixes, [psi], [good])
    other_model = HSTURanker.from_seed(preset("tiny"), seed=99)
    wrong = [
        dataclasses.replace(good, user_id=good.user_id + 1),
        dataclasses.replace(good, prefix_version=good.prefix_version + 1),
        other_model.psi_key(good.user_id, good.prefix_version, good.fingerprint),
        dataclasses.replace(good, fingerprint=good.fingerprint ^ 1),
    ]
    for key, field in zip(wrong, ("user_id", "prefix_version", "model_version", "fingerprint"), strict=True):
        with pytest.raises(PsiMismatchError, match=field):
            tiny.rank_cached(suffixes, [psi], [key])
    with pytest.raises(PsiMismatchError, match="model_version"):
        other_model.rank_cached(
            suffixes, [psi], [other_model.psi_key(good.user_id, good.prefix_version, good.fingerprint)]
        )


def test_psi_layout_and_size(tiny):
    prefixes, _ = batch(8, [Shape(3, 100, 0, 1), Shape(0, 10, 0, 1)])
    psis = tiny.preinfer(prefixes)
    spec = tiny.spec
    for p, psi in zip(prefixes, psis, strict=True):
        assert psi.kv.shape == (spec.num_layers, 2, p.length, spec.hidden)
        assert psi.kv.is_contiguous()
        assert psi.nbytes == spec.psi_bytes(p.length)


def test_save_load_round_trip(tiny, tmp_path):
    path = tmp_path / "tiny.safetensors"
    tiny.save(path)
    loaded = HSTURanker.load(path)
    assert loaded.model_version == tiny.model_version
    prefixes, suffixes = batch(9, [Shape(1, 60, 4, 8)])
    assert max_diff(loaded.full(prefixes, suffixes), tiny.full(prefixes, suffixes)) == 0.0


def test_seeded_weights_are_reproducible():
    a = HSTURanker.from_seed(preset("tiny"), seed=11)
    b = HSTURanker.from_seed(preset("tiny"), seed=11)
    assert a.model_version == b.model_version
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert HSTURanker.from_seed(preset("tiny"), seed=12).model_version != a.model_version
