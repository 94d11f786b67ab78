"""Decode CUDA graphs (``framework/compilation/cuda_graphs.py``) on CPU: everything but the capture itself.

Bucket sizes and choice, the persistent buffers (same storage every step, one ``build_metadata`` per
bucket, padding rows in the padding block), when graphs are on/off and the refusal of configurations
that cannot be captured. End to end, an engine on the ``triton`` backend (Triton's interpreter on CPU)
with :class:`EagerReplayCapture` standing in for ``torch.cuda.CUDAGraph`` replays decode steps from
the buffers alone and gives transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from attention_harness import common_metadata
from helpers import STORIES

from framework import EngineConfig
from framework.compilation import cuda_graphs
from framework.compilation.cuda_graphs import (
    CUDAGraphOptions,
    DecodeCUDAGraphs,
    EagerReplayCapture,
    bucket_for,
    capture_sizes,
    cuda_graph_options,
)
from framework.engine.builder import validate_plugins
from plugins.attention import _triton_kernel
from plugins.attention.torch import TorchAttentionBackend
from plugins.attention.triton import TritonAttentionBackend


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 3 + 32
    big = capture_sizes(4096)
    assert big[-1] == 512 and 272 in big and 264 not in big
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_bucket_for():
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 4, 5, 9, 64)] == [1, 4, 4, 8, 16, 64]
    assert bucket_for(65, sizes) is None


def _backend(cls=TritonAttentionBackend, device="cpu"):
    return cls(4, 2, 8, 8 ** -0.5, 4, torch.float32, torch.device(device))


def test_options_off_unless_cuda_capturable_single_rank(monkeypatch):
    assert cuda_graph_options(None, _backend(), 8, 64) is None  # CPU: no capture primitive
    monkeypatch.setattr(cuda_graphs, "make_capture", lambda device: EagerReplayCapture())
    options = cuda_graph_options(None, _backend(), 8, 64)
    assert options is not None and options.sizes == [1, 2, 4, 8] and options.max_model_len == 64
    assert cuda_graph_options(True, _backend(), 8, 64) is None  # enforce_eager
    assert cuda_graph_options(None, _backend(TorchAttentionBackend), 8, 64) is None  # host-planned metadata
    assert cuda_graph_options(None, _backend(), 8, 64, world_size=2) is None
    assert cuda_graph_options(None, _backend(), 8, 64, num_kv_cache_groups=2) is None
    with pytest.raises(ValueError, match="KV cache groups"):  # insisted on: refused, not silently eager
        cuda_graph_options(False, _backend(), 8, 64, num_kv_cache_groups=2)


@pytest.mark.parametrize("attention, device, match", [("torch", "cpu", "cannot be captured"),
                                                      ("torch_paged", "cpu", "cannot be captured")])
def test_enforce_eager_false_refuses_what_cannot_be_captured(attention, device, match):
    with pytest.raises(ValueError, match=match) as e:
        validate_plugins(EngineConfig(model=STORIES, attention=attention, device=device, enforce_eager=False))
    assert "engine.enforce_eager" in str(e.value)


def test_enforce_eager_false_needs_cuda(monkeypatch):
    monkeypatch.setattr(TritonAttentionBackend, "requires_cuda", False)
    monkeypatch.setattr(TritonAttentionBackend, "supported_devices", ("cpu", "cuda"))
    with pytest.raises(ValueError, match="CUDA graphs need device=cuda"):
        validate_plugins(EngineConfig(model=STORIES, attention="triton", enforce_eager=False))
    problems = TritonAttentionBackend.validate(EngineConfig(model=STORIES, attention="triton", device="cuda",
                                                            enforce_eager=False, tensor_parallel_size=2))
    assert any("tensor parallelism" in p for p in problems)


class _RecordingBackend(TorchAttentionBackend):
    """Counts ``build_metadata`` calls; its metadata is the common object itself."""

    supports_cuda_graphs = True
    builds = 0

    def build_metadata(self, common):
        type(self).builds += 1
        return common


def test_buffers_are_reused_and_padded():
    """A step copies into the same storage, pads to its bucket in the padding block, and replays the
    bucket's forward, which reads the buffers through the metadata built once at capture."""
    backend = _RecordingBackend(4, 2, 8, 8 ** -0.5, 4, torch.float32, torch.device("cpu"))
    seen = []

    def forward(ids, positions, common):  # (1, B) -> (B, 3) "logits" from the buffers alone
        seen.append((ids.data_ptr(), common.seq_lens.data_ptr(), common.block_table.data_ptr()))
        return torch.stack([ids[0].float(), positions[0].float(), common.seq_lens.float()], 1)

    capture = EagerReplayCapture()
    graphs = DecodeCUDAGraphs(CUDAGraphOptions([1, 2, 4, 8], capture, max_model_len=32), backend, forward,
                              pad_block=9, device=torch.device("cpu"))
    graphs.capture()
    assert _RecordingBackend.builds == 4 and len(capture.captured) == 4 and sorted(graphs.graphs) == [1, 2, 4, 8]
    pointers = set(seen)
    step = common_metadata([(5, 1), (9, 1), (2, 1)], [[3, 1], [0, 4, 7], [2]], [5, 28, 10], 4, torch.device("cpu"))
    assert graphs.bucket(step) == 4
    logits = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([5, 9, 2]), step)
    assert logits.tolist() == [[11, 5, 6], [12, 9, 10], [13, 2, 3]]
    assert capture.replays == 1 and _RecordingBackend.builds == 4 and set(seen) == pointers  # no new build or buffer
    assert graphs.slot_mapping[:4].tolist() == [5, 28, 10, 9 * 4]  # the padding row writes the padding block
    assert graphs.block_table[3, 0] == 9 and graphs.seq_lens[:4].tolist() == [6, 10, 3, 1]
    assert graphs.block_table[:3, :3].tolist() == [[3, 1, 0], [0, 4, 7], [2, 0, 0]]
    two = common_metadata([(7, 1), (1, 1)], [[6, 8], [5]], [31, 21], 4, torch.device("cpu"))
    assert graphs.run(torch.tensor([1, 2]), torch.tensor([7, 1]), two).tolist() == [[1, 7, 8], [2, 1, 2]]
    assert graphs.seq_lens[2:4].tolist() == [3, 1]  # rows of the bigger bucket are left as they were
    prefill = common_metadata([(0, 3)], [[1]], [4, 5, 6], 4, torch.device("cpu"))
    wide = common_metadata([(40, 1)], [list(range(11))], [4], 4, torch.device("cpu"))
    assert graphs.bucket(prefill) is None and graphs.bucket(wide) is None  # not all decodes; table too wide
    nine = common_metadata([(0, 1)] * 9, [[i] for i in range(9)], list(range(9)), 4, torch.device("cpu"))
    assert graphs.bucket(nine) is None


