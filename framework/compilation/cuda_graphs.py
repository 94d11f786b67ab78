"""Decode CUDA graphs: capture each decode batch-size bucket once, then pad each decode step to its
bucket and replay (vLLM's ``CUDAGraphRunner`` / full decode graphs; SGLang's ``CudaGraphRunner``).

A decode step of a small model is dominated by kernel launches (hundreds per step, microseconds each)
rather than by the kernels. A CUDA graph records the whole forward's launches once and replays them
with one call; what changes between steps must then live at fixed addresses. So:

- **Persistent input buffers** (:class:`DecodeCUDAGraphs`): ``input_ids``, ``positions`` and the
  attention metadata (``query_start_loc``, ``seq_lens``, ``context_lens``, ``block_table``,
  ``slot_mapping``) of the largest bucket. Each bucket's graph was captured on views of their first
  rows; a step copies its values into them and replays.
- **Buckets** (:func:`capture_sizes`): 1, 2, 4, then every multiple of 8 to 256, then of 16, up to
  ``max_num_seqs`` (and at most :data:`MAX_CAPTURE_SIZE`). A step of ``n`` decodes runs the
  smallest bucket ``>= n``; rows ``n..bucket`` are padding: token 0 at position 0, one key, their
  K/V written into a **padding block** of their own (one block past the pool and the null block, so
  no request's KV is touched) and their logits dropped.
- **The backend** declares ``supports_cuda_graphs``: its ``build_metadata`` for an all-decode step
  keeps only views of the runner's device tensors (host values such as ``seq_lens_cpu`` and
  ``max_seq_len`` are the capture's upper bounds, never a step's) and its kernels' launch shapes
  depend on tensor shapes only (``triton``, ``flash_attn``). Host-planned backends (``torch``,
  ``torch_paged``, ``flashinfer``'s per-step ``plan``, ``xformers``) are not captured.
- **Capture** is a :data:`GraphCapture`: :class:`TorchCUDAGraphCapture` on a GPU;
  :class:`EagerReplayCapture` (runs the callable again at each replay) lets the CPU tests run this
  whole path, buffers and padding included, without a GPU.

``engine.enforce_eager`` (vLLM's name): ``true`` never captures; ``null`` (default) captures where it
can (CUDA device, a capturable backend, one rank, one KV cache group) and logs why not otherwise;
``false`` insists, and ``AttentionBackend.validate`` refuses a configuration that cannot be captured
before weights load. The compiled decoder (``engine.compile``) takes precedence: while it is active,
steps run it instead of the graphs. Steps other than pure decodes (prefill chunks, speculative
verification, prompt logprobs, hidden states for a drafter) always run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from framework.interfaces import AttentionBackend, CommonAttentionMetadata

logger = logging.getLogger(__name__)

#: Largest decode batch captured (vLLM's default ``max_cudagraph_capture_size``); larger steps run eagerly.
MAX_CAPTURE_SIZE = 512

#: Captures a callable and returns its replay: ``capture(fn) -> replay``; ``replay()`` returns what
#: ``fn`` returned, recomputed from the current contents of the tensors ``fn`` read.
GraphCapture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, multiples of 8 to 256, multiples of 16 beyond, up to
    ``min(max_num_seqs, max_size)`` (which is always the last).

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, max_size)
    sizes = [s for s in [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)] if s < top]
    return [*sizes, top]


def bucket_for(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size ``>= num_reqs`` (ascending ``sizes``), or ``None`` when it exceeds them all."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class TorchCUDAGraphCapture:
    """:data:`GraphCapture` with ``torch.cuda.CUDAGraph``: one warm-up call on a side stream (lazy
    initialisation, Triton compilation, cuBLAS workspaces happen outside the capture), then the
    capture; every graph shares one memory pool (capture the largest bucket first so the others
    fit in its memory)."""

    def __init__(self) -> None:
        self.pool: Any = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture ``fn``; the replay returns the captured output tensor, refilled by each replay."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerReplayCapture:
    """:data:`GraphCapture` that runs ``fn`` once at capture and again at each replay, counting both:
    the bookkeeping of :class:`DecodeCUDAGraphs` (buffers, padding, buckets, the backend's metadata
    built once per bucket) without a GPU. Like a CUDA graph, a replay sees only what is in the tensors
    ``fn`` closed over at capture."""

    def __init__(self) -> None:
        self.captured: list[Callable[[], torch.Tensor]] = []
        self.replays = 0

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record ``fn`` (after one call, as a capture runs it) and return its counting replay."""
        fn()
        self.captured.append(fn)

        def replay() -> torch.Tensor:
            self.replays += 1
            return fn()

        return replay


@dataclass
class CUDAGraphOptions:
    """What :class:`DecodeCUDAGraphs` captures and how (built by :func:`cuda_graph_options`)."""

    sizes: list[int]  # ascending decode batch sizes to capture (capture_sizes)
    capture: GraphCapture  # TorchCUDAGraphCapture on a GPU
    max_model_len: int  # tokens; the block-table width of the persistent buffers


def make_capture(device: torch.device) -> GraphCapture | None:
    """The capture primitive of ``device``: :class:`TorchCUDAGraphCapture` on CUDA, else ``None``."""
    return TorchCUDAGraphCapture() if device.type == "cuda" else None


