"""Kernel-independent metadata builders shared by the GPU attention backends.

Every builder is a pure function of :class:`~framework.interfaces.CommonAttentionMetadata` (or its
parts) that runs on any device, so the index arithmetic is unit-tested on CPU even where the
kernels themselves (flash-attn, FlashInfer, xFormers) cannot run.

Conventions: requests are ordered decodes first (query length 1); ``block_table`` rows are padded
with 0 past a request's last block; positions are absolute token positions within a request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from framework.interfaces import CommonAttentionMetadata


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum with a leading zero (flash-attn's ``cu_seqlens``).

    Args:
        lengths: ``(n,)`` integer lengths, tokens.

    Returns:
        ``(n + 1,)`` int32 on ``lengths.device``: ``[0, l0, l0 + l1, ...]``.
    """
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths.to(torch.int32), dim=0, out=out[1:])
    return out


@dataclass
class PagedKVIndices:
    """FlashInfer's CSR description of a batch's paged KV (``BatchDecode/PrefillWithPagedKVCacheWrapper.plan``)."""

    indptr: torch.Tensor  # (num_reqs + 1,) int32, request r's pages are indices[indptr[r]:indptr[r+1]]
    indices: torch.Tensor  # (sum of pages,) int32 page (block) ids in token order
    last_page_len: torch.Tensor  # (num_reqs,) int32 tokens used in each request's last page, in [1, page_size]


def paged_kv_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PagedKVIndices:
    """Flatten padded block tables into FlashInfer's ``indptr/indices/last_page_len`` arrays.

    Args:
        block_table: ``(num_reqs, max_blocks)`` int32 block ids, padded with anything past the
            blocks a request needs.
        seq_lens: ``(num_reqs,)`` int tokens in KV after this step (each >= 1).
        block_size: tokens per block (FlashInfer's ``page_size``).

    Returns:
        :class:`PagedKVIndices` on ``block_table.device``.

    Raises:
        ValueError: a sequence needs more blocks than its table row holds, or a length < 1.
    """
    seq_lens = seq_lens.to(torch.int64)
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("every sequence needs at least one token in KV")
    num_pages = (seq_lens + block_size - 1) // block_size  # (num_reqs,)
    if num_pages.numel() and int(num_pages.max()) > block_table.shape[1]:
        raise ValueError(f"a sequence needs {int(num_pages.max())} blocks but block_table has {block_table.shape[1]} columns")
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < num_pages[:, None]
    return PagedKVIndices(indptr=cu_seqlens(num_pages), indices=block_table[used].to(torch.int32),
                          last_page_len=((seq_lens - 1) % block_size + 1).to(torch.int32))


def split_decode_prefill(common: CommonAttentionMetadata) -> tuple[CommonAttentionMetadata | None,
                                                                  CommonAttentionMetadata | None]:
    """Split a step into its decode part and its prefill/chunk part, each a self-contained metadata.

    The prefill part's ``query_start_loc`` restarts at 0 and its ``slot_mapping`` holds only its
    own tokens, so a backend can run on ``query[common.num_decode_tokens:]`` alone.

    Returns:
        ``(decode, prefill)``; either is ``None`` when the step has no such requests.
    """
    nd, ndt = common.num_decodes, common.num_decode_tokens
    decode = prefill = None
    if nd:
        decode = replace(
            common, query_start_loc=common.query_start_loc[:nd + 1], seq_lens=common.seq_lens[:nd],
            context_lens=common.context_lens[:nd], block_table=common.block_table[:nd],
            slot_mapping=common.slot_mapping[:ndt], query_lens_cpu=common.query_lens_cpu[:nd],
            seq_lens_cpu=common.seq_lens_cpu[:nd], num_reqs=nd, num_tokens=ndt, num_decodes=nd,
            num_decode_tokens=ndt, max_query_len=max(common.query_lens_cpu[:nd]),
            max_seq_len=max(common.seq_lens_cpu[:nd]), spec_tree=None)
    if nd < common.num_reqs:
        q_lens = common.query_lens_cpu[nd:]
        seq_lens_cpu = common.seq_lens_cpu[nd:]
        prefill = replace(
            common, query_start_loc=common.query_start_loc[nd:] - ndt, seq_lens=common.seq_lens[nd:],
            context_lens=common.context_lens[nd:], block_table=common.block_table[nd:],
            slot_mapping=common.slot_mapping[ndt:], query_lens_cpu=q_lens, seq_lens_cpu=seq_lens_cpu,
            num_reqs=common.num_reqs - nd, num_tokens=common.num_tokens - ndt, num_decodes=0,
            num_decode_tokens=0, max_query_len=max(q_lens), max_seq_len=max(seq_lens_cpu),
            spec_tree=None if common.spec_tree is None else common.spec_tree.shifted(nd))
    return decode, prefill


def gather_context_index(block_table: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of every request's whole context, concatenated (for kernels without paging).

    Args:
        block_table: ``(num_reqs, max_blocks)`` int block ids.
        seq_lens: per request, tokens in KV after this step.
        block_size: tokens per block.

    Returns:
        ``(sum(seq_lens),)`` int64 slot ids, request by request in token order.
    """
    device = block_table.device
    lens = torch.tensor(seq_lens, device=device, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
    starts = torch.repeat_interleave(cu_seqlens(lens)[:-1].to(torch.int64), lens)
    pos = torch.arange(int(lens.sum()), device=device) - starts
    return block_table[req, pos // block_size].to(torch.int64) * block_size + pos % block_size
