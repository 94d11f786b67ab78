"""Draft trees under tensor parallelism: every rank moves the accepted path's K/V into place.

After a verify step with token trees (``framework/core/spec_tree.py``) the driver rank alone samples, so it alone
knows which root-to-node path each tree request accepted; yet every rank holds its own heads' shard of the KV cache,
and each must move that path's K/V to the positions right after the root (``ModelRunner._compact_tree``) before the
next step reads them as a chain. :func:`share_tree_moves` sends the driver's accepted node indices to the other ranks
of the tensor-parallel group in one broadcast, whose size every rank knows from the step message alone (the number of
draft nodes of the step's tree requests), so the ranks stay in step without a second message.
"""

from __future__ import annotations

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
