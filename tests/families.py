"""Tiny random-weight models of every family servelab runs (``framework/model_executor/model_families.py``),
for tests of any module (imported as ``families``; ``tests/`` is on pytest's pythonpath).

:func:`tiny_model_dir` builds a family's model once per process from its transformers config class
(fixed seed, float32), saves it with ``save_pretrained`` (plus the stories260K tokenizer, whose 512
ids are the vocabulary) into a temporary folder removed at exit, and returns the folder: engines
load it through the normal path. Dimensions exercise every quirk of the family: a sliding window of
:data:`WINDOW` tokens (smaller than the test contexts, not a multiple of the tests' block size 4),
mixed ``layer_types``, a softcap small enough to bend the scores, sinks re-drawn with std 1, MoE with
4 experts (2 per token), non-zero biases, and projections scaled up so that attention is peaked and
greedy decoding has clear margins (random models at transformers' default init are nearly uniform).

:func:`hf_reference` is the oracle: transformers' own ``generate`` with eager attention, greedy,
with each step's log-probabilities.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import STORIES

WINDOW = 7  # sliding window of the tiny models, tokens
SEED = 1234
LOGIT_STD = 4.0  # spread of the tiny models' logits (before Gemma's final softcap)
FIRST_TEXT_ID = 259  # stories260K: ids below are <unk>, <s>, </s> and the 256 byte-fallback tokens
QK_GAIN = 4.0  # attention projections' scale over transformers' init
EMBED_STD = 0.25  # input embeddings: above the biases, below what attention adds
COMMON_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=512, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2)


def _configs() -> dict[str, Callable[[], Any]]:
    """Family test id -> a function building its tiny transformers config (imports transformers lazily)."""
    import transformers as t

    c = COMMON_TINY
    return {
        "llama": lambda: t.LlamaConfig(**c),
        "smollm3": lambda: t.SmolLM3Config(**c, use_sliding_window=True, sliding_window=WINDOW,
                                           no_rope_layers=[1, 0, 1]),  # layer 1: NoPE and windowed
        "qwen2": lambda: t.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "qwen3": lambda: t.Qwen3Config(**c, head_dim=24),  # head_dim != hidden / heads
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**c, **_MOE, moe_intermediate_size=32, use_sliding_window=True,
                                              sliding_window=WINDOW),
        "mistral": lambda: t.MistralConfig(**c, head_dim=16, sliding_window=WINDOW),
        "ministral": lambda: t.MinistralConfig(**c, head_dim=16, sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "mixtral": lambda: t.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
        "gemma2": lambda: t.Gemma2Config(**c, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                         attn_logit_softcapping=1.0, final_logit_softcapping=8.0),
        "gemma3": lambda: t.Gemma3TextConfig(**c, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "phi3": lambda: t.Phi3Config(**c, sliding_window=WINDOW),
        "olmo2": lambda: t.Olmo2Config(**c),
        "olmoe": lambda: t.OlmoeConfig(**c, **_MOE, clip_qkv=1.0),
        "gpt_oss": lambda: t.GptOssConfig(**{**c, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                                          head_dim=16, sliding_window=WINDOW,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                          rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                           "original_max_position_embeddings": 128}),
        "gpt2": lambda: t.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=256, vocab_size=512, bos_token_id=1,
                                     eos_token_id=2, scale_attn_by_inverse_layer_idx=True, tie_word_embeddings=False),
        "gpt_neox": lambda: t.GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                            num_attention_heads=4, vocab_size=512, max_position_embeddings=256,
                                            bos_token_id=1, eos_token_id=2, rotary_pct=0.25,
                                            use_parallel_residual=True, tie_word_embeddings=False),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12,  # key head size 24, value head size 12
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # not in FAMILY_IDS (DeepseekV3ForCausalLM is the family's row); the MLA tests' V2: no q LoRA (q_proj),
        # complex-number RoPE, greedy expert routing
        "deepseek_v2": lambda: t.DeepseekV2Config(
            **{**c, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    }


FAMILY_IDS: tuple[str, ...] = (
    "llama", "smollm3", "qwen2", "qwen3", "qwen3_moe", "mistral", "ministral", "mixtral", "gemma2", "gemma3",
    "phi3", "olmo2", "olmoe", "gpt_oss", "gpt2", "gpt_neox", "deepseek_v3")
_ROOT: list[Path] = []
_DIRS: dict[str, Path] = {}


def tiny_config(family: str) -> Any:
    """The family's tiny transformers config (fresh object).

    Raises:
        KeyError: unknown family id (see :data:`FAMILY_IDS`).
    """
    config = _configs()[family]()
    config.dtype = "float32"
    return config


def sharpen(model: Any) -> None:
    """Re-draw the weights that make a random model's quirks visible: attention projections scaled so
    scores reach a few units (softcap, window and sinks change the argmax), biases non-zero, sinks
    with std 1, and an LM head giving logits of std :data:`LOGIT_STD` (clear greedy margins; the rows of
    EOS, the special and the byte-fallback ids zeroed, so that generations run their full length
    and detokenize)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "sinks":
                param.normal_(0.0, 1.0)
            elif leaf.endswith("bias") and param.dim() == 1 and "norm" not in name and "ln" not in name:
                param.normal_(0.0, 0.02)
            elif any(p in name for p in ("q_proj", "k_proj", "qkv_proj", "c_attn", "query_key_value", "q_b_proj",
                                         "kv_b_proj", "q_a_proj", "kv_a_proj")) and param.dim() == 2:
                param.mul_(QK_GAIN)
        model.get_input_embeddings().weight.normal_(0.0, EMBED_STD)  # tokens, not biases, dominate the residual
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 1.0)
        hidden = model.get_decoder()(input_ids=torch.arange(3, 23)[None]).last_hidden_state
        head.mul_(LOGIT_STD / (hidden @ head.T).std().item())  # before any final softcap
        head[:FIRST_TEXT_ID] = 0.0  # EOS, specials and byte tokens never win: full-length, decodable outputs


