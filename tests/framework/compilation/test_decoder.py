"""The compiled decoder: greedy parity with transformers, no recompiles after the warm-up across a
mixed-length run (chunked prefill, prefix hits, batch-1 decode; prepacked and ATen linears), compiled at
start-up (``engine.compile=true``) and later (``auto``, past the break-even, after eager steps), the
attention custom op's contract, and the fallback to eager when the compiler is unavailable or fails."""

from __future__ import annotations

import gc
import logging
import tempfile
import weakref
from pathlib import Path

import pytest
import torch
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS, assert_all_blocks_free, assert_greedy_parity

from framework import LLM, SamplingParams
from framework.compilation.calibration import CompilePlanner
from framework.compilation.decoder import INDUCTOR_CONFIG, CompiledDecoder, cpu_simdlen, inductor_config
from framework.compilation.regions import layer_entry, layer_kinds
from framework.model_executor.forward_context import ForwardContext, attention_op, forward_context, servelab_attention
from framework.model_executor.prepack import PrepackedLinear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


PREPACK = "on" if torch.backends.mkldnn.is_available() else "off"
REAL_DECIDE = CompilePlanner.decide  # captured at import, before conftest's session patch keeps auto eager
#: the eager-decoder tests' torch_paged kernel runs eagerly (fallbacks, ``compile=false``): the decoder is their
#: subject, and compiling the kernel for their block size (``compiled_llm``'s is 8) is ~10 s of inductor they do
#: not need (the compiled kernel's tests: tests/plugins/attention/test_torch_paged.py)
EAGER_KERNEL_PARAMS = {"compile": False}


@pytest.fixture(scope="module")
def compiled_llm():
    """One compiled engine for the module (the warm-up compiles three graphs, tens of seconds), with
    the CPU's bf16 default of prepacked oneDNN linears (the opaque ``servelab::prepacked_linear`` op,
    fused q/k/v; the one-row graph's traced GEMV) forced on in float32, so its greedy tokens must equal
    transformers. Compiled ATen linears run in ``test_engines_keep_their_own_graphs`` (dynamo's graphs) and
    ``test_mla.py::test_compiled_latent_cache_matches_transformers`` (inductor's code).

    Its LM head is compiled too (``COMPILED_HEAD_MIN_BYTES`` lowered for stories260K's head: a fourth
    warm-up graph, one-row logits), so one inductor warm-up covers the layer graphs and the head.

    It is compiled the way ``engine.compile=auto`` (the default) does: eager first (gate/up fused, a
    generate that fills the prefix cache), then compiled before the ``generate`` call whose expected
    saving passes the warm-up (the planner's step times and warm-up faked: 30 ms eager decode steps at
    batch 1, a 1 s warm-up), which splits gate/up and drops the prefix cache the warm-up overwrites;
    the tests below then check parity and recompiles on that engine."""
    from framework.compilation import calibration as compile_calibration
    from framework.compilation import decoder as compile_module
    from framework.compilation import policy as compile_policy
    from framework.worker.model_runner import ModelRunner

    llm = LLM(model=STORIES, prepack_linears=PREPACK, block_size=8, max_num_batched_tokens=24,
              long_prefill_token_threshold=16)
    assert llm.config.compile == "auto"
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as calibration:
        mp.setattr(compile_calibration, "calibration_dir", lambda: Path(calibration))
        mp.setattr(compile_module, "COMPILED_HEAD_MIN_BYTES", 0)  # SmolLM2's 56 MiB head gets one; stories260K's too
        mp.setattr(compile_calibration.CompilePlanner, "decide", REAL_DECIDE)
        mp.setattr(compile_policy, "PRIOR_WARM_UP_S", {"cold": 1.0, "cached": 1.0})
        mp.setattr(ModelRunner, "time_decode_steps", lambda runner, sizes: {1: 30.0, 64: 180.0})
        # the tiny model's real steps (~1 ms) would scale the faked ones down: the faked ones stand
        mp.setattr(compile_calibration.CompilePlanner, "observe_decode_step", lambda *args, **kwargs: None)
        assert_greedy_parity(llm, PREFIX_PROMPTS[:3], max_tokens=8)  # 8 steps at batch 3, ~0.1 s saved: eager
        # eager so far, with cached prefix blocks that the warm-up's dummy K/V would corrupt if they stayed
        assert llm.engine.runner.compiled is None and llm.engine.kv_allocator._cached
        assert "eager" in llm.engine.metrics.summary()["compile_reason"]
        assert_greedy_parity(llm, PREFIX_PROMPTS[3:4], max_tokens=70)  # 70 steps at batch 1, 1.05 s: compiles first
    summary = llm.engine.metrics.summary()
    assert summary["compile_mode"] == "auto" and "compiling, ~1.0 s warm-up" in summary["compile_reason"]
    yield llm
    assert_all_blocks_free(llm.engine)


