"""Paged attention that reads K/V from the paged cache in place, compiled by inductor.

Every token of the flattened batch (decode rows and prefill chunks alike) attends over the
keys of its request at positions ``0..pos``. The block-table lookup
``slot = block_table[req, j // block_size] * block_size + j % block_size`` (Kwon et al.,
SOSP'23, Sec. 4.1) is written as indexing inside one ``torch.compile``d function whose score and
output are explicit multiply-and-sum reductions; inductor turns the lookup into an indirect load
inside the generated C++ reduction loops, so no per-request copy of the context is materialised
(the ``torch`` reference backend gathers ``[R, S, KVH, D]`` per layer). GQA never repeats K/V:
each KV head's ``G = H / KVH`` query heads are an extra broadcast dimension.

Recompiles are bounded by marking the batch dims dynamic (tokens, requests, block-table width, key
positions; heads and head size stay static) without duck sizing; the number of graph compilations is counted in :data:`COMPILE_STATS`. Where the compiler is unavailable
(``compile: false``, no C++ toolchain, or a compile error) the same function runs in eager mode,
with a one-time warning; eager materialises the gather and is slower than the ``torch`` backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata

logger = logging.getLogger(__name__)

#: Process-wide compile counters: ``graphs`` (inductor compilations) and ``seconds`` (wall time in them).
COMPILE_STATS: dict[str, float] = {"graphs": 0, "seconds": 0.0}


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
                    kv_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal paged attention of each token over its request's cached keys.

    Args:
        query: ``[T, KVH, G, D]`` queries, any float dtype (computed in float32).
        key_cache, value_cache: ``[num_blocks, block_size, KVH, D]`` the layer's paged cache.
        block_table: ``[R, max_blocks]`` int64 block ids per request.
        token_req: ``[T]`` int64 request row of each token.
        token_pos: ``[T]`` int64 absolute position of each token; it attends to ``0..token_pos``.
        kv_pos: ``[S]`` int64 ``arange(S)``, the key positions scanned per token
            (``S >= max(token_pos) + 1`` and ``<= max_blocks * block_size``).
        scale: softmax scale.

    Returns:
        ``[T, KVH, G, D]`` in ``query.dtype``.
    """
    block_size = key_cache.shape[1]
    k_flat = key_cache.flatten(0, 1)  # [slots, KVH, D], a view: no copy
    v_flat = value_cache.flatten(0, 1)
    j = kv_pos
    slots = block_table[token_req[:, None], j[None, :] // block_size] * block_size + j[None, :] % block_size  # [T, S]
    q = query.float() * scale
    k = k_flat[slots].float()  # [T, S, KVH, D]; fused into the reduction below when compiled
    scores = (q[:, None] * k[:, :, :, None, :]).sum(-1)  # [T, S, KVH, G]
    visible = (j[None, :] <= token_pos[:, None])[:, :, None, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=1)
    v = v_flat[slots].float()
    out = (probs[..., None] * v[:, :, :, None, :]).sum(1)  # [T, KVH, G, D]
    return out.to(query.dtype)


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor, counting compilations and their wall time in :data:`COMPILE_STATS`."""
    from torch._inductor import compile_fx

    start = time.perf_counter()
    compiled = compile_fx.compile_fx(gm, example_inputs)
    COMPILE_STATS["graphs"] += 1
    COMPILE_STATS["seconds"] += time.perf_counter() - start
    return compiled


_COMPILED: dict[str, Any] = {}


def _compiled_kernel() -> Any:
    """The process-wide compiled :func:`paged_attention` (one cache of graphs for all layers)."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(paged_attention, backend=_counting_inductor, fullgraph=True)
    return _COMPILED["fn"]


def _call_compiled(fn: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """Call with the batch dims symbolic: tokens, requests, block-table columns, key positions.

    Heads, head size and block size stay static (constants in the generated loops). Duck sizing is
    off so that two batch dims that happen to be equal in the first step do not share a symbol
    (which would recompile on the next step); sizes 0/1 still specialise (e.g. batch-1 decode).
    """
    from torch.fx.experimental import _config as fx_config

    query, _, _, block_table, token_req, token_pos, kv_pos, _ = args
    for tensor, dims in ((query, (0,)), (block_table, (0, 1)), (token_req, (0,)), (token_pos, (0,)), (kv_pos, (0,))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    with fx_config.patch(use_duck_shape=False):
        return fn(*args)


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata of :class:`TorchPagedAttentionBackend` (built once, shared by all layers)."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slots of this step's tokens
    block_table: torch.Tensor  # (num_reqs, num_blocks_needed) int64
    token_req: torch.Tensor  # (num_tokens,) int64 request row of each token
    token_pos: torch.Tensor  # (num_tokens,) int64 absolute position of each token
    kv_pos: torch.Tensor  # (S,) int64 arange of the key positions scanned: max seq_len rounded up to a block


class TorchPagedAttentionBackend(AttentionBackend):
    """Paged attention reading the cache in place through a ``torch.compile``d kernel (CPU/GPU).

    KV cache per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)``, written by one
    ``index_copy_`` per layer. Decodes and prefill chunks (with or without cached context) go
    through the same kernel, :func:`paged_attention`.

    Args (beyond ``AttentionBackend``'s):
        compile: ``True`` (default) compiles with inductor; ``False`` runs eager (slow; for
            debugging and for machines without a C++ compiler).
    """

    name = "torch_paged"

    def __init__(self, *args: Any, compile: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compile = bool(compile)
        self._fn = _compiled_kernel() if self.compile else paged_attention

    def build_metadata(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        """Per-token request rows and positions, and the block table cut to the longest sequence."""
        device = common.seq_lens.device
        q_lens = torch.tensor(common.query_lens_cpu, device=device)
        token_req = torch.repeat_interleave(torch.arange(common.num_reqs, device=device), q_lens)
        starts = common.query_start_loc[:-1].long()
        offset = torch.arange(common.num_tokens, device=device) - starts[token_req]
        token_pos = common.context_lens.long()[token_req] + offset
        num_blocks = -(-max(common.seq_lens_cpu) // self.block_size)
        return PagedAttentionMetadata(common.slot_mapping, common.block_table[:, :num_blocks].long(),
                                      token_req, token_pos, torch.arange(num_blocks * self.block_size, device=device))

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: PagedAttentionMetadata) -> torch.Tensor:
        """Write K/V at ``slot_mapping``, then attend in place; see ``AttentionBackend.forward``."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, kv_heads, head_size)
        flat_shape = (-1, self.num_kv_heads, self.head_size)
        key_cache.view(flat_shape).index_copy_(0, metadata.slot_mapping, key.to(key_cache.dtype))
        value_cache.view(flat_shape).index_copy_(0, metadata.slot_mapping, value.to(value_cache.dtype))
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size)
        args = (q, key_cache, value_cache, metadata.block_table, metadata.token_req, metadata.token_pos,
                metadata.kv_pos, self.scale)
        try:
            out = paged_attention(*args) if self._fn is paged_attention else _call_compiled(self._fn, args)
        except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same math, eager
            if self._fn is paged_attention:
                raise
            logger.warning("torch_paged: torch.compile failed (%s: %s); falling back to eager attention "
                           "(correct but slower than attention=torch)", type(err).__name__, err)
            self._fn = paged_attention
            out = paged_attention(*args)
        return out.reshape(num_tokens, self.num_heads, self.head_size)


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``torch_paged``."""
    register("torch_paged", TorchPagedAttentionBackend)
