"""A pre-quantized checkpoint combined with other engine features (stories260K, GPTQ 4-bit act-order, float32
greedy against transformers running the dequantized weights):

- KV-cache quantization (``engine.kv_cache_dtype``): with int8 K/V each token's oracle logit (given the engine's
  own prefix) is within ``INT8_KV_REL_TOL`` of the oracle's maximum — a near tie may flip, as the W8A8 input
  rounding of ``test_checkpoints.py`` may; fp8 e4m3 runs (its first divergence and largest gap printed);
- ``engine.compile=true`` on the fast path: the int4 kernel traced into the decoder graph, each token within
  ``FAST_REL_TOL`` of the oracle's maximum logit (as ``test_checkpoints.py``).
Tensor parallelism: ``test_checkpoint_tp.py``; LoRA: ``tests/framework/lora/test_lora_quant.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import REPO, STORIES

from framework.core.sampling_params import SamplingParams

_spec = importlib.util.spec_from_file_location("quantize_checkpoint", REPO / "scripts" / "quantize_checkpoint.py")
qc_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qc_script)
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park and"]
MAX_NEW = 24
FAST_REL_TOL = 1e-3  # as test_checkpoints.FAST_REL_TOL
#: int8 K/V rounding (per token-head absmax, test_kv_quant.TOLERANCE) moves logits by a fraction of a percent of
#: max|logit|; the tolerance of test_checkpoints.INPUT_QUANT_REL_TOL for inputs quantized to int8
INT8_KV_REL_TOL = 2e-2


@pytest.fixture(scope="module")
def gptq(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(checkpoint folder, transformers stories260K in float32 with the dequantized weights)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("gptq_combo") / "ckpt"
    dequantized = qc_script.quantize_checkpoint(STORIES, folder, "gptq", bits=4, group_size=32, desc_act=True,
                                                sym=False)
    oracle = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    assert not oracle.load_state_dict({f"{k}.weight": v for k, v in dequantized.items()}, strict=False).unexpected_keys
    return str(folder), oracle


def _generate(llm) -> tuple[list[list[int]], list[list[int]]]:
    tok = llm.engine.tokenizer
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    return prompt_ids, [list(o.outputs[0].token_ids) for o in outs]


def _oracle_greedy(oracle: torch.nn.Module, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        seq = oracle.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return seq[0, len(ids):].tolist()


def _relative_gaps(oracle: torch.nn.Module, ids: list[int], out: list[int]) -> torch.Tensor:
    """Per generated token: (oracle's max logit - the token's) / max|logit|, given the engine's prefix."""
    with torch.inference_mode():
        logits = oracle(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
    gap = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    return gap / logits.abs().max(-1).values


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_with_a_checkpoint(make_llm, gptq, kv_cache_dtype: str) -> None:
    folder, oracle = gptq
    llm = make_llm(model=folder, dtype="float32", quant_params={"kernel": "reference"}, num_blocks=64,
                   kv_cache_dtype=kv_cache_dtype)
    prompt_ids, outputs = _generate(llm)
    first_div, worst = [], 0.0
    for ids, out in zip(prompt_ids, outputs):
        ref = _oracle_greedy(oracle, ids)
        first_div.append(next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref)))
        worst = max(worst, float(_relative_gaps(oracle, ids, out).max()))
    print(f"gptq checkpoint, kv_cache_dtype={kv_cache_dtype}: first divergence per prompt {first_div} of {MAX_NEW}, "
          f"largest logit gap {worst:.2e} of max|logit|")
    if kv_cache_dtype == "int8":
        assert worst <= INT8_KV_REL_TOL, (first_div, worst)


def test_compiled_fast_path_with_a_checkpoint(make_llm, gptq) -> None:
    folder, oracle = gptq
    llm = make_llm(model=folder, dtype="float32", num_blocks=64, compile="true")
    prompt_ids, outputs = _generate(llm)
    for ids, out in zip(prompt_ids, outputs):
        gaps = _relative_gaps(oracle, ids, out)
        assert bool((gaps <= FAST_REL_TOL).all()), gaps.max()