def test_warm_up_compiles_four_graphs(compiled_llm):
    stats = compiled_llm.engine.runner.compile_stats
    assert stats.active and stats.fallback_reason is None
    if PREPACK == "on":
        assert isinstance(compiled_llm.engine.runner.model.model.layers[0].self_attn.qkv_proj, PrepackedLinear)
    # default torch_paged: num_tokens >= 2 (opaque attention), and the traced-attention decode graphs
    # of num_tokens == 1 and >= 2, of the one layer kind all 5 layers share; the one-row head; no graph breaks
    assert stats.num_layer_kinds == 1 and stats.num_graphs_warmup == 4
    assert stats.compile_s > 0


def test_parity_and_no_recompiles_over_mixed_lengths(compiled_llm):
    """Chunked prefill (24-token budget, 16-token chunks), prefix-cache hits, batches shrinking to one
    decode: every step reuses a warm-up graph, and tokens equal transformers ``generate``."""
    assert_greedy_parity(compiled_llm, PREFIX_PROMPTS + STORY_PROMPTS, max_tokens=20)
    assert_greedy_parity(compiled_llm, [STORY_PROMPTS[3]], max_tokens=12)  # batch-1 decode, T == 1
    summary = compiled_llm.engine.metrics.summary()
    assert summary["prefix_cache_hit_rate"] > 0.1
    assert summary["compile"] and summary["compile_active"]
    assert summary["compile_num_recompiles"] == 0, "a step shape recompiled after the warm-up"
    assert summary["compile_num_graphs_warmup"] == 4 and summary["compile_s"] > 0
    # every step key ran stacked after its first step (layer_stack.py): the parity above covers both paths
    assert summary["compile_layer_stack"] == {"many-token": "stacked", "1-token traced-attention": "stacked",
                                              "many-token traced-attention": "stacked"}


def test_stacked_steps_run_the_layers_from_layer_0(compiled_llm, monkeypatch):
    """In a stacked step layer 0's call runs every layer's graph and the later layers hand their input
    back; a forward hook set on a layer makes the steps run per layer again (the hook sees every
    layer's real output), and both give transformers' tokens."""
    from framework.compilation import layer_stack

    stacked, passed = [], []
    call, pass_through = layer_stack.LayerStack.__call__, layer_stack.LayerStack.pass_through
    monkeypatch.setattr(layer_stack.LayerStack, "__call__", lambda self, *a: stacked.append(1) or call(self, *a))
    monkeypatch.setattr(layer_stack.LayerStack, "pass_through",
                        lambda self, *a: passed.append(1) or pass_through(self, *a))
    assert_greedy_parity(compiled_llm, [STORY_PROMPTS[2]], max_tokens=6)
    num_layers = compiled_llm.engine.runner.model.config.num_hidden_layers
    assert stacked and len(passed) == (num_layers - 1) * len(stacked)
    layer = compiled_llm.engine.runner.model.model.layers[1]
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out is args[0]))
    try:
        stacked.clear()
        assert_greedy_parity(compiled_llm, [STORY_PROMPTS[2]], max_tokens=6)
    finally:
        handle.remove()
    assert not stacked and seen and not any(seen)  # every step called layer 1 for real


