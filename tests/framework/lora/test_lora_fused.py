"""A fused q/k/v (or gate/up) GEMM under LoRA: one :class:`LoRALinear` with a rank block per part gives every part
its own adapter's ``x A^T B^T`` through every ``lora_backend``, and re-writing one part's slot leaves the others."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.model_executor.lora_layers import LoRALinear, LoRAPart
from plugins.lora_backends.bgmv import BGMVBackend
from plugins.lora_backends.loop import LoopBackend
from plugins.lora_backends.sgmv import SGMVBackend

SIZES = (6, 3, 3)  # q, k, v output widths
RANKS = {0: (4, None, 2), 1: (3, 3, 3)}  # per slot, per part: the adapter's rank (None: the part is not targeted)


def _fused_with_adapters():
    fused = LoRALinear(nn.Linear(16, sum(SIZES), bias=False), max_loras=2, max_lora_rank=4, parts=SIZES)
    parts = [LoRAPart(fused, i) for i in range(len(SIZES))]
    g = torch.Generator().manual_seed(0)
    weights = {}
    for slot, ranks in RANKS.items():
        for p, rank in enumerate(ranks):
            ab = (None, None) if rank is None else (torch.randn(rank, 16, generator=g),
                                                    torch.randn(SIZES[p], rank, generator=g))
            parts[p].set_slot(slot, *ab)
            weights[slot, p] = ab
    return fused, parts, weights


def _expected(x, slots, scales, weights):
    out = torch.zeros(x.shape[0], sum(SIZES))
    for t, slot in enumerate(slots.tolist()):
        start = 0
        for p, size in enumerate(SIZES):
            a, b = weights.get((slot, p), (None, None))
            if a is not None:
                out[t, start:start + size] = scales[slot] * (b @ (a @ x[t]))
            start += size
    return out


@pytest.mark.parametrize("backend", [BGMVBackend(), BGMVBackend(stacked_max_width=0), SGMVBackend(), LoopBackend()],
                         ids=["bgmv_stacked", "bgmv_gather", "sgmv", "loop"])
def test_each_part_gets_its_own_adapter_term(backend):
    fused, parts, weights = _fused_with_adapters()
    assert fused.lora_a.shape == (2, 12, 16) and fused.lora_b.shape == (2, 12, 12)  # 3 parts x rank 4
    assert [(p.in_features, p.out_features) for p in parts] == [(16, 6), (16, 3), (16, 3)]
    x, slots, scales = torch.randn(5, 16), torch.tensor([0, 1, -1, 0, 1]), torch.tensor([0.5, 2.0])
    y = torch.zeros(5, sum(SIZES))
    backend.add_lora(y, x, fused.lora_a, fused.lora_b, scales, backend.prepare(slots), part_sizes=SIZES)
    torch.testing.assert_close(y, _expected(x, slots, scales, weights), atol=1e-5, rtol=1e-5)
    dense = torch.zeros(5, sum(SIZES))  # the same term without part_sizes (the block-diagonal B read densely)
    backend.add_lora(dense, x, fused.lora_a, fused.lora_b, scales, backend.prepare(slots))
    torch.testing.assert_close(dense, y, atol=1e-5, rtol=1e-5)
    assert not y[2].any() and not y[0, 6:9].any()  # the base model's token; slot 0's k part is not targeted


def test_rewriting_one_part_leaves_the_other_parts_and_zero_blocks():
    fused, parts, weights = _fused_with_adapters()
    before = fused.lora_b.clone()
    parts[0].set_slot(1, None, None)  # slot 1's next adapter does not target q
    assert not fused.lora_a[1, 0:4].any() and not fused.lora_b[1, 0:6].any()
    torch.testing.assert_close(fused.lora_b[1, 6:], before[1, 6:])
    torch.testing.assert_close(fused.lora_b[0], before[0])
    off_diagonal = fused.lora_b[0, 0:6, 4:]  # q's rows in k's and v's rank columns
    assert not off_diagonal.any()


def test_parts_must_cover_the_output_and_not_be_sharded():
    with pytest.raises(ValueError, match="must sum to out_features"):
        LoRALinear(nn.Linear(16, 12), max_loras=1, max_lora_rank=2, parts=(6, 3))
