"""Regional compilation: the decoder's layers grouped into kinds, one compiled graph per kind.

A transformers decoder is an embedding, ``num_hidden_layers`` instances of one decoder-layer class
and a final norm. The layers run the same code on different weights and KV caches, so
``torch.compile`` of the whole decoder traces, lowers and compiles that code 30 times over (SmolLM2),
and ~390 s of a cold compile went to it on 2 cores. Compiled per layer, the work is done once per
*kind* of layer and reused by every layer of that kind (PyTorch's "regional compilation" recipe):

* :func:`decoder_layers` finds the repeated layers (the ``nn.ModuleList`` of ``num_hidden_layers``);
* :func:`layer_kinds` groups them by a structural fingerprint (:func:`layer_fingerprint`: module
  classes, their non-tensor attributes, parameter shapes and dtypes, the attention call spec the
  backend was built with), so layers that differ in anything a trace could bake in -- a sliding
  window, a softcap, a quantized projection -- never share a graph;
* :func:`layer_entry` gives each kind a function with a code object of its own (dynamo keeps its
  graphs and guards per code object), which calls the layer class's ``forward`` with the layer's
  :class:`LayerHandle` as the keyword ``servelab_layer``.

The layer's identity reaches attention as data (the vLLM lesson: keep the layer out of the graph's
constants): the handle's ``index`` is a 0-d tensor the opaque attention op reads at run time, and its
``kv_cache`` is the tensor a traced attention writes and reads, a graph input. Nothing in a layer
graph reads ``layer_idx``.

:class:`LayerGraphs` runs the layers. The first call of a kind for a *step key* (one token or more;
attention traced into the graph or the opaque op) goes through ``torch.compile``, and the bytecode
dynamo generated for it is kept (a bytecode hook); later calls of that kind and key run that
bytecode directly, without dynamo's frame evaluation and guard checks, as vLLM's compilation wrapper
dispatches to its compiled code. Those were ~60 us per layer call, 1.8 ms of a 15 ms SmolLM2 batch-1
decode step; the dispatch key is what the guards would have told apart in a run (the token dim is
dynamic in the graphs of more than one token, and the fingerprint fixes everything else a layer's
trace reads). After one step of a key has been watched, its later steps run every layer's graph from
layer 0's call, the other layers passing their input through (``framework/compilation/layer_stack.py``),
where the model's layer loop does nothing but chain its layers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import logging
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config

from framework.compilation.layer_stack import DirectCall, LayerStack, StackProbe, direct_call, hooks_set

logger = logging.getLogger(__name__)

_ENTRY_IDS = itertools.count()
#: Module attributes that differ between layers without changing their code: left out of the fingerprint.
PER_LAYER_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "training"})
_CONSTANT_TYPES = (int, float, str, bool, type(None), enum.Enum, torch.dtype, torch.device)


@dataclass(eq=False)
class LayerHandle:
    """One decoder layer's identity, passed into its compiled graph as the keyword ``servelab_layer``.

    Built once per layer when the decoder is compiled (the KV cache tensors live as long as the runner).
    """

    index: torch.Tensor  # () int64 on the CPU: the layer index, read by the opaque attention op at run time
    kv_cache: torch.Tensor  # the layer's KV cache (backend.get_kv_cache_shape): a traced attention's graph input
    group: int  # the layer's KV cache group: LayerGraphs passes the layer its group's view of the step's traced inputs
    spec_layer: int  # the first layer of its kind: whose attention spec a call is checked against while tracing


def decoder_layers(decoder: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The decoder's repeated layers: its one ``nn.ModuleList`` child holding ``num_layers`` modules.

    Args:
        decoder: ``model.get_decoder()`` of a transformers ``*ForCausalLM``.
        num_layers: ``config.num_hidden_layers``.

    Raises:
        ValueError: no such child, or more than one (the decoder is not one stack of layers).
    """
    found = [m for m in decoder.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if len(found) != 1:
        raise ValueError(f"{type(decoder).__name__} has {len(found)} nn.ModuleList children of "
                         f"{num_layers} layers (num_hidden_layers); regional compilation needs exactly one")
    return found[0]


def _constant(value: Any) -> Any:
    """A hashable stand-in for one module attribute in a fingerprint: by value for constants, tensors'
    metadata, tuples and frozen dataclasses (value objects, such as a tensor-parallel projection's
    ``Shard``: equal on every layer of a rank); functions by name; ``functools.partial`` by its function
    and arguments; a method bound to a module by its function and the module's class (torchao's
    quantization binds a partial ``extra_repr`` to every linear it converts); any other object by identity."""
    if isinstance(value, _CONSTANT_TYPES):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen:
        return (type(value).__qualname__, tuple((f.name, _constant(getattr(value, f.name)))
                                                for f in dataclasses.fields(value)))
    if isinstance(value, types.MethodType):
        owner = value.__self__
        return ("method", _constant(value.__func__),
                ("module", type(owner).__qualname__) if isinstance(owner, torch.nn.Module) else _constant(owner))
    if isinstance(value, functools.partial):
        return ("partial", _constant(value.func), _constant(value.args),
                tuple(sorted((k, _constant(v)) for k, v in value.keywords.items())))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, type(value).__name__)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_constant(v) for v in value))
    if callable(value) and hasattr(value, "__qualname__"):
        return ("callable", getattr(value, "__module__", None), value.__qualname__)
    return ("object", id(value))  # shared objects (a config) match; per-layer objects split kinds