def cuda_graph_options(enforce_eager: bool | None, backend: AttentionBackend, max_num_seqs: int, max_model_len: int,
                       world_size: int = 1, num_kv_cache_groups: int = 1) -> CUDAGraphOptions | None:
    """Whether this worker captures decode CUDA graphs (see the module docstring), and with what.

    Returns:
        The options, or ``None`` (eager decodes; logged with the reason unless ``enforce_eager``).

    Raises:
        ValueError: ``enforce_eager is False`` (graphs insisted on) and they cannot be captured here (what
            ``AttentionBackend.validate`` cannot see before loading, e.g. several KV cache groups).
    """
    if enforce_eager:
        return None
    capture = make_capture(backend.device)
    reasons = [why for off, why in (
        (capture is None, f"device {backend.device} is not CUDA"),
        (not backend.supports_cuda_graphs, f"attention {backend.name!r} cannot be captured (supports_cuda_graphs)"),
        (world_size > 1, "tensor parallelism (tensor_parallel_size > 1)"),
        (num_kv_cache_groups > 1, "several KV cache groups (sliding-window layers with their own block tables)"),
    ) if off]
    if reasons and enforce_eager is False:
        raise ValueError(f"engine.enforce_eager=false asks for decode CUDA graphs, which cannot be captured here: "
                         f"{'; '.join(reasons)}; set engine.enforce_eager=null (capture where possible) or true")
    if reasons:
        logger.log(logging.INFO if capture is not None else logging.DEBUG,
                   "decode CUDA graphs off: %s", "; ".join(reasons))
        return None
    return CUDAGraphOptions(capture_sizes(max_num_seqs), capture, max_model_len)


class DecodeCUDAGraphs:
    """Persistent decode inputs and one captured forward per bucket (see the module docstring).

    Args:
        options: sizes, capture primitive, ``max_model_len``.
        backend: the attention backend (``supports_cuda_graphs``).
        forward: ``forward(input_ids (1, B) int64, positions (1, B) int64, metadata) -> (B, vocab)``
            logits: the model runner's eager forward inside its forward context.
        pad_block: a KV block id no request uses (the runner allocates it for the padding rows).
        device: of the model and the buffers.
    """

    def __init__(self, options: CUDAGraphOptions, backend: AttentionBackend,
                 forward: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor], pad_block: int,
                 device: torch.device) -> None:
        self.sizes = list(options.sizes)
        self.capture_fn = options.capture
        self.backend = backend
        self.forward = forward
        self.block_size = backend.block_size
        self.max_model_len = options.max_model_len
        self.pad_block = pad_block
        n, width = self.sizes[-1], -(-options.max_model_len // backend.block_size)
        i32 = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # (n,)
        self.query_start_loc = torch.arange(n + 1, **i32)  # (n + 1,) one token per row, never changes
        self.seq_lens = torch.ones(n, **i32)  # (n,)
        self.context_lens = torch.zeros(n, **i32)  # (n,)
        self.block_table = torch.full((n, width), pad_block, **i32)  # (n, max blocks per request)
        self.slot_mapping = torch.full((n,), pad_block * self.block_size, dtype=torch.long, device=device)  # (n,)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def common(self, size: int) -> CommonAttentionMetadata:
        """The metadata of a ``size``-row decode step over views of the persistent buffers; its host values
        are upper bounds (every row may be as long as ``max_model_len``), the same for every step."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size], block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size], query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size,
            num_reqs=size, num_tokens=size, num_decodes=size, num_decode_tokens=size, max_query_len=1,
            max_seq_len=self.max_model_len, block_size=self.block_size)

    def capture(self) -> None:
        """Capture every bucket, largest first, on padding rows only (their K/V go to the padding block):
        call before any request runs or while none is in the batch."""
        for size in reversed(self.sizes):
            self._pad(0, size)
            metadata = self.backend.build_metadata(self.common(size))
            ids, positions = self.input_ids[:size][None], self.positions[:size][None]
            self.graphs[size] = self.capture_fn(lambda ids=ids, positions=positions, metadata=metadata:
                                                self.forward(ids, positions, metadata))
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def bucket(self, common: CommonAttentionMetadata) -> int | None:
        """The bucket a step runs in, or ``None`` when it must run eagerly: not every token a decode, more
        decodes than the largest bucket, or a block table wider than the buffers."""
        if common.num_tokens != common.num_reqs or common.block_table.shape[1] > self.block_table.shape[1]:
            return None
        return bucket_for(common.num_reqs, self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata) -> torch.Tensor:
        """Copy one decode step into the buffers, pad it to its bucket and replay that bucket's graph.

        Args:
            input_ids, positions: ``(num_reqs,)`` int64, one token per request.
            common: the step's metadata (``bucket(common)`` is not ``None``).

        Returns:
            ``(num_reqs, vocab)`` logits (a view of the graph's output: use before the next replay).
        """
        n, size = common.num_reqs, self.bucket(common)
        width = common.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(common.seq_lens)
        self.context_lens[:n].copy_(common.context_lens)
        self.block_table[:n, :width].copy_(common.block_table)  # columns past a row's blocks are never read
        self.slot_mapping[:n].copy_(common.slot_mapping)
        self._pad(n, size)
        return self.graphs[size]()[:n]

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start..stop`` become padding: token 0 at position 0, one key, in the padding block."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.seq_lens[start:stop] = 1
        self.context_lens[start:stop] = 0
        self.block_table[start:stop, 0] = self.pad_block
        self.slot_mapping[start:stop] = self.pad_block * self.block_size
