"""``kv_connector=multi``: an ordered list of connectors (vLLM's ``MultiConnector``), so that an offload tier and a
shared store or P/D transfer (``zmq``, at one rank) compose.

Loads come from the first connector that reports a match: ``get_num_new_matched_tokens`` asks every connector in
order and the first non-zero answer wins (vLLM's rule, even when a later one would offer more); only that one is
told to load (``update_state_after_alloc``; the others get 0 tokens). Every connector saves what it saves on its
own. Each step's metadata is one per connector; each worker side's events and load errors come back together
(events tagged with the connector's index, so each scheduler side sees its own). At most one connector may hand
back ``kv_transfer_params`` for a request (vLLM's rule). A finished request whose blocks several connectors still
send (``delay_free``) is reported ``finished_sending`` once all of them have (vLLM's ``extra_async_saves``: the
scheduler side tells the worker sides how many more reports to wait for).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from framework import hookimpl, registry
from framework.core.outputs import merge_load_error_reasons
from framework.hookspecs import Register
from framework.interfaces import KVConnector, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from framework.interfaces.kv_connector import KVShard

if TYPE_CHECKING:
    import torch

    from framework.config import EngineConfig
    from framework.core.outputs import SchedulerOutput
    from framework.core.request import Request
    from framework.interfaces import AttentionBackend


@dataclass
class MultiMetadata(KVConnectorMetadata):
    """One metadata per connector, in list order."""

    metas: list[KVConnectorMetadata] = field(default_factory=list)
    # request id -> sends beyond the first still to come before its blocks may be freed (several connectors delayed)
    extra_async_saves: dict[str, int] = field(default_factory=dict)


class MultiConnector(KVConnector):
    """Drives ``connectors`` in order (docs/kv_transfer.md#multi).

    Args:
        role, block_size, kv_role: see :class:`~framework.interfaces.KVConnector`; passed to every connector.
        connectors: ``kv_connector.params.connectors``, an ordered list of ``{"name": <kv_connector>, "params":
            {...}}``.

    Raises:
        ValueError: an empty list, an entry without ``name``, or ``none`` / ``multi`` in the list.
        KeyError: an unknown connector name (the registry lists the valid ones).
    """

    name = "multi"

    def __init__(self, role: KVConnectorRole, block_size: int, kv_role: str = "kv_both",
                 connectors: list[dict[str, Any]] | None = None, **params: Any) -> None:
        super().__init__(role, block_size, kv_role, **params)
        problems = _list_problems(connectors)
        if problems:
            raise ValueError("; ".join(problems))
        self.connectors: list[KVConnector] = [
            registry.create("kv_connector", entry["name"], role=role, block_size=block_size, kv_role=kv_role,
                            **dict(entry.get("params") or {}))
            for entry in connectors]
        self._kv_shard = KVShard()
        self._chosen: dict[str, int] = {}  # request id -> index of the connector its lookup chose
        self._extra_async_saves: dict[str, int] = {}  # scheduler side: to send; worker side: sends still withheld

    @property
    def kv_shard(self) -> KVShard:  # type: ignore[override]
        """The shard this instance moves; setting it sets every listed connector's (the engine sets it once)."""
        return self._kv_shard

    @kv_shard.setter
    def kv_shard(self, shard: KVShard) -> None:
        self._kv_shard = shard
        for connector in self.connectors:
            connector.kv_shard = shard

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Also: a non-empty list of ``{name, params}`` naming other registered connectors; ``zmq`` only at one
        rank (as ``kv_connector=zmq`` itself)."""
        connectors = config.kv_connector_params.get("connectors")
        problems = super().validate(config) + _list_problems(connectors)
        names = [entry.get("name") for entry in connectors or () if isinstance(entry, dict)]
        if config.tensor_parallel_size > 1 and "zmq" in names:
            problems.append("kv_connector=multi: zmq in the list at tensor_parallel_size > 1 stalls its pulls for "
                            "minutes (a known defect, docs/kv_transfer.md): use kv_connector=zmq alone at "
                            "tensor_parallel_size > 1, or parallel.tensor_parallel_size=1")
        return problems

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The first non-zero answer of the connectors, in order (vLLM's rule); ``(0, False)`` when none has it."""
        self._chosen.pop(request.request_id, None)
        for i, connector in enumerate(self.connectors):
            num_tokens, load_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens:
                self._chosen[request.request_id] = i
                return num_tokens, load_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The chosen connector loads ``num_external_tokens``; the others are told 0."""
        chosen = self._chosen.pop(request.request_id, -1)
        for i, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiMetadata:
        """Every connector's metadata, in order, and the requests finished since the last step that several
        connectors delay."""
        meta = MultiMetadata(metas=[c.build_connector_meta(scheduler_output) for c in self.connectors],
                             extra_async_saves=self._extra_async_saves)
        self._extra_async_saves = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each connector gets the report with its own events (``(index, event)`` pairs, untagged here)."""
        events = connector_output.kv_cache_events or []
        for i, connector in enumerate(self.connectors):
            own = [event for j, event in events if j == i]
            connector.update_connector_output(KVConnectorOutput(
                finished_sending=connector_output.finished_sending, finished_recving=connector_output.finished_recving,
                invalid_block_ids=connector_output.invalid_block_ids, kv_cache_events=own or None,
                load_error_reasons=connector_output.load_error_reasons))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay when any connector delays; the one connector's ``kv_transfer_params``.

        Raises:
            RuntimeError: two connectors hand back ``kv_transfer_params`` for the request (vLLM's rule).
        """
        self._chosen.pop(request.request_id, None)
        num_delayed, params = 0, None
        for connector in self.connectors:
            delay_one, params_one = connector.request_finished(request, block_ids)
            num_delayed += bool(delay_one)
            if params_one is not None:
                if params is not None:
                    raise RuntimeError("kv_connector=multi: only one connector may return kv_transfer_params")
                params = params_one
        if num_delayed > 1:
            self._extra_async_saves[request.request_id] = num_delayed - 1
        return num_delayed > 0, params

    # ---- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        """Hand the caches to every connector."""
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches, backend)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind each connector's own metadata."""
        super().bind_connector_metadata(connector_metadata)
        self._extra_async_saves.update(connector_metadata.extra_async_saves)
        for connector, meta in zip(self.connectors, connector_metadata.metas, strict=True):
            connector.bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        """Clear every connector's metadata."""
        super().clear_connector_metadata()
        for connector in self.connectors:
            connector.clear_connector_metadata()

    def start_load_kv(self, **kwargs: Any) -> None:
        """Every connector starts its loads (only the chosen one has any per request)."""
        for connector in self.connectors:
            connector.start_load_kv(**kwargs)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Wait for every connector's loads of the layer."""
        for connector in self.connectors:
            connector.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Every connector saves."""
        for connector in self.connectors:
            connector.save_kv_layer(layer_idx, kv_layer, **kwargs)

    def wait_for_save(self) -> None:
        """Wait for every connector's saves."""
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The union of the connectors' finished transfers (None when none reports any); a request several
        connectors send is reported once the last of them reports it."""
        results = [connector.get_finished(finished_req_ids) for connector in self.connectors]
        sending: set[str] = set()
        for one, _ in results:
            for rid in one or ():
                if self._extra_async_saves.get(rid, 0) > 0:  # another connector still sends it
                    self._extra_async_saves[rid] -= 1
                else:
                    self._extra_async_saves.pop(rid, None)
                    sending.add(rid)
        recving = [r for _, r in results if r is not None]
        return (sending or None), (set().union(*recving) if recving else None)

    def get_kv_connector_kv_cache_events(self) -> list[tuple[int, Any]] | None:
        """Every connector's events, tagged with its index."""
        events = [(i, event) for i, connector in enumerate(self.connectors)
                  for event in connector.get_kv_connector_kv_cache_events() or ()]
        return events or None

    def get_kv_connector_stats(self) -> list[tuple[int, float]] | None:
        """Every connector's finished transfers, ``(bytes, seconds)`` each, concatenated (None when none reports
        any): a ``zmq`` under ``multi`` counts its pulls in the transfer metrics as it does alone."""
        stats = [one for connector in self.connectors for one in connector.get_kv_connector_stats() or ()]
        return stats or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The union of the connectors' load errors."""
        return set().union(*(c.get_block_ids_with_load_errors() for c in self.connectors))

    def get_load_error_reasons(self) -> dict[int, str] | None:
        """The connectors' reasons for their load errors (the first connector's reason of a block wins)."""
        return merge_load_error_reasons([c.get_load_error_reasons() for c in self.connectors])


def _list_problems(connectors: Any) -> list[str]:
    """What is wrong with ``kv_connector.params.connectors``, each naming the fix."""
    if not connectors or not isinstance(connectors, list | tuple):
        return ["kv_connector=multi needs kv_connector.params.connectors=[{name: offload, params: {...}}, ...] "
                "(an ordered, non-empty list)"]
    problems = []
    for i, entry in enumerate(connectors):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not name:
            problems.append(f"kv_connector.params.connectors[{i}] needs a name (a kv_connector plugin)")
        elif name in ("none", "multi"):
            problems.append(f"kv_connector.params.connectors[{i}]: {name} cannot be in a multi list; name a "
                            "connector that moves KV (offload, shared_storage, ...)")
    return problems


@hookimpl
def register_kv_connectors(register: Register) -> None:
    """Register ``multi``."""
    register("multi", MultiConnector)