def layer_fingerprint(layer: torch.nn.Module) -> tuple:
    """What a trace of ``layer`` can depend on besides its weights' values: per submodule, its class,
    its public non-module attributes (minus :data:`PER_LAYER_ATTRIBUTES`) and its parameters' and
    buffers' names, shapes, dtypes and tensor classes."""
    parts = []
    for name, module in layer.named_modules():
        attributes = tuple(sorted((k, _constant(v)) for k, v in vars(module).items()
                                  if not k.startswith("_") and k not in PER_LAYER_ATTRIBUTES
                                  and not isinstance(v, torch.nn.Module)))
        tensors = tuple((n, tuple(t.shape), t.dtype, type(t).__name__)
                        for n, t in itertools.chain(module.named_parameters(recurse=False),
                                                    module.named_buffers(recurse=False)))
        parts.append((name, type(module).__qualname__, attributes, tensors))
    return tuple(parts)


def layer_kinds(layers: torch.nn.ModuleList, extra: list[Any]) -> list[int]:
    """Each layer's kind: layers with equal :func:`layer_fingerprint` and equal ``extra`` share one.

    Args:
        layers: the decoder's layers (:func:`decoder_layers`).
        extra: one hashable per layer that also tells kinds apart (the attention call spec; the
            layer's own id when weights are frozen into its graph).

    Returns:
        ``(num_layers,)`` kind ids, numbered in order of first appearance from 0.
    """
    ids: dict[Any, int] = {}
    return [ids.setdefault((layer_fingerprint(layer), key), len(ids)) for layer, key in zip(layers, extra, strict=True)]


def layer_entry(forward: Callable[..., Any], kind: int) -> Callable[..., Any]:
    """``entry(layer, handle, args, kwargs) -> forward(layer, *args, servelab_layer=handle, **kwargs)``
    with a code object no other entry shares, for ``torch.compile``: dynamo keeps compiled graphs per
    code object, so each kind's graphs are looked up only for layers of that kind.

    Args:
        forward: the layer class's ``forward`` (unbound).
        kind: the kind id (in the code object's name, which dynamo's logs show).
    """
    def entry(layer: torch.nn.Module, handle: LayerHandle, args: tuple, kwargs: dict) -> Any:
        return forward(layer, *args, servelab_layer=handle, **kwargs)

    return with_own_code(entry, f"decoder_layer_kind{kind}")


class WeakBackend:
    """A ``torch.compile`` backend that calls a bound method through a weak reference.

    Dynamo keeps every backend it is given in a module-global registry for the life of the process
    (``torch._dynamo.eval_frame.cached_backends``), so a bound method passed as the backend kept its
    engine -- the model's weights and the whole KV cache -- alive after the engine was dropped (1 GiB
    of KV per compiled stories260K engine: a test worker that built a dozen reached 14.7 GB and was
    killed). The registry now holds this small object only.

    Args:
        method: the bound method to call as ``method(gm, example_inputs, **kwargs)``.
        kwargs: keyword arguments added to every call (``label=...``).

    Raises:
        RuntimeError: (when called) the method's object is gone, so nothing can run the graph anyway.
    """

    def __init__(self, method: Callable[..., Any], **kwargs: Any) -> None:
        self._method = weakref.WeakMethod(method)
        self._kwargs = kwargs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        method = self._method()
        if method is None:
            raise RuntimeError("the engine that owns this torch.compile backend is gone")
        return method(gm, example_inputs, **self._kwargs)


