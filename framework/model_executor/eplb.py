"""Expert-parallel load balancing: which logical expert each physical expert slot holds.

DeepSeek's Expert Parallelism Load Balancer (EPLB, github.com/deepseek-ai/EPLB, the algorithm vLLM's
``eplb/rebalance_algo.py`` follows), written here from its description: given the measured load of every
logical expert (tokens routed to it) and ``num_physical_experts = num_logical_experts +
num_redundant_experts`` slots spread evenly over the expert-parallel ranks,

1. *hierarchical* (expert groups divisible by nodes): pack the expert groups onto nodes so that every node
   carries about the same load (:func:`balanced_packing`), so a group's experts stay on one node;
2. inside each node, give the hottest experts extra replicas until the node's slots are filled
   (:func:`replicate_experts`: each step replicates the expert with the highest load per replica);
3. pack the node's physical experts onto its ranks, each physical expert carrying ``load / replicas``,
   every rank the same number of slots (:func:`balanced_packing` again).

Without groups divisible by nodes the *global* policy is the same with one group and one node.
Pure torch on CPU, loops over layers and experts (sizes are hundreds, run every few thousand steps).
The maps use vLLM's names: ``physical_to_logical_map (L, P)``, ``logical_to_physical_map (L, E, R)``
(padded with -1), ``logical_replica_count (L, E)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertMaps:
    """Where every logical expert lives, per MoE layer (all int64 on CPU)."""

    physical_to_logical_map: torch.Tensor  # (num_layers, num_physical_experts): the logical expert each slot holds
    logical_to_physical_map: torch.Tensor  # (num_layers, num_logical_experts, max_replicas): slots, -1 padded
    logical_replica_count: torch.Tensor  # (num_layers, num_logical_experts): replicas of each expert, >= 1

    @property
    def num_physical_experts(self) -> int:
        """Physical expert slots per layer (``num_logical_experts + num_redundant_experts``)."""
        return int(self.physical_to_logical_map.shape[1])


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of ``n / num_packs`` items each, heaviest item first
    into the lightest pack that still has room (greedy LPT with a cardinality limit, EPLB's ``balanced_packing``).

    Args:
        weight: ``(num_layers, n)`` float, one row per layer.
        num_packs: packs per layer; must divide ``n``.

    Returns:
        ``pack_index (num_layers, n)`` int64 (the pack of each item) and ``rank_in_pack (num_layers, n)``
        int64 (its position inside the pack, in packing order).

    Raises:
        ValueError: ``num_packs`` does not divide ``n``.
    """
    num_layers, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing: {n} items cannot fill {num_packs} packs equally")
    per_pack = n // num_packs
    pack_index = torch.empty(num_layers, n, dtype=torch.int64)
    rank_in_pack = torch.empty(num_layers, n, dtype=torch.int64)
    for layer in range(num_layers):
        loads, counts = [0.0] * num_packs, [0] * num_packs
        for item in torch.argsort(weight[layer].float(), descending=True, stable=True).tolist():
            pack = min((p for p in range(num_packs) if counts[p] < per_pack), key=lambda p: loads[p])
            pack_index[layer, item], rank_in_pack[layer, item] = pack, counts[pack]
            loads[pack] += float(weight[layer, item])
            counts[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill ``num_physical`` slots with ``E`` logical experts: one each, then every extra slot replicates the
    expert with the highest load per replica (EPLB's ``replicate_experts``).

    Args:
        weight: ``(num_layers, E)`` float loads.
        num_physical: slots per layer, ``>= E``.

    Returns:
        ``physical_to_logical (num_layers, num_physical)``, ``replica_rank (num_layers, num_physical)`` (which
        replica of its expert a slot is, 0-based) and ``replica_count (num_layers, E)``, all int64.

    Raises:
        ValueError: ``num_physical < E``.
    """
    num_layers, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"replicate_experts: {num_physical} physical slots cannot hold {num_logical} experts")
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(num_layers, 1)
    replica_rank = torch.zeros(num_layers, num_physical, dtype=torch.int64)
    count = torch.ones(num_layers, num_logical, dtype=torch.int64)
    rows = torch.arange(num_layers)
    for slot in range(num_logical, num_physical):
        hottest = (weight.float() / count).argmax(dim=-1)
        phy2log[:, slot] = hottest
        replica_rank[:, slot] = count[rows, hottest]
        count[rows, hottest] += 1
    return phy2log, replica_rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def rebalance_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                           num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 of the module docstring: groups to nodes, replicas within nodes, physical experts to ranks.

    Args:
        weight: ``(num_layers, E)`` float loads; ``num_physical`` slots per layer.
        num_groups: expert groups (``E`` divisible by it; divisible by ``num_nodes``).
        num_nodes, num_ranks: nodes and ranks (``num_ranks`` divisible by ``num_nodes``, ``num_physical``
            divisible by ``num_ranks``).

    Returns:
        ``physical_to_logical``, ``replica_rank``, ``replica_count`` as :func:`replicate_experts`, with the
        physical slots in rank order (rank ``r`` owns slots ``[r * P / num_ranks, (r + 1) * P / num_ranks)``).
    """
    num_layers, num_logical = weight.shape
    group_size, per_node = num_logical // num_groups, num_physical // num_nodes
    # 1. groups -> nodes; ``mlog`` numbers the logical experts node by node
    group_pack, group_rank = balanced_packing(weight.unflatten(-1, (num_groups, group_size)).sum(-1), num_nodes)
    group_slot = group_pack * (num_groups // num_nodes) + group_rank  # (L, groups): group's slot in node order
    log2mlog = ((group_slot * group_size).unsqueeze(-1) + torch.arange(group_size)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2. replicas within each node (the node's experts as one "layer" row)
    node_weight = weight.gather(-1, mlog2log).view(-1, num_logical // num_nodes)
    phy2mlog, phy_rank, mlog_count = replicate_experts(node_weight, per_node)
    # 3. physical experts -> ranks within each node, each carrying its expert's load per replica
    per_replica = (node_weight / mlog_count).gather(-1, phy2mlog)
    pack, rank_in = balanced_packing(per_replica, num_ranks // num_nodes)
    phy2pphy = pack * (num_physical // num_ranks) + rank_in
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    offsets = torch.arange(0, num_logical, num_logical // num_nodes).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1) + offsets).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphy_rank = phy_rank.gather(-1, pphy2phy).view(num_layers, -1)
    log_count = mlog_count.view(num_layers, -1).gather(-1, log2mlog)
    return pphy2log, pphy_rank, log_count


def rebalance_experts(weight: torch.Tensor, num_physical_experts: int, num_ranks: int, num_groups: int = 1,
                      num_nodes: int = 1) -> ExpertMaps:
    """The expert maps for measured loads (EPLB's ``rebalance_experts``): hierarchical when ``num_groups`` is
    divisible by ``num_nodes``, else global (one group, one node).

    Args:
        weight: ``(num_layers, num_logical_experts)`` tokens routed to each expert (any number type).
        num_physical_experts: slots per layer (``num_logical_experts + parallel.num_redundant_experts``).
        num_ranks: expert-parallel ranks; must divide ``num_physical_experts``.
        num_groups: expert groups (DeepSeek's routing groups; 1 for the families served here).
        num_nodes: nodes the ranks are on.

    Returns:
        :class:`ExpertMaps`; every logical expert has at least one replica and every rank the same number of slots.

    Raises:
        ValueError: slots not divisible by ranks, fewer slots than experts, or a non-2-D ``weight``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be (num_layers, num_logical_experts), got shape {tuple(weight.shape)}")
    num_layers, num_logical = weight.shape
    if num_physical_experts < num_logical or num_physical_experts % num_ranks:
        raise ValueError(f"{num_physical_experts} physical experts cannot hold {num_logical} experts evenly over "
                         f"{num_ranks} ranks: set parallel.num_redundant_experts so that num_experts + it is a "
                         "multiple of the expert-parallel ranks")
    weight = weight.float().cpu()
    if num_groups % num_nodes or num_logical % num_groups or num_ranks % num_nodes:
        num_groups = num_nodes = 1
    phy2log, replica_rank, count = rebalance_hierarchical(weight, num_physical_experts, num_groups, num_nodes,
                                                          num_ranks)
    max_replicas = int(count.max())
    log2phy = torch.full((num_layers, num_logical, max_replicas), -1, dtype=torch.int64)
    slots = torch.arange(num_physical_experts, dtype=torch.int64).expand(num_layers, -1)
    log2phy.view(num_layers, -1).scatter_(-1, phy2log * max_replicas + replica_rank, slots)
    return ExpertMaps(phy2log, log2phy, count)


def default_maps(num_layers: int, num_logical: int, num_physical: int, num_ranks: int) -> ExpertMaps:
    """The maps before any load is measured: :func:`rebalance_experts` of a uniform load (no redundant slots:
    the identity, rank ``r`` holding experts ``[r * E / ranks, (r + 1) * E / ranks)``, as vLLM's EP does)."""
    if num_physical == num_logical:
        phy2log = torch.arange(num_logical, dtype=torch.int64).repeat(num_layers, 1)
        return ExpertMaps(phy2log, phy2log.clone().unsqueeze(-1), torch.ones(num_layers, num_logical, dtype=torch.int64))
    return rebalance_experts(torch.ones(num_layers, num_logical), num_physical, num_ranks)


def max_rank_load(weight: torch.Tensor, maps: ExpertMaps, num_ranks: int) -> torch.Tensor:
    """``(num_layers,)`` float: the most load any rank carries when each expert's load is split evenly over
    its replicas (the quantity EPLB minimises)."""
    per_slot = (weight.float() / maps.logical_replica_count).gather(-1, maps.physical_to_logical_map)
    return per_slot.view(weight.shape[0], num_ranks, -1).sum(-1).max(-1).values
