"""``framework/compilation/layer_stack.py`` without a compiler: a stack gathers each layer's graph inputs from
dynamo's source names (the layer's weights once, the call's arguments once per step, the hidden states
threaded through), and the probe refuses every loop that does more than chain its layers."""

from __future__ import annotations

import pytest
import torch

from framework.compilation.layer_stack import DirectCall, LayerStack, StackProbe, output_form

SOURCES = ["L['layer']._parameters['weight']", "L['args'][0]", "L['kwargs']['scale']", "L['handle'].bias",
           "L['args'][0].size()[1]"]


class Handle:
    def __init__(self, bias: float) -> None:
        self.bias = torch.tensor(bias)


def graph(weight: torch.Tensor, hidden: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, num_tokens: int):
    """A stand-in for a compiled layer graph: its inputs in ``SOURCES`` order, one output."""
    assert hidden.shape[1] == num_tokens
    return (torch.tanh(hidden @ weight * scale + bias),)


def layers_and_handles(n: int = 3):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4, bias=False) for _ in range(n)]
    return layers, [Handle(0.1 * i) for i in range(n)]


def run_loop(layers, handles, hidden, scale, hook=None):
    """What transformers' loop computes: each layer on the previous one's output."""
    outs = []
    for layer, handle in zip(layers, handles):
        hidden = graph(layer.weight, hidden, scale, handle.bias, hidden.shape[1])[0]
        outs.append(hidden)
    return outs


def test_stack_gathers_inputs_by_source_and_threads_the_hidden_states():
    layers, handles = layers_and_handles()
    stack = LayerStack(layers, [0, 0, 0], handles, {0: DirectCall(graph, SOURCES, 1)}, form=0)
    hidden, scale = torch.randn(1, 5, 4), torch.tensor(0.5)
    out = stack((hidden,), {"scale": scale})
    assert torch.equal(out, run_loop(layers, handles, hidden, scale)[-1])
    assert torch.equal(stack.call_one(1, (hidden,), {"scale": scale}),
                       graph(layers[1].weight, hidden, scale, handles[1].bias, 5)[0])
    tuple_stack = LayerStack(layers, [0, 0, 0], handles, {0: DirectCall(graph, SOURCES, 1)}, form=2)
    assert tuple_stack.pass_through((hidden,), {})[0] is hidden and tuple_stack.pass_through((hidden,), {})[1] is None


def test_stack_gives_each_layer_its_kv_cache_groups_view():
    """Layers of one kind in two KV cache groups: each gets the call's keywords as ``view`` narrows them
    to its group (``compile_regions.group_view``), gathered once per group."""
    layers, handles = layers_and_handles()
    for handle, group in zip(handles, (1, 0, 1)):
        handle.group = group
    per_group = {0: torch.tensor(0.5), 1: torch.tensor(-2.0)}
    views = []

    def view(kwargs, group):
        views.append(group)
        return {**kwargs, "scale": per_group[group]}

    stack = LayerStack(layers, [0, 0, 0], handles, {0: DirectCall(graph, SOURCES, 1)}, form=0, view=view)
    hidden = torch.randn(1, 5, 4)
    want = hidden
    for layer, handle in zip(layers, handles):
        want = graph(layer.weight, want, per_group[handle.group], handle.bias, 5)[0]
    assert torch.equal(stack((hidden,), {"scale": torch.tensor(9.0)}), want)
    assert views == [1, 0]  # once per group


def test_stack_refuses_graphs_it_cannot_gather_or_chain():
    layers, handles = layers_and_handles()
    with pytest.raises(ValueError, match="neither the layer's nor the call's"):
        LayerStack(layers, [0] * 3, handles, {0: DirectCall(graph, [*SOURCES[:4], "G['table']"], 1)}, 0)
    with pytest.raises(ValueError, match="2 outputs"):
        LayerStack(layers, [0] * 3, handles, {0: DirectCall(graph, SOURCES, 2)}, 0)
    with pytest.raises(ValueError, match="hidden-states input"):
        LayerStack(layers, [0] * 3, handles, {0: DirectCall(graph, ["L['args'][1]", *SOURCES[2:]], 1)}, 0)


def probe_of(layers, handles, per_layer_kwargs=False, chained=True, out_form=0):
    """A probe fed one normal step of ``layers`` (variations: a kwarg object per layer, an input that
    is not the previous output, outputs as tuples with a second non-None item)."""
    hidden, scale = torch.randn(1, 2, 4), torch.tensor(0.5)
    outs = run_loop(layers, handles, hidden, scale)
    probe = StackProbe(len(layers))
    inputs = [hidden, *outs[:-1]]
    done = False
    for i, out in enumerate(outs):
        h = inputs[i] if chained else inputs[i].clone()
        kwargs = {"scale": scale.clone() if per_layer_kwargs and i else scale}
        done = probe.record(i, (h,), kwargs, out if out_form == 0 else (out, torch.zeros(1)))
    assert done
    return probe


@pytest.mark.parametrize(("variation", "reason"), [
    ({"per_layer_kwargs": True}, "layer 1 gets other keyword arguments"),
    ({"chained": False}, "layer 1's input is not layer 0's output"),
    ({"out_form": 2}, "a layer returns tuple"),
])
def test_probe_keeps_per_layer_calls_when_the_loop_does_more_than_chain(variation, reason):
    layers, handles = layers_and_handles()
    probe = probe_of(layers, handles, **variation)
    why, stack = probe.why_not(layers, lambda form: pytest.fail("no stack is built"))
    assert stack is None and why.startswith(reason)


def test_probe_builds_a_stack_that_reproduces_layer_0():
    layers, handles = layers_and_handles()
    build = lambda form: LayerStack(layers, [0] * 3, handles, {0: DirectCall(graph, SOURCES, 1)}, form)  # noqa: E731
    why, stack = probe_of(layers, handles).why_not(layers, build)
    assert why is None and isinstance(stack, LayerStack)
    wrong = lambda form: LayerStack(layers[::-1], [0] * 3, handles, {0: DirectCall(graph, SOURCES, 1)}, form)  # noqa: E731
    why, stack = probe_of(layers, handles).why_not(layers, wrong)
    assert stack is None and why == "layer 0's direct call did not reproduce its output"
    handle = layers[2].register_forward_pre_hook(lambda module, args: None)
    try:
        why, stack = probe_of(layers, handles).why_not(layers, build)
    finally:
        handle.remove()
    assert stack is None and why == "module forward hooks are set"


def test_output_form_and_out_of_order_records():
    t = torch.zeros(1)
    assert output_form(t) == 0 and output_form((t, None)) == 2 and output_form((t, t)) is None
    assert output_form([t]) is None
    probe = StackProbe(2)
    assert not probe.record(1, (t,), {}, t)  # a step seen from its middle is not recorded
    assert not probe.record(0, (t,), {}, t) and probe.record(1, (t,), {}, t)
