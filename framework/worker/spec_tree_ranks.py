"""Draft trees' KV after verification: every rank moves the accepted path's K/V into place.

After a verify step with token trees (``framework/core/spec_tree.py``) the driver rank alone samples, so it alone
knows which root-to-node path each tree request accepted; yet every rank holds its own heads' shard of the KV cache,
and each must move that path's K/V to the positions right after the root (:func:`compact_tree`) before the
next step reads them as a chain. :func:`share_tree_moves` sends the driver's accepted node indices to the other ranks
of the tensor-parallel group in one broadcast, whose size every rank knows from the step message alone (the number of
draft nodes of the step's tree requests), so the ranks stay in step without a second message.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from framework.core.outputs import SchedulerOutput
from framework.distributed.parallel_state import get_tp_group
from framework.worker.input_batch import BatchInputs


def tree_layout(batch: BatchInputs, so: SchedulerOutput) -> list[tuple[int, int]]:
    """Per tree request of the step, in batch order: ``(flattened token index of its node 0, number of nodes)``.

    The same on every rank: it reads the step message and the prepared batch only (the last ``k`` tokens of a tree
    request's query are its ``k`` nodes).
    """
    trees = so.scheduled_spec_decode_parents
    if not trees:
        return []
    layout = []
    for i, request in enumerate(batch.requests):
        if trees.get(request.request_id):
            end = int(batch.query_start_loc_cpu[i + 1])
            k = len(so.scheduled_spec_decode_tokens[request.request_id])
            layout.append((end - k, k))
    return layout


def share_tree_moves(batch: BatchInputs, so: SchedulerOutput,
                     moves: list[tuple[int, list[int]]] | None) -> list[tuple[int, list[int]]]:
    """Broadcast the driver's accepted tree paths to every rank of the tensor-parallel group.

    Every rank of the group calls it once per verify step that holds a tree (:func:`tree_layout` non-empty), after
    the forward; a collective, so all of them or none.

    Args:
        batch: the step's inputs (same on every rank).
        so: the step's scheduler output.
        moves: on the driver rank, per tree request it verified, ``(token index of node 0, accepted node indices,
            root side first)`` (a request whose verification failed is absent: its rows stay as they are); ``None``
            on the other ranks.

    Returns:
        The driver's ``moves`` on every rank.

    Shape: one int64 tensor ``(sum of the tree requests' node counts,)`` on the batch's device, each request's slice
    its accepted node indices then ``-1``.
    """
    layout = tree_layout(batch, so)
    total = sum(k for _, k in layout)
    flat = torch.full((total,), -1, dtype=torch.int64)
    if moves is not None:
        offset = {first: sum(k for _, k in layout[:j]) for j, (first, _) in enumerate(layout)}
        for first, nodes in moves:
            flat[offset[first]:offset[first] + len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
    group = get_tp_group()
    flat = flat.to(batch.positions.device)
    dist.broadcast(flat, group=group.device_group, group_src=0)
    flat = flat.cpu()
    shared, start = [], 0
    for first, k in layout:
        nodes = [n for n in flat[start:start + k].tolist() if n >= 0]
        if nodes:
            shared.append((first, nodes))
        start += k
    return shared


def compact_tree(batch: BatchInputs, moves: list[tuple[int, list[int]]], hidden: torch.Tensor | None,
                 kv_caches: list[torch.Tensor], layer_group: list[int], backend: Any) -> None:
    """Move each accepted tree path's K/V (every layer, every KV cache group) and hidden-state rows to the
    positions right after its root, so the request's cache reads as if the path had been a chain; the rejected
    nodes' slots are overwritten by later steps (the scheduler counts only the accepted path as computed).

    Args:
        batch: the step's inputs (``group_commons[g].slot_mapping``: ``(num_tokens,)`` int64 slots per KV cache
            group).
        moves: per tree request, the flattened token index of its node 0 and its accepted node indices (root
            side first).
        hidden: ``(num_tokens, hidden)`` kept hidden states, moved the same way, or None.
        kv_caches: this rank's per-layer KV cache tensors; ``layer_group``: each layer's KV cache group.
        backend: the attention backend (``read_kv`` / ``write_kv`` by slot).
    """
    src, dst = [], []
    for first, nodes in moves:
        pairs = [(first + n, first + d) for d, n in enumerate(nodes) if n != d]
        src += [s for s, _ in pairs]
        dst += [d for _, d in pairs]
    if not src:
        return
    device = batch.positions.device
    src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    slots = [common.slot_mapping for common in batch.group_commons]
    for layer, cache in enumerate(kv_caches):
        group_slots = slots[layer_group[layer]]
        key, value = backend.read_kv(cache, group_slots[src_t])
        backend.write_kv(cache, key, value, group_slots[dst_t])
    if hidden is not None:
        hidden[dst_t] = hidden[src_t]