def test_a_large_lm_head_gets_a_one_row_graph(compiled_llm, monkeypatch):
    """A head of at least ``COMPILED_HEAD_MIN_BYTES`` (SmolLM2's 56 MiB; lowered for ``compiled_llm``'s
    stories260K head) adds a warm-up graph: one-row logits (batch-1 decode, a lone prefill) go through it, more
    rows run the head eagerly, greedy tokens still equal transformers' and nothing recompiles."""
    compiled = compiled_llm.engine.runner.compiled
    before = compiled.stats.num_recompiles
    head, rows_seen = compiled._head, []
    monkeypatch.setattr(compiled, "_head", lambda rows: rows_seen.append(rows.shape[0]) or head(rows))
    assert_greedy_parity(compiled_llm, [STORY_PROMPTS[3]], max_tokens=12)
    assert rows_seen and set(rows_seen) == {1}
    rows_seen.clear()
    assert_greedy_parity(compiled_llm, STORY_PROMPTS[:3], max_tokens=4)  # 3 rows a step until one finishes: eager
    assert len(rows_seen) < 4
    assert compiled.stats.num_recompiles == before


def test_engines_keep_their_own_graphs(compiled_llm):
    """Graphs are dispatched without guards (``compile_regions.LayerGraphs``): a second compiled engine
    of the same model compiles graphs of its own (an entry per engine and layer kind), and both keep
    transformers parity and no recompiles when they alternate. The second engine's graphs run as dynamo traced
    them (``compile_backend=eager``: the dispatch is under test; inductor's code for ATen linears and the
    ``torch`` backend's opaque attention runs in ``test_mla.py``'s compiled test and ``test_freezing_parity``)."""
    other = LLM(model=STORIES, compile=True, compile_backend="eager", attention="torch", max_num_batched_tokens=24)
    assert type(other.engine.runner.model.model.layers[0].self_attn).__name__ == "FusedQKVLlamaAttention"  # prepacked
    assert other.engine.runner.compile_stats.num_graphs_warmup == 2  # its own prefill and batch-1 graphs
    before = compiled_llm.engine.runner.compile_stats.num_recompiles
    for llm in (other, compiled_llm, other):
        assert_greedy_parity(llm, STORY_PROMPTS[:3], max_tokens=8)
    assert other.engine.runner.compile_stats.num_recompiles == 0
    assert compiled_llm.engine.runner.compile_stats.num_recompiles == before
    # dynamo keeps every backend for the process's life (eval_frame.cached_backends): the engine's must not keep
    # its model and KV cache alive once the engine is dropped (compile_regions.WeakBackend)
    model = weakref.ref(other.engine.runner.model)
    del other, llm
    gc.collect()
    assert model() is None


def test_structured_output_adds_no_recompile(compiled_llm):
    """A grammar masks the logits after the compiled decoder: constrained requests beside free ones run
    the same graphs (no recompile) and every constrained output is one of its choices."""
    from framework.core.structured_output_params import StructuredOutputsParams

    before = compiled_llm.engine.runner.compile_stats.num_recompiles
    choices = ["Lily", "Tim", "the dog"]
    params = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)),
              SamplingParams(temperature=0.0, max_tokens=8)]
    outs = compiled_llm.generate(STORY_PROMPTS[:2], params)
    assert outs[0].outputs[0].text in choices and len(outs[1].outputs[0].token_ids) == 8
    assert compiled_llm.engine.runner.compile_stats.num_recompiles == before


def test_layer_entry_has_a_code_object_of_its_own():
    def forward(layer, x, servelab_layer=None):
        return layer(x) + servelab_layer

    first, second = layer_entry(forward, 0), layer_entry(forward, 0)
    assert first.__code__ is not second.__code__
    assert first(torch.nn.Identity(), 1.0, (torch.ones(2),), {}).tolist() == [2.0, 2.0]


def test_layers_with_equal_value_attributes_share_a_kind():
    """A frozen dataclass attribute (a tensor-parallel projection's ``Shard``) is compared by value,
    so the layers of a rank are one kind; any other object (a per-layer cache) splits kinds."""
    from framework.model_executor.parallel_layers import Shard

    def layer(shard, obj=None):
        m = torch.nn.Linear(4, 4)
        m.shard, m.state = shard, obj
        return m

    shared = object()
    equal = torch.nn.ModuleList([layer(Shard(0, 0, 2, 2), shared) for _ in range(3)])
    assert layer_kinds(equal, [None] * 3) == [0, 0, 0]
    other_shard = torch.nn.ModuleList([layer(Shard(0, 0, 2, 2)), layer(Shard(0, 2, 4, 2))])
    assert layer_kinds(other_shard, [None] * 2) == [0, 1]
    own_object = torch.nn.ModuleList([layer(Shard(0, 0, 2, 2), object()) for _ in range(2)])
    assert layer_kinds(own_object, [None] * 2) == [0, 1]


