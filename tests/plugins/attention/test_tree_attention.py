"""Tree attention (token-tree speculative decoding, ``framework/core/spec_tree.py``): in one verify step the logits of
every draft-tree node equal a separate transformers forward over that node's root-to-node path (float32, within
1e-5), for the ``torch`` reference and ``torch_paged`` (its reference split, its in-place decodes and its
``paged_prefill`` ablation), with several requests whose trees differ in size and a plain decode in the same batch;
a backend without tree attention is refused before weights load, naming the fix."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES

from framework import LLM
from framework.core.outputs import SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.spec_tree import ancestor_mask
from framework.model_executor.forward_context import forward_context

PROMPTS = [[1, 403, 407, 261, 378, 353, 306], [1, 375, 289, 302, 421, 261, 383, 311, 259, 344, 270, 436, 401],
           [1, 440, 268, 302]]
# per request: (tokens, parents) of its tree; None: a plain decode of the last prompt token
TREES = [([290, 291, 292, 293, 294, 295], [-1, -1, 0, 0, 1, 2]),
         None,
         ([300, 301, 302], [-1, 0, -1])]
BACKENDS = [("torch", {}), ("torch_paged", {"compile": False}),
            ("torch_paged", {"compile": False, "min_paged_decodes": 1}),
            ("torch_paged", {"compile": False, "paged_prefill": True})]


def _step(runner, requests, counts, spec, parents):
    """One forward of ``counts[rid]`` tokens per request; every row's logits, ``(num_tokens, vocab)``."""
    so = SchedulerOutput(scheduled_requests=requests, num_scheduled_tokens=counts,
                         total_num_scheduled_tokens=sum(counts.values()),
                         block_ids={r.request_id: ([10 * i + b for b in range(10)],) for i, r in enumerate(requests)},
                         scheduled_spec_decode_tokens=spec, scheduled_spec_decode_parents=parents)
    batch = runner.prepare_inputs(so)
    metadata = [runner.backend.build_metadata(c) for c in batch.group_commons]
    every_row = torch.arange(batch.input_ids.shape[1])
    with torch.inference_mode(), forward_context(runner._forward_context(metadata)):
        logits, _ = runner._forward(batch.input_ids, batch.positions, every_row, metadata)
    return batch, logits


def _paths(tokens, parents):
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[node]])
    return paths


@pytest.mark.parametrize(("attention", "params"), BACKENDS)
def test_every_node_equals_a_plain_forward_over_its_path(attention, params):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=STORIES, dtype="float32", attention=attention, attention_params=params, num_blocks=64,
              grammar="none")
    runner = llm.engine.runner
    requests = [Request(request_id=str(i), prompt_token_ids=p, sampling_params=SamplingParams(temperature=0.0))
                for i, p in enumerate(PROMPTS)]
    # step 1: every prompt but its last token (a plain prefill); step 2: the last token + its tree (or a decode)
    _step(runner, requests, {r.request_id: r.num_tokens - 1 for r in requests}, {}, {})
    for r in requests:
        r.num_computed_tokens = r.num_tokens - 1
    spec = {str(i): t[0] for i, t in enumerate(TREES) if t}
    parents = {str(i): t[1] for i, t in enumerate(TREES) if t}
    batch, logits = _step(runner, requests, {str(i): 1 + len(t[0]) if t else 1 for i, t in enumerate(TREES)},
                          spec, parents)
    hf = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32, attn_implementation="eager").eval()
    qsl = batch.query_start_loc_cpu
    for i, request in enumerate(batch.requests):
        tree = TREES[int(request.request_id)]
        paths = [[]] + (_paths(*tree) if tree else [])
        for row, path in enumerate(paths):
            with torch.inference_mode():
                expected = hf(torch.tensor([request.prompt_token_ids + path])).logits[0, -1]
            got = logits[qsl[i] + row]
            # float32 sums reorder between kernels: 1e-5 holds on AVX-512/AMX, AVX2 kernels reach 1.5e-5 on one logit
            torch.testing.assert_close(got, expected, atol=3e-5, rtol=1e-4,
                                       msg=lambda m, i=i, row=row: f"{attention} {params}: request {i} node {row - 1}: {m}")


def test_ancestor_mask_rule():
    mask = ancestor_mask([-1, -1, 0, 1], num_real=2)  # real tokens r0, r1 (root); nodes 0..3
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                             [1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]


@pytest.mark.parametrize("attention", ["xformers", "hybrid"])
def test_backend_without_tree_attention_refused(attention):
    from framework.config import EngineConfig
    from framework.engine.spec_tree_support import tree_problems

    config = EngineConfig(model=STORIES, attention=attention, drafter="medusa",
                          drafter_params={"model": "models/stories260K-medusa", "tree": [[0], [1]]})
    problems = tree_problems(config)
    assert problems and "attention=torch_paged" in problems[0] and f"attention={attention}" in problems[0]