def with_own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of the function ``fn`` (same globals and closure) with a code object of its own, named
    ``<name>_<n>``: dynamo keys its compiled graphs and guards by code object, so a copy made per
    engine never shares (or counts against the recompile limit of) another engine's graphs."""
    code = fn.__code__.replace(co_name=f"{name}_{next(_ENTRY_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class LayerGraphs:
    """Runs decoder layers through one compiled graph per (kind, step key), dispatching without guards.

    Args:
        layers: the decoder's layers.
        kinds: each layer's kind (:func:`layer_kinds`).
        handles: each layer's :class:`LayerHandle`.
        backend: the ``torch.compile`` backend (a callable ``(GraphModule, example_inputs)``).
    """

    def __init__(self, layers: torch.nn.ModuleList, kinds: Sequence[int], handles: Sequence[LayerHandle],
                 backend: Callable[..., Any]) -> None:
        self.layers, self.kinds, self.handles = layers, list(kinds), list(handles)
        first = {kind: i for i, kind in reversed(list(enumerate(kinds)))}
        self._entries = {kind: layer_entry(type(layers[i]).forward, kind) for kind, i in first.items()}
        self._backend = backend
        self._compiled = {kind: torch.compile(entry, backend=WeakBackend(self._recording_backend), dynamic=None,
                                              fullgraph=True)
                          for kind, entry in self._entries.items()}
        self._graphs: dict[tuple, Callable[..., Any]] = {}
        self._recorded: DirectCall | None = None  # the graph the backend compiled last
        self._direct: dict[tuple, DirectCall] = {}  # (kind, key) -> its graph without dynamo
        self._probes: dict[tuple, StackProbe] = {}  # step key -> the step being watched
        self._stacks: dict[tuple, LayerStack | None] = {}  # step key -> its stack (None: per layer)
        self._passing: LayerStack | None = None  # this step ran stacked: later layers pass through
        #: run the stacks built (False: every step calls its layers one by one, for an A/B of the stack)
        self.stack_enabled = True
        #: per step key in words, ``"stacked"`` or why its layers are called one by one (``metrics.json``)
        self.layer_stack: dict[str, str] = {}

    @property
    def num_kinds(self) -> int:
        """Distinct layer kinds (one compiled graph each per step key)."""
        return len(self._entries)

    def run(self, i: int, key: tuple, args: tuple, kwargs: dict) -> Any:
        """Layer ``i``'s forward through its kind's graph for step ``key`` (compiled at first use); once
        ``key`` has a :class:`~framework.compilation.layer_stack.LayerStack`, layer 0's call runs every layer and
        the later layers' calls return their input.

        Args:
            i: the layer index.
            key: the step's dispatch key, ``(num_tokens == 1, attention traced)``.
            args, kwargs: the layer's call arguments (``hidden_states`` ``(1, num_tokens, hidden)``...).

        Returns:
            The layer's output, as its ``forward`` returns it.

        Raises:
            Exception: whatever dynamo or inductor raise while compiling (the caller falls back).
        """
        if i == 0:
            self._passing = None
            stack = self._stacks.get(key)
            # a forward hook set since the probe must see every layer's real call
            if stack is not None and self.stack_enabled and not hooks_set(self.layers):
                out = stack(args, kwargs)
                self._passing = stack
                return out
        elif self._passing is not None:
            return self._passing.pass_through(args, kwargs)
        fn = self._graphs.get((self.kinds[i], key))
        if fn is None:
            return self._compile(i, key, args, group_view(kwargs, self.handles[i].group))
        out = fn(self.layers[i], self.handles[i], args, group_view(kwargs, self.handles[i].group))
        if key not in self._stacks:
            self._watch(i, key, args, kwargs, out)
        return out

    def _watch(self, i: int, key: tuple, args: tuple, kwargs: dict, out: Any) -> None:
        """Feed the step key's :class:`~framework.compilation.layer_stack.StackProbe` (once every kind has a
        direct call for ``key``); when its step is complete, decide the key's stack."""
        if not all((kind, key) in self._direct for kind in set(self.kinds)):
            if all((kind, key) in self._graphs for kind in set(self.kinds)):
                self._decide(key, "a layer graph was compiled before this engine (no direct call)", None)
            return
        probe = self._probes.setdefault(key, StackProbe(len(self.layers)))
        if not probe.record(i, args, kwargs, out):
            return
        calls = {kind: self._direct[(kind, key)] for kind in set(self.kinds)}
        reason, stack = probe.why_not(
            self.layers, lambda form: LayerStack(self.layers, self.kinds, self.handles, calls, form, group_view))
        self._decide(key, reason, stack)

    def _decide(self, key: tuple, reason: str | None, stack: LayerStack | None) -> None:
        self._probes.pop(key, None)
        self._stacks[key] = stack
        self.layer_stack[step_key_name(key)] = "stacked" if reason is None else f"per layer: {reason}"
        if reason is None:
            logger.info("engine.compile: %s steps run the %d layers as one loop of graph calls", step_key_name(key),
                        len(self.layers))
        else:
            logger.info("engine.compile: %s steps call the layers one by one: %s", step_key_name(key), reason)

    def _recording_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The backend, keeping what :class:`~framework.compilation.layer_stack.DirectCall` needs of its graph."""
        fn = self._backend(gm, example_inputs)
        self._recorded = direct_call(gm, fn)
        return fn

    def _compile(self, i: int, key: tuple, args: tuple, kwargs: dict) -> Any:
        """Run layer ``i`` through ``torch.compile``, compiling its kind for ``key``, and keep the
        bytecode dynamo generated for it; returns the layer's output."""
        kind, entry = self.kinds[i], self._entries[self.kinds[i]]
        if not key[0]:  # more than one token: the token dim is symbolic (and inductor's size hint)
            mark_token_dim(args, kwargs)
        captured: list[types.CodeType] = []

        def hook(old: types.CodeType, new: types.CodeType) -> None:
            if old is entry.__code__:
                captured.append(new)

        handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        self._recorded = None
        try:
            # duck sizing off: two dynamic dims that happen to be equal here (e.g. a traced backend's
            # partition count and the batch size) must not share a symbol
            with fx_config.patch(use_duck_shape=False):
                out = self._compiled[kind](self.layers[i], self.handles[i], args, kwargs)
        finally:
            handle.remove()
        if captured:
            self._graphs[(kind, key)] = types.FunctionType(captured[-1], entry.__globals__, entry.__name__, None,
                                                           entry.__closure__)
        else:  # dynamo had a graph for these inputs already: keep calling through its guards
            self._graphs[(kind, key)] = self._compiled[kind]
        if captured and self._recorded is not None:
            self._direct[(kind, key)] = self._recorded
        return out


def group_view(kwargs: dict, group: int) -> dict:
    """A layer's call keywords as its compiled graph takes them: ``servelab_graph`` (the step's traced
    attention state, when attention is traced) narrowed to the layer's KV cache group
    (:meth:`GraphAttention.for_group <framework.model_executor.forward_context.GraphAttention.for_group>`), so
    the graph reads its inputs from the same place in every group and layers of one type in several
    groups (Gemma 3, gpt-oss) are one kind. ``kwargs`` itself when nothing changes."""
    graph = kwargs.get("servelab_graph")
    if graph is None or graph.group_inputs is None:
        return kwargs
    return {**kwargs, "servelab_graph": graph.for_group(group)}


def step_key_name(key: tuple) -> str:
    """A step key ``(num_tokens == 1, attention traced)`` in words, as logs and ``metrics.json`` name it
    (``"1-token traced-attention"``, ``"many-token"``...)."""
    return ("1-token" if key[0] else "many-token") + (" traced-attention" if key[1] else "")


def mark_token_dim(args: tuple, kwargs: dict) -> None:
    """Mark dim 1 (tokens) of a layer's ``(1, num_tokens, ...)`` inputs dynamic for the trace: the
    hidden states, position ids and the rotary ``(cos, sin)`` tables."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return
    num_tokens = hidden.shape[1]
    for value in (*args, *kwargs.values()):
        for t in (value if isinstance(value, tuple) else (value,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == num_tokens:
                torch._dynamo.maybe_mark_dynamic(t, 1)