def test_torchao_quantized_layers_share_a_kind():
    """torchao's ``quantize_`` binds a ``functools.partial`` ``extra_repr`` to every linear it converts
    (``quant=w8a8``, ``fp8``): fingerprinted by its function, not its identity, so the layers stay one
    kind (they had been one kind each: 90 graphs for SmolLM2)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 64)) for _ in range(3)])
    quantize_(layers, Int8DynamicActivationInt8WeightConfig())
    assert "extra_repr" in vars(layers[0][0])  # what torchao does, or this test no longer tests it
    assert layer_kinds(layers, [None] * 3) == [0, 0, 0]


def test_fma_contraction_only_for_reduced_precision_graphs():
    """bf16/fp16 graphs (any such input: weights, KV cache) compile with FMA contraction; float32
    graphs keep inductor's default (off), which the token-for-token transformers parity relies on."""
    flag = "cpp.enable_floating_point_contract_flag"
    ids = torch.zeros(4, dtype=torch.long)
    assert inductor_config([ids, torch.zeros(2, 3)]) == {**INDUCTOR_CONFIG, "cpp.simdlen": cpu_simdlen()}  # CPU graph
    for dtype in (torch.bfloat16, torch.float16):
        config = inductor_config([ids, torch.zeros(2, 3), torch.zeros(3, dtype=dtype), 1.5])
        assert config[flag] == "fast" and INDUCTOR_CONFIG.items() <= config.items()
    assert flag not in INDUCTOR_CONFIG


@pytest.mark.slow
def test_freezing_parity():
    """``compile_freezing=True`` (weights as constants, prepacked for oneDNN on CPU) keeps parity.

    Freezing concerns the weights, not attention, so this runs the ``torch`` backend (attention as
    the opaque op, 2 graphs): with ``torch_paged``'s traced-attention graphs the test compiled for
    ~100 s; the default backend's graphs are compiled by the other tests of this module."""
    llm = LLM(model=STORIES, compile=True, compile_freezing=True, attention="torch", max_num_batched_tokens=24)
    assert_greedy_parity(llm, PREFIX_PROMPTS[:4] + STORY_PROMPTS[:8], max_tokens=16)
    stats = llm.engine.runner.compile_stats
    assert stats.active and stats.num_recompiles == 0
    assert_all_blocks_free(llm.engine)


def test_attention_op_contract(compiled_llm):
    """``servelab::attention`` passes ``torch.library.opcheck`` (schema, fake shapes, AOT dispatch)
    and equals the eager attention call, inside a real step's forward context."""
    runner = compiled_llm.engine.runner
    backend = runner.backend
    num_tokens = 5
    from framework.interfaces import CommonAttentionMetadata

    i32 = {"dtype": torch.int32}
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], **i32), seq_lens=torch.tensor([num_tokens], **i32),
        context_lens=torch.zeros(1, **i32), block_table=torch.tensor([[0]], **i32),
        slot_mapping=torch.arange(num_tokens), query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens], num_reqs=1,
        num_tokens=num_tokens, num_decodes=0, num_decode_tokens=0, max_query_len=num_tokens,
        max_seq_len=num_tokens, block_size=backend.block_size)
    q = torch.randn(1, backend.num_heads, num_tokens, backend.head_size)
    k = torch.randn(1, backend.num_kv_heads, num_tokens, backend.head_size)
    v = torch.randn(1, backend.num_kv_heads, num_tokens, backend.head_size)
    module = torch.nn.Module()
    module.layer_idx = 0
    with forward_context(ForwardContext(backend, backend.build_metadata(common), runner.kv_caches)):
        expected, _ = servelab_attention(module, q, k, v, None)
        out = attention_op(q, k, v, torch.tensor(0))
        torch.library.opcheck(attention_op, (q, k, v, torch.tensor(0)))
    assert out.shape == (1, num_tokens, backend.num_heads, backend.head_size) and out.is_contiguous()
    torch.testing.assert_close(out, expected)


