"""One abstract base class per plugin kind; implementations live in ``plugins/`` or other packages."""

from framework.interfaces.attention import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata, SpecTreeMask
from framework.interfaces.base import Plugin
from framework.interfaces.drafter import Drafter
from framework.interfaces.executor import EngineDeadError, Executor, WorkerError
from framework.interfaces.grammar import Grammar, GrammarMatcher
from framework.interfaces.kv_allocator import KVAllocator, KVCacheGroup, KVCacheStats
from framework.interfaces.kv_connector import KVConnector, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from framework.interfaces.lora_backend import LoRABackend, LoRABatch
from framework.interfaces.quant import QuantMethod
from framework.interfaces.router import NoReplicaError, ReplicaState, Router
from framework.interfaces.scheduler_policy import SchedulerPolicy
from framework.interfaces.tracker import Tracker

__all__ = [
    "AttentionBackend", "AttentionLayerSpec", "CommonAttentionMetadata", "Drafter", "EngineDeadError", "Executor",
    "Grammar", "GrammarMatcher", "KVAllocator", "KVCacheGroup", "KVCacheStats", "KVConnector",
    "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole", "LoRABackend", "LoRABatch", "NoReplicaError", "Plugin", "QuantMethod",
    "ReplicaState", "Router", "SchedulerPolicy", "SpecTreeMask", "Tracker", "WorkerError",
]