@pytest.mark.skipif(not _triton_kernel.interpreter_active(), reason="needs Triton's interpreter on CPU")
def test_engine_replays_decodes_with_the_same_tokens(monkeypatch):
    """The whole path in an engine: capture at start-up, decode steps of 3, 2 then 1 requests padded to
    buckets 4/2/1 and replayed from the buffers; greedy tokens equal transformers' (so the eager path's:
    ``tests/plugins/attention/test_triton.py``). ~15 s: every layer's attention runs in Triton's interpreter."""
    from helpers import hf_greedy

    from framework import LLM, SamplingParams

    monkeypatch.setattr(TritonAttentionBackend, "requires_cuda", False)
    monkeypatch.setattr(TritonAttentionBackend, "supported_devices", ("cpu", "cuda"))
    capture = EagerReplayCapture()
    monkeypatch.setattr(cuda_graphs, "make_capture", lambda device: capture)
    prompts = [[1, 403, 407, 261, 378], [1, 300, 301, 302], [1, 50, 60]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 2, 4)]
    llm = LLM(model=STORIES, attention="triton", block_size=4, max_num_seqs=4, max_model_len=64, grammar="none")
    graphs = llm.engine.runner.cuda_graphs
    assert sorted(graphs.graphs) == [1, 2, 4] and len(capture.captured) == 3
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert capture.replays == 5  # decode steps: 3 requests x1, 2 x2, 1 x2 (the first token comes from the prefill)
    assert out == [ref[:p.max_tokens] for ref, p in zip(hf_greedy(STORIES, prompts, 6), params)]
    assert LLM(model=STORIES, attention="triton", enforce_eager=True, grammar="none").engine.runner.cuda_graphs is None