def test_decode_steps_attend_inside_the_graph(compiled_llm, monkeypatch):
    """Default ``torch_paged``: an all-decode step's attention is traced into the compiled decoder
    (``traceable_forward``), so the backend's per-layer ``forward`` (the opaque op's body) runs for the
    prefill step only; the output still equals transformers and nothing recompiles."""
    runner = compiled_llm.engine.runner
    calls = []
    forward = runner.backend.forward
    monkeypatch.setattr(runner.backend, "forward", lambda *args: calls.append(args[0]) or forward(*args))
    before = runner.compile_stats.num_recompiles
    prompt = "Once upon a time"  # one prefill step (under the 16-token chunk threshold), then 6 decodes
    assert len(compiled_llm.get_tokenizer()(prompt).input_ids) < 16
    assert_greedy_parity(compiled_llm, [prompt], max_tokens=7)
    assert calls == list(range(len(runner.kv_caches))), "a decode step called the backend outside the graph"
    assert runner.compile_stats.num_recompiles == before


def test_recompile_is_counted(compiled_llm, monkeypatch, caplog):
    """The counter is live: a step no warm-up graph covers (a one-token step with attention outside the
    graph, which torch_paged never asks for) compiles a new graph, counted in
    ``compile_num_recompiles`` and logged. Runs last on the shared engine: the dummy forward
    overwrites blocks 0..1, which may hold cached prefixes."""
    runner = compiled_llm.engine.runner
    before = runner.compile_stats.num_recompiles
    monkeypatch.setattr(runner, "_graph_attention", lambda metadata: None)
    with caplog.at_level(logging.WARNING, logger="framework.compilation.decoder"):
        runner._dummy_forward(1)
    assert runner.compile_stats.num_recompiles == before + 1
    assert compiled_llm.engine.metrics.summary()["compile_num_recompiles"] == before + 1
    assert any("recompiling after the warm-up" in r.message for r in caplog.records)


def test_fallback_when_compiler_missing(caplog):
    """No C++ compiler for inductor: a warning names the cause and the engine runs eagerly, correctly."""
    with (torch._inductor.config.patch({"cpp.cxx": ("servelab-no-such-c++",)}),
          caplog.at_level(logging.WARNING, logger="framework.compilation.decoder")):
        llm = LLM(model=STORIES, compile=True, attention_params=EAGER_KERNEL_PARAMS)
    stats = llm.engine.runner.compile_stats
    assert not stats.active and "compiler unavailable" in stats.fallback_reason
    assert any("running the model eagerly" in r.message and "compiler unavailable" in r.message
               for r in caplog.records)
    assert_greedy_parity(llm, STORY_PROMPTS[:6], max_tokens=12)
    assert llm.engine.metrics.summary()["compile_active"] is False
    assert_all_blocks_free(llm.engine)


def test_fallback_when_compile_fails(monkeypatch, caplog):
    """An error while compiling the first graph (here: the inductor backend raises) falls back to eager."""
    def broken(self, gm, example_inputs):
        raise RuntimeError("simulated inductor failure")

    monkeypatch.setattr(CompiledDecoder, "_backend", broken)
    with caplog.at_level(logging.WARNING, logger="framework.compilation.decoder"):
        llm = LLM(model=STORIES, compile=True, attention_params=EAGER_KERNEL_PARAMS)
    stats = llm.engine.runner.compile_stats
    assert not stats.active and "simulated inductor failure" in stats.fallback_reason
    assert any("simulated inductor failure" in r.message for r in caplog.records)
    outs = assert_greedy_parity(llm, STORY_PROMPTS[:6], max_tokens=12)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert_all_blocks_free(llm.engine)


def test_compile_off_reports_only_the_decision(make_llm):
    llm = make_llm(compile=False, attention_params=EAGER_KERNEL_PARAMS)
    assert llm.engine.runner.compiled is None
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=2))
    summary = llm.engine.metrics.summary()
    assert "compile_s" not in summary and summary["compile_reason"] == "engine.compile=false: the decoder runs eagerly"


def test_hydra_engine_compile_knob():
    from hydra import compose, initialize_config_dir

    from framework.entrypoints.hydra_config import CONF_DIR, engine_config_from_cfg

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["engine.compile=true", "engine.compile_freezing=true"])
    config = engine_config_from_cfg(cfg)
    assert config.compile == "true" and config.compile_freezing is True
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        assert engine_config_from_cfg(compose("config")).compile == "auto"
        assert engine_config_from_cfg(compose("config", overrides=["engine.compile=false"])).compile == "false"
