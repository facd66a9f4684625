"""Every index vector a kernel reads starts 16-byte aligned, whatever the batch size: Triton
specialises kernels on pointer alignment, and a pattern the warm-up did not see is a JIT compile
of seconds mid-serving (issue 13: a partial batch of 4 stalled an H100 ranker for over 7 s)."""

from __future__ import annotations

import pytest
import torch

from kernels.hstu_attention.layout import PrefixKV, SeqLayout


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8])
def test_layout_and_prefix_vectors_start_16_byte_aligned(batch: int) -> None:
    lengths = [3 + b for b in range(batch)]
    layout = SeqLayout.build(lengths, [1] * batch, torch.arange(sum(lengths)) // 1000)
    blocks = [torch.zeros(2, 2, 5 + b, 8) for b in range(batch)]
    prefix = PrefixKV.build(blocks, [torch.arange(5 + b) for b in range(batch)])
    vectors = {
        "offsets": layout.offsets, "n_hist": layout.n_hist, "timestamps": layout.timestamps,
        "lens": prefix.lens, "ts_offsets": prefix.ts_offsets, "kv_offsets": prefix.kv_offsets,
        "prefix_timestamps": prefix.timestamps,
    }  # fmt: skip
    assert {name: t.data_ptr() % 16 for name, t in vectors.items()} == dict.fromkeys(vectors, 0)
    # ... and hold what they held before
    assert layout.offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert layout.n_hist.tolist() == [1] * batch
    assert prefix.lens.tolist() == [5 + b for b in range(batch)]
    assert prefix.ts_offsets.tolist() == [0, *torch.tensor(prefix.lens.tolist()).cumsum(0).tolist()]
    assert len(prefix.kv_offsets) == batch