def tiny_model_dir(family: str) -> Path:
    """Folder of the family's tiny model (``config.json``, ``model.safetensors``, tokenizer), built once per
    process (seed :data:`SEED`, float32) and removed at exit.

    Raises:
        KeyError: unknown family id (see :data:`FAMILY_IDS`).
    """
    if family in _DIRS:
        return _DIRS[family]
    import torch
    from transformers import AutoModelForCausalLM

    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="servelab-tiny-families-")))
        atexit.register(shutil.rmtree, _ROOT[0], ignore_errors=True)
    config = tiny_config(family)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sharpen(model)
    folder = _ROOT[0] / family
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(STORIES) / name, folder / name)
    _DIRS[family] = folder
    return folder


def prompts(num: int = 4, shared: int = 12, seed: int = 0) -> list[list[int]]:
    """``num`` token-id prompts of 20-29 tokens sharing their first ``shared`` tokens (prefix-cache hits)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(FIRST_TEXT_ID, 512) for _ in range(shared)]
    return [prefix + [rng.randrange(FIRST_TEXT_ID, 512) for _ in range(20 + (i * 3) % 10 - shared)]
            for i in range(num)]


_REFERENCE: dict[tuple, tuple[list[int], list[list[float]]]] = {}


def hf_reference(family: str, prompt_ids: list[list[int]], max_new_tokens: int,
                 attn_implementation: str = "eager") -> list[tuple[list[int], list[list[float]]]]:
    """transformers' greedy ``generate`` of each prompt (one at a time, no padding): the new token ids
    and, per step, the log-probabilities of the whole vocabulary (as a list of floats). Memoized."""
    import torch
    from transformers import AutoModelForCausalLM

    model = None
    out = []
    for ids in prompt_ids:
        key = (family, tuple(ids), max_new_tokens, attn_implementation)
        if key not in _REFERENCE:
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32,
                                                             attn_implementation=attn_implementation).eval()
            with torch.inference_mode():
                res = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            logprobs = [step[0].float().log_softmax(-1).tolist() for step in res.logits]
            _REFERENCE[key] = (res.sequences[0, len(ids):].tolist(), logprobs)
        out.append(_REFERENCE[key])
    return out


MAX_TOKENS = 24  # new tokens per prompt in the parity runs
#: Engine of the parity runs: 4-token blocks (prefix hits on the 12 shared tokens; the window of 7 is not a
#: multiple), a 16-token step budget (prompts of 20-29 tokens are chunked) and 30 blocks for 4 requests of up
#: to 53 tokens (preemption).
ENGINE = dict(block_size=4, max_num_batched_tokens=16, num_blocks=30, max_model_len=64, max_num_seqs=4,
              enable_prefix_caching=True, dtype="float32")


def engine_for(family: str) -> dict[str, Any]:
    """``ENGINE`` for the family's tiny model under ``kv_cache=paged``. A model with sliding-window layers
    keeps them in KV cache groups of their own whose out-of-window blocks are released, and a block then
    holds the layers of one group (``framework/core/kv_cache_groups.py``): its requests hold far fewer
    KV bytes, so 30 blocks would not force preemption (Mistral) or would not hold one request (SmolLM3's
    two full groups). It gets 1.25x the blocks one ``max_model_len`` request holds at most instead."""
    from framework.core.kv_cache_groups import KVCacheLayout, make_kv_cache_groups
    from framework.model_executor.model_families import attention_layers

    layers = attention_layers(tiny_config(family))
    layout = KVCacheLayout(make_kv_cache_groups(layers, release_sliding_blocks=True), len(layers))
    if not layout.has_null_block:
        return dict(ENGINE)
    need = layout.max_blocks_per_request(ENGINE["max_model_len"], ENGINE["block_size"],
                                         ENGINE["max_num_batched_tokens"])
    return {**ENGINE, "num_blocks": -(-5 * need // 4)}


def run_family(make_llm: Any, family: str, **overrides: Any) -> tuple[Any, list]:
    """The family's tiny model under :func:`engine_for` (+ ``overrides``, through conftest's ``make_llm``, which
    checks every KV block is freed): the LLM and its greedy outputs (with logprobs) for :func:`prompts`."""
    from framework import SamplingParams

    llm = make_llm(model=str(tiny_model_dir(family)), **{**engine_for(family), **overrides})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5))
    return llm, outs


def assert_matches_transformers(family: str, outs: list, what: str) -> None:
    """Greedy tokens equal transformers' and each step's top-5 log-probabilities are within 1e-4 of its."""
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, hf_reference(family, prompts(), MAX_TOKENS))):
        assert out.outputs[0].token_ids == tokens, f"{family} ({what}): prompt {i} diverged from transformers"
        for step, top in enumerate(out.outputs[0].logprobs):
            for token, value in top.items():
                assert abs(value - logprobs[step][token]) < 1e-4, \
                    f"{family} ({what}): prompt {i} step {step} logprob of {token} {value} != {logprobs[step][token]}"


