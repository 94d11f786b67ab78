"""A step's decoder layers run as one loop of compiled-graph calls, from the first layer's call.

Each compiled layer is reached through transformers' layer loop: ``nn.Module.__call__``, the
layer's replaced ``forward``, :meth:`LayerGraphs.run <framework.compilation.regions.LayerGraphs.run>`,
the bytecode dynamo generated (which gathers the graph's inputs from the layer, its handle and the
call's arguments) and AOT autograd's wrapper, before inductor's code runs the layer's one kernel.
At batch 1 that Python is a sixth of a step (SmolLM2 bf16, 2-core CPU: ~2.5 ms of a ~15 ms step,
measured by replaying the 30 inductor calls bare), and it runs on a cache the layer's 7 MB of
weights have just flushed.

:class:`LayerStack` removes most of it. When layer 0 is called, it runs every layer itself: each
layer's graph is called directly with inputs gathered as dynamo's own sources say (the graph's
placeholders carry them, :class:`DirectCall`): the layer's weights and handle once at build time,
the call's other arguments (rotary tables, attention metadata, sizes) once per step and KV cache
group, the hidden states threaded from one layer's output to the next. It returns the last layer's
output, and the other layers, still called by transformers' loop, hand their input back unchanged
(:meth:`LayerStack.pass_through`).

That is only the same computation when the model's loop does nothing but chain its layers, so a
stack is built for a step key only after one normal step of that key was watched
(:class:`StackProbe`): every layer got the very objects layer 0 got apart from the hidden states,
each layer's input was the previous layer's output, the outputs had one form (a tensor, or a tuple
of it and ``None``), no module hooks were set, and layer 0's direct call reproduced its output
bit for bit. A model whose loop passes per-layer inputs (a per-layer embedding, a mask chosen by
layer type) keeps the per-layer path. This is CUDA graphs' idea (replay the step's kernels without
the framework around them) done with what dynamo already knows, with no new compilation.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
#: Dynamo's source names of a layer's hidden states input, as transformers' loops pass them.
HIDDEN_SOURCES = ("L['args'][0]", "L['kwargs']['hidden_states']")
_PER_LAYER_ROOTS = ("L['layer']", "L['handle']")


@dataclass
class DirectCall:
    """One compiled layer graph, callable without dynamo.

    Attributes:
        fn: what the ``torch.compile`` backend returned (AOT autograd's wrapper of inductor's code),
            called as dynamo's bytecode calls it: ``fn(*inputs)``.
        sources: each graph input's dynamo source, a Python expression over ``L`` (``{"layer",
            "handle", "args", "kwargs"}``: the layer entry's locals), in the graph's input order.
        num_outputs: the graph's outputs (a layer that returns its hidden states only: 1).
    """

    fn: Callable[..., Any]
    sources: list[str]
    num_outputs: int


def direct_call(gm: torch.fx.GraphModule, fn: Callable[..., Any]) -> DirectCall | None:
    """The :class:`DirectCall` of a graph dynamo traced (``gm``) and its backend compiled (``fn``);
    ``None`` when an input has no source (nothing to gather it from)."""
    sources = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = node.meta.get("grapharg")
        source = getattr(arg, "source", None)
        if source is None:
            return None
        name = source.name() if callable(source.name) else source.name
        sources.append(name)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    return DirectCall(fn, sources,
                      len(outs) if isinstance(outs, (tuple, list)) else 1)


def _gatherer(sources: Sequence[str]) -> Callable[[dict], tuple]:
    """``gather(L) -> tuple`` evaluating ``sources`` (dynamo source names) over ``L``.

    Raises:
        SyntaxError: a source is not a plain Python expression.
    """
    body = ", ".join(sources)
    return eval(f"lambda L: ({body}{',' if sources else ''})", {"__builtins__": builtins})  # noqa: S307 - dynamo's names


def output_form(out: Any) -> int | None:
    """How a layer returns its hidden states: ``0`` a tensor, ``n >= 1`` a tuple of ``n`` whose first
    item is the tensor and the rest ``None``; ``None`` anything else (no stack)."""
    if isinstance(out, torch.Tensor):
        return 0
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and all(x is None for x in out[1:]):
        return len(out)
    return None


def _wrap(hidden: torch.Tensor, form: int) -> Any:
    return hidden if form == 0 else (hidden,) + (None,) * (form - 1)


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return args[0] if args else kwargs.get("hidden_states")


class LayerStack:
    """Runs all decoder layers of one step key as a loop of direct graph calls (module docstring).

    The layers' weights, KV caches and handles are gathered once, here: a parameter or buffer replaced
    on a layer afterwards (rather than updated in place) would not be seen, as with inductor freezing.

    Args:
        layers: the decoder's layers.
        kinds: each layer's kind.
        handles: each layer's ``LayerHandle``.
        calls: per kind, the :class:`DirectCall` of its graph for this step key.
        form: the layers' output form (:func:`output_form`).
        view: ``view(kwargs, group) -> kwargs``: the call's keywords as a layer of KV cache group
            ``group`` (``handle.group``) is given them (``compile_regions.group_view``); the per-step
            inputs are gathered once per kind and group. ``None``: every layer gets the call's own.

    Raises:
        ValueError: a graph input whose source is neither per layer nor per call, a graph with more
            than one output, no hidden-states input, or a source that does not evaluate.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], kinds: Sequence[int], handles: Sequence[Any],
                 calls: dict[int, DirectCall], form: int,
                 view: Callable[[dict, int], dict] | None = None) -> None:
        self.form = form
        self._view = view
        self._per_step: dict[int, tuple[Callable[[dict], tuple], list[int], int]] = {}
        static: dict[int, tuple[Callable[[dict], tuple], list[int]]] = {}
        for kind, call in calls.items():
            if call.num_outputs != 1:
                raise ValueError(f"the layer graph has {call.num_outputs} outputs (the hidden states only: 1)")
            hidden = [p for p, s in enumerate(call.sources) if s in HIDDEN_SOURCES]
            if len(hidden) != 1:
                raise ValueError("the layer graph has no single hidden-states input")
            mine = [p for p, s in enumerate(call.sources) if s.startswith(_PER_LAYER_ROOTS)]
            step = [p for p, s in enumerate(call.sources) if p not in mine and p != hidden[0]]
            if not all(call.sources[p].startswith(("L['args']", "L['kwargs']")) for p in step):
                raise ValueError("a layer graph input is neither the layer's nor the call's: "
                                 + ", ".join(call.sources[p] for p in step))
            try:
                static[kind] = (_gatherer([call.sources[p] for p in mine]), mine)
                self._per_step[kind] = (_gatherer([call.sources[p] for p in step]), step, hidden[0])
            except SyntaxError as err:
                raise ValueError(f"a source does not evaluate: {err}") from err
        self._layers: list[tuple[Callable[..., Any], tuple[int, int], list[Any]]] = []
        for layer, kind, handle in zip(layers, kinds, handles, strict=True):
            call = calls[kind]
            gather, positions = static[kind]
            template: list[Any] = [None] * len(call.sources)
            for p, value in zip(positions, gather({"layer": layer, "handle": handle}), strict=True):
                template[p] = value
            self._layers.append((call.fn, (kind, getattr(handle, "group", 0)), template))

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        """Every layer's forward in turn, from layer 0's call arguments; returns the last layer's output
        in the layers' form (layer 0's hidden states ``(1, num_tokens, hidden_size)`` in, the
        decoder's last layer's out, model dtype)."""
        return _wrap(self._run(self._layers, args, kwargs), self.form)

    def call_one(self, i: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """Layer ``i`` alone through its direct call (the probe's check); its output hidden states."""
        return self._run(self._layers[i:i + 1], args, kwargs)

    def _run(self, layers: list[tuple[Callable[..., Any], tuple[int, int], list[Any]]], args: tuple,
             kwargs: dict) -> torch.Tensor:
        """``layers`` (entries of ``self._layers``) in turn from the call's arguments: the per-step inputs
        gathered once per kind and KV cache group, the hidden states threaded through; the last one's
        output hidden states."""
        step: dict[tuple[int, int], tuple[tuple, list[int], int]] = {}
        h = _hidden_arg(args, kwargs)
        for fn, kind_group, template in layers:
            if kind_group not in step:
                kind, group = kind_group
                gather, positions, hidden = self._per_step[kind]
                scope = {"args": args, "kwargs": kwargs if self._view is None else self._view(kwargs, group)}
                step[kind_group] = (gather(scope), positions, hidden)
            values, positions, hidden = step[kind_group]
            inputs = list(template)
            for p, value in zip(positions, values):
                inputs[p] = value
            inputs[hidden] = h
            h = fn(*inputs)[0]
        return h

    def pass_through(self, args: tuple, kwargs: dict) -> Any:
        """A later layer's result in a stacked step: its input, unchanged, in the layers' form."""
        return _wrap(_hidden_arg(args, kwargs), self.form)


def hooks_set(layers: Sequence[torch.nn.Module]) -> bool:
    """Any forward hook or pre-hook on a layer, or a global one (they would see passed-through layers)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in layers)


class StackProbe:
    """Watches one normal step of a step key and says whether its layers may run as a :class:`LayerStack`.

    Args:
        num_layers: the decoder's layers (the step is complete when the last one has run).
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.calls: list[tuple[tuple, dict, Any]] = []

    def record(self, i: int, args: tuple, kwargs: dict, out: Any) -> bool:
        """Record layer ``i``'s call; ``True`` once the step's last layer has run. A call out of order
        (a step cut short) restarts the record at layer 0."""
        if i != len(self.calls):
            self.calls = []
            if i != 0:
                return False
        self.calls.append((args, kwargs, out))
        return len(self.calls) == self.num_layers

    def why_not(self, layers: Sequence[torch.nn.Module], stack_for: Callable[[int], LayerStack]) -> tuple[str | None, LayerStack | None]:
        """After a complete step: ``(None, stack)`` when the layers only chained (module docstring),
        else ``(reason, None)``. ``stack_for(form)`` builds the stack (may raise ``ValueError``)."""
        args0, kwargs0, out0 = self.calls[0]
        form = output_form(out0)
        if form is None:
            return f"a layer returns {type(out0).__name__}, not its hidden states", None
        if hooks_set(layers):
            return "module forward hooks are set", None
        prev = out0 if form == 0 else out0[0]
        for i, (args, kwargs, out) in enumerate(self.calls[1:], start=1):
            if output_form(out) != form:
                return f"layer {i} returns another form than layer 0", None
            if _hidden_arg(args, kwargs) is not prev:
                return f"layer {i}'s input is not layer {i - 1}'s output", None
            if len(args) != len(args0) or any(a is not b for a, b in zip(args[1:], args0[1:])):
                return f"layer {i} gets other positional arguments than layer 0", None
            if kwargs.keys() != kwargs0.keys() or any(v is not kwargs0[k] for k, v in kwargs.items()
                                                      if k != "hidden_states"):
                return f"layer {i} gets other keyword arguments than layer 0", None
            prev = out if form == 0 else out[0]
        try:
            stack = stack_for(form)
            again = stack.call_one(0, args0, kwargs0)  # rewrites layer 0's K/V of this step: the same values
        except Exception as err:  # noqa: BLE001 - any failure here means the per-layer path stays
            return f"the direct call failed ({type(err).__name__}: {err})", None
        if not torch.equal(again, out0 if form == 0 else out0[0]):
            return "layer 0's direct call did not reproduce its output", None
        return None, stack
