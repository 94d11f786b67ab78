"""Quality probes for quant methods: a fixed held-out text every machine has, and perplexity on it."""

from __future__ import annotations

import math

import torch


def heldout_text(num_chars: int = 8000) -> str:
    """A fixed slice of Python's bundled documentation (``pydoc_data.topics``), no download needed.

    The topics are concatenated in sorted key order and cut to ``num_chars`` characters; the text
    depends only on the Python minor version (record it with the numbers).
    """
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))[:num_chars]


@torch.inference_mode()
def perplexity(model: torch.nn.Module, token_ids: list[int], window: int = 256) -> float:
    """exp(mean next-token NLL) of ``token_ids`` under ``model``, scored in disjoint ``window``-token chunks.

    Args:
        model: a transformers causal LM (any quantization applied), on CPU or GPU.
        token_ids: the tokenized text, at least 2 tokens.
        window: tokens per forward (each chunk is scored independently, no carried context).
    """
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = torch.tensor([token_ids[start:start + window]], device=device)
        if chunk.shape[1] < 2:
            break
        logits = model(input_ids=chunk).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)
