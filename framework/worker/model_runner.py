"""Model runner: turns a ``SchedulerOutput`` into one flattened forward and sampled tokens.

The whole step is one "super sequence": ``input_ids``/``position_ids`` of shape
``(1, num_tokens)`` fed to an unmodified transformers model whose attention layers call the
selected backend (``framework.model_executor.forward_context``). Only the logits of positions that sample are
computed (``logits_to_keep``), plus, for requests that ask for prompt logprobs, the positions of
their prompt (``framework.sample.prompt_logprobs``). Once compiled (``compile=True`` in ``__init__``, or later through
:meth:`ModelRunner.compile_decoder`) the decoder runs through
``framework.compilation.decoder.CompiledDecoder`` (``torch.compile``, warmed up when compiled).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from framework.compilation.cuda_graphs import CUDAGraphOptions, DecodeCUDAGraphs
from framework.compilation.decoder import CompiledDecoder, CompileStats
from framework.core.kv_cache_groups import KVCacheLayout
from framework.core.outputs import ModelRunnerOutput, SchedulerOutput, TargetHiddenStates
from framework.core.step_message import StepMessage
from framework.core.structured_output import apply_grammar_bitmask
from framework.interfaces import AttentionBackend
from framework.model_executor.forward_context import ForwardContext, GraphAttention, forward_context, prepared_mask
from framework.model_executor.lora_layers import LoRAModelManager, LoRAStep
from framework.model_executor.model_families import output_logits
from framework.model_executor.pipeline_parallel import stage_forward
from framework.model_executor.prepack import unfuse_gated_mlps
from framework.sample.fault_isolation import guard_requests
from framework.sample.prompt_logprobs import gather_prompt_logprobs
from framework.sample.rejection_sampler import RejectionSampler
from framework.sample.sampler import Sampler
from framework.worker import kv_memory
from framework.worker.input_batch import BatchInputs, InputBatch, dummy_batch, prepare_inputs
from framework.worker.kv_connector_runner import KVConnectorRunner
from framework.worker.spec_tree_ranks import compact_tree, share_tree_moves, tree_layout

logger = logging.getLogger(__name__)

class ModelRunner:
    """Owns the model, the paged KV cache tensors, the attention backend and the sampler.

    Args:
        model: a transformers ``*ForCausalLM`` loaded with ``attn_implementation="servelab"``.
        backend: the attention backend instance.
        num_blocks: KV blocks of the pool (the allocator's; the tensors get one more, the null block,
            when a KV cache group has a sliding window).
        num_layers: decoder layers.
        kv_cache_dtype: cache dtype (model dtype unless a quant method says otherwise).
        device: torch device of model and cache.
        sampler: the sampler.
        num_swap_blocks: CPU swap-space blocks (``preemption_mode=swap``); 0 allocates none.
        compile: compile the decoder here (:meth:`compile_decoder`); otherwise it runs eagerly until
            :meth:`compile_decoder` is called (``engine.compile=auto``).
        compile_freezing: inductor weight freezing/prepacking, whenever the decoder is compiled.
        compile_backend: ``inductor`` or ``eager`` (the traced graphs run uncompiled; ``engine.compile_backend``).
        kv_cache_layout: which layers share a block table and which KV tensor holds each layer
            (``framework/core/kv_cache_groups.py``); default one group of every layer, one tensor each.
            ``layers_per_block`` tensors are allocated and shared by the groups: ``kv_caches[layer]`` is
            its group slot's tensor.
        is_driver_rank: False on tensor-parallel ranks other than 0: they run the same forward
            (its collectives need every rank) but neither sample nor return hidden states.
        tensor_parallel: the model is one rank's shard (``tensor_parallel_size > 1``): with
            ``compile``, the ranks decide compiled vs eager together after the warm-up.
        cuda_graphs: capture decode CUDA graphs (``framework/compilation/cuda_graphs.py``) with these options,
            unless ``compile``; the KV tensors get one more block, the padding rows' (``None``: eager).
        pp_group: pipeline parallelism: this rank's PP group (``parallel_state.get_pp_group``); the model is
            its stage's (``framework/model_executor/pipeline_parallel.py``): a stage after the first receives the
            previous stage's hidden states ``(1, num_tokens, hidden_size)`` (model dtype), a stage before the
            last sends its own, and only the last computes logits. Eager only. ``None``: one stage.
        kv_slots: the KV tensors (layout slots) to allocate, ascending (a pipeline stage's layers'); the
            other layers' ``kv_caches`` entries are an empty placeholder they never read. ``None``: all.

    Attributes:
        keep_hidden_states: set by ``build_engine`` when the drafter reads the target's last hidden
            states (EAGLE); each output then carries them (``ModelRunnerOutput.hidden_states``),
            taken from the one forward (decoder, then the LM head on the sampled rows only).
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, num_blocks: int, num_layers: int,
                 kv_cache_dtype: torch.dtype, device: torch.device, sampler: Sampler, num_swap_blocks: int = 0,
                 compile: bool = False, compile_freezing: bool = False, compile_backend: str = "inductor",
                 kv_cache_layout: KVCacheLayout | None = None, is_driver_rank: bool = True,
                 tensor_parallel: bool = False, cuda_graphs: CUDAGraphOptions | None = None,
                 pp_group: Any = None, kv_slots: list[int] | None = None) -> None:
        self.model = model
        self.is_driver_rank = is_driver_rank
        self.backend = backend
        self.device = device
        self.block_size = backend.block_size
        self.sampler = sampler
        self.num_blocks = num_blocks  # the pool's (the null block, if any, is block num_blocks)
        self.kv_cache_layout = layout = kv_cache_layout or KVCacheLayout.single(num_layers)
        self.pp_group = pp_group
        self.execute_s = 0.0  # seconds in execute_model so far (bench_pipeline's bubble: busy = this - pp_wait_s)
        self.pp_wait_s = 0.0  # of which a pipeline stage waited for the previous stage's hidden states or to send its own
        kv_slots = list(range(layout.layers_per_block)) if kv_slots is None else kv_slots
        # one block of every KV tensor this rank holds, K and V: layers_per_block layers (all with one group)
        self.block_bytes = backend.kv_cache_bytes_per_block(len(kv_slots))
        self.input_batch = InputBatch(null_block=num_blocks)  # this worker's request states (execute_model's messages)
        self.rejection_sampler = RejectionSampler(sampler)
        self.keep_hidden_states = False
        # multi-LoRA (lora.enable=true): places each step's adapters into slots; set by the Worker after construction
        self.lora: LoRAModelManager | None = None
        self.kv_connector: KVConnectorRunner | None = None  # kv_connector's worker side; set by the Worker
        pad_block = num_blocks + layout.has_null_block  # after the null block (zeros, never written): CUDA-graph padding
        shape = backend.get_kv_cache_shape(pad_block + (cuda_graphs is not None))
        # zero-filled, each page committed on its first write (framework/worker/kv_memory.py)
        self.kv_tensors = [kv_memory.zeros_on_demand(shape, kv_cache_dtype, device) for _ in kv_slots]
        held = dict(zip(kv_slots, self.kv_tensors))
        missing = torch.empty(0, dtype=kv_cache_dtype, device=device)  # another pipeline stage's layer
        # per layer (shared by groups)
        self.kv_caches = [held.get(slot, missing) for slot in layout.tensor_of_layer()]
        self.layer_group = layout.group_of_layer()  # per layer: its KV cache group
        # CPU swap space for preemption_mode=swap (pinned so GPU copies can be asynchronous)
        swap_shape = backend.get_kv_cache_shape(num_swap_blocks)
        pin = device.type == "cuda"
        self.swap_caches = [torch.zeros(swap_shape, dtype=kv_cache_dtype, pin_memory=True) if pin
                            else kv_memory.zeros_on_demand(swap_shape, kv_cache_dtype)
                            for _ in range(len(kv_slots) if num_swap_blocks else 0)]
        self.compile_freezing = compile_freezing
        self.compile_backend = compile_backend
        self.tensor_parallel = tensor_parallel
        self.compiled: CompiledDecoder | None = None
        if compile:
            self.compile_decoder()
        self.cuda_graphs: DecodeCUDAGraphs | None = None
        if cuda_graphs is not None and not compile:
            self.cuda_graphs = DecodeCUDAGraphs(cuda_graphs, backend, self._graph_forward, pad_block, device)
            with torch.inference_mode():
                self.cuda_graphs.capture()

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        """The eager forward a decode CUDA graph captures: ``(B, vocab)`` logits of every row."""
        with forward_context(self._forward_context([metadata])):
            return self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits[0]

    def _graph_bucket(self, batch: BatchInputs) -> int | None:
        """The decode CUDA graph this step replays, or ``None`` (eager): only plain decode steps of one
        KV cache group, with no prompt logprobs or hidden states, while the compiled decoder is inactive."""
        if (self.cuda_graphs is None or batch.prompt_rows is not None or self.keep_hidden_states
                or len(batch.group_commons) > 1 or (self.compiled is not None and self.compiled.stats.active)):
            return None
        return self.cuda_graphs.bucket(batch.common)

    def compile_decoder(self) -> CompileStats:
        """``torch.compile`` the decoder and warm it up (:meth:`CompiledDecoder.warm_up`): the warm-up's
        dummy steps write K/V into blocks ``0, 1, ...``, so call it only while no request owns a block
        and no block is in a prefix cache (at start-up, or after ``Scheduler.reset_prefix_cache``).
        Fused gate/up projections (eager prepacking) are split first: compiled graphs run them as two
        GEMMs (``prepack.unfuse_gated_mlps``). Falls back to eager with a warning; a second call does
        nothing. Under tensor parallelism every rank calls it, and the ranks decide compiled vs eager
        together after the warm-up (``CompiledDecoder.agree_across_ranks``: one rank's fallback makes
        every rank eager, so their collectives stay in step).

        Returns:
            The compile outcome (also :attr:`compile_stats`).
        """
        if self.pp_group is not None:
            logger.warning("pipeline stage %d runs eagerly: compiling a stage's own layers is not implemented yet",
                           self.pp_group.rank_in_group)
            return self.compile_stats
        if self.compiled is None:
            unfuse_gated_mlps(self.model)
            self.compiled = CompiledDecoder(self.model, self.kv_caches, self.layer_group,
                                            self.backend.call_signatures, freezing=self.compile_freezing,
                                            compile_backend=self.compile_backend,
                                            tensor_parallel=self.tensor_parallel)
            traced = type(self.backend).traceable_inputs is not AttentionBackend.traceable_inputs
            self.compiled.warm_up(self._dummy_forward, self.device, traced_attention=traced)
            if self.tensor_parallel:
                self.compiled.agree_across_ranks()
        return self.compiled.stats

    @property
    def compile_stats(self) -> CompileStats:
        """Compile time, graphs and recompiles (``enabled=False`` when the runner is eager)."""
        return self.compiled.stats if self.compiled is not None else CompileStats()

    def time_decode_steps(self, batch_sizes: list[int], repeats: int = 3) -> dict[int, float]:
        """Time dummy decode steps at each batch size as they run now (eager or compiled), for
        ``engine.compile=auto``'s calibration (``framework/compilation/calibration.py``): the median of
        ``repeats`` forwards after one untimed, ms. The dummy steps write K/V into blocks ``0, 1, ...``:
        call it only while no request owns a block and the prefix cache is empty.

        Returns:
            Batch size -> milliseconds of one decode step (the decoder, and the LM head on one row; no
            sampling).
        """
        times = {}
        for batch in batch_sizes:
            batch = max(1, min(batch, self.num_blocks))
            runs = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                self._dummy_forward(batch, batch)
                runs.append(time.perf_counter() - t0)
            times[batch] = 1e3 * sorted(runs[1:])[len(runs[1:]) // 2]
        return times

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int, num_reqs: int = 1) -> None:
        """One dummy step for the compile warm-up, its K/V written into blocks ``0, 1, ...``
        (harmless before any request runs: every request writes its slots before reading them, and
        these blocks are not in the prefix cache).

        ``num_reqs == 1``: a ``num_tokens``-token prefill at positions ``0..num_tokens-1`` (at most
        as many tokens as the cache has slots).
        ``num_reqs == num_tokens``: that many decodes, each at position ``2 * block_size`` of a
        3-block table of its own (blocks ``3i..3i+2``; all share blocks 0-2 in a cache too small). The
        decoder is called with duck sizing off, so batch dims that happen to be equal here (e.g. a traced
        backend's partition count and the batch size) still get separate symbols.
        """
        dev = self.device
        positions, common = dummy_batch(num_tokens, num_reqs, self.block_size, self.num_blocks, dev)
        num_tokens = common.num_tokens
        ids = torch.zeros((1, num_tokens), dtype=torch.long, device=dev)
        # one metadata object per group with tensors of its own, as in a real step (the compiled graphs'
        # guards see the same structure and no aliasing between groups)
        metadata = [self.backend.build_metadata(replace(common, block_table=common.block_table.clone(),
                                                        slot_mapping=common.slot_mapping.clone()))
                    for _ in self.kv_cache_layout.groups]
        with forward_context(self._forward_context(metadata)):
            self._forward(ids, positions[None], torch.tensor([num_tokens - 1], device=dev), metadata)

    def _forward_context(self, metadata: list[Any], lora: LoRAStep | None = None) -> ForwardContext:
        """The step's forward context from each KV cache group's metadata (every layer gets its group's) and
        its LoRA state (``None``: no adapter in the step)."""
        if len(metadata) == 1:
            return ForwardContext(self.backend, metadata[0], self.kv_caches, lora=lora)
        return ForwardContext(self.backend, metadata[0], self.kv_caches,
                              layer_metadata=[metadata[g] for g in self.layer_group], lora=lora)

    def _lora_step(self, batch: BatchInputs) -> LoRAStep | None:
        """This step's adapters placed into slots, with each token's slot (``None``: LoRA off or no adapter)."""
        if self.lora is None:
            return None
        return self.lora.prepare_step([getattr(r, "lora_request", None) for r in batch.requests],
                                      np.diff(batch.query_start_loc_cpu).tolist())

    def _graph_attention(self, metadata: list[Any]) -> GraphAttention | None:
        """The traced-attention inputs of this step when the decoder is compiled and the backend
        offers them for every KV cache group (``AttentionBackend.traceable_inputs``), else ``None``."""
        if self.compiled is None or not self.compiled.stats.active:
            return None
        inputs = [self.backend.traceable_inputs(m) for m in metadata]
        if any(i is None for i in inputs):
            return None
        if len(inputs) == 1:
            return GraphAttention(self.backend, self.kv_caches, inputs[0])
        return GraphAttention(self.backend, self.kv_caches, inputs[0],
                              layer_inputs=[inputs[g] for g in self.layer_group], group_inputs=inputs)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
                 metadata: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(num_sample_rows, vocab)`` logits at ``logits_index`` and, when ``keep_hidden_states``,
        the last hidden states ``(num_tokens, hidden)`` of the same forward (else ``None``); call
        inside ``forward_context`` (``metadata``: the backend's for this step, one per KV cache group)."""
        if self.pp_group is not None:
            return self._stage_forward(input_ids, positions, logits_index), None
        graph = self._graph_attention(metadata)
        if self.keep_hidden_states:  # decoder, then the LM head on the sampled rows only
            hidden = self.compiled.hidden_states(input_ids, positions, graph) if self.compiled is not None else None
            if hidden is not None:
                return self.compiled.logits(hidden[logits_index]), hidden
            hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False,
                                              attention_mask=prepared_mask(input_ids.device)).last_hidden_state[0]
            return output_logits(self.model, hidden[logits_index]), hidden
        if self.compiled is not None:
            return self.compiled(input_ids, positions, logits_index, graph), None
        return self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                          attention_mask=prepared_mask(input_ids.device), logits_to_keep=logits_index).logits[0], None

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       logits_index: torch.Tensor) -> torch.Tensor | None:
        """One pipeline stage's part of the forward (call inside ``forward_context``): receive the previous
        stage's hidden states ``(1, num_tokens, hidden_size)`` unless first, run this stage's layers, send the
        result on unless last. Returns the ``(num_sample_rows, vocab)`` logits on the last stage, else ``None``."""
        pp, model = self.pp_group, self.model
        hidden, t0 = None, time.perf_counter()
        if not pp.is_first_rank:
            shape = (1, input_ids.shape[1], model.config.hidden_size)
            hidden = pp.recv_prev(shape, model.dtype, input_ids.device)
        t1 = time.perf_counter()
        out = stage_forward(model, input_ids, positions, hidden, prepared_mask(input_ids.device))
        if pp.rank_in_group < pp.world_size - 1:
            t2 = time.perf_counter()
            pp.send_next(out)
            self.pp_wait_s += t1 - t0 + time.perf_counter() - t2
            return None
        self.pp_wait_s += t1 - t0
        return output_logits(model, out[0][logits_index])

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors (the null block included)."""
        return sum(t.numel() * t.element_size() for t in self.kv_tensors)

    def execute_model(self, step: StepMessage) -> ModelRunnerOutput:
        """Apply one step's message to this worker's request states, then run the step
        (:meth:`execute_scheduled`). Every rank of an executor calls this with the same message.

        Returns:
            Sampled token ids (and logprobs when asked) by request id, plus the time split.
        """
        t0 = time.perf_counter()
        scheduler_output = self.input_batch.apply(step)
        out = self.execute_scheduled(scheduler_output)
        if self.kv_connector is not None:  # after the forward wrote the step's K/V
            out.kv_connector_output = self.kv_connector.end_step(step.finished_req_ids)
        elapsed = time.perf_counter() - t0
        self.execute_s += elapsed
        out.prepare_s += elapsed - (out.prepare_s + out.forward_s + out.sample_s)
        return out

    @torch.inference_mode()
    def execute_scheduled(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward over every scheduled token and sample where a request reaches its end.

        ``scheduler_output`` holds request-like objects (``Request`` or
        :class:`framework.worker.input_batch.CachedRequestState`): the workers' states through
        :meth:`execute_model`, or the requests of a drafter that runs its own model on the driver.

        Returns:
            Sampled token ids (and logprobs when asked) by request id, plus the time split.
        """
        t0 = time.perf_counter()
        self._swap(scheduler_output)
        if self.kv_connector is not None:  # after the swaps: a block a swap-out frees may be this step's load target
            self.kv_connector.start_step(scheduler_output.kv_connector_metadata)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={}, prepare_s=time.perf_counter() - t0)
        batch = self.prepare_inputs(scheduler_output)
        graphed = self._graph_bucket(batch) is not None
        metadata = [] if graphed else [self.backend.build_metadata(common) for common in batch.group_commons]
        t1 = time.perf_counter()
        hidden_states = None
        if graphed:  # every row's logits, then the sampled ones (a 1-token prefill chunk does not sample)
            logits, hidden = self.cuda_graphs.run(batch.input_ids[0], batch.positions[0], batch.common), None
            logits = logits[batch.logits_index]
        else:
            with forward_context(self._forward_context(metadata, self._lora_step(batch))):
                logits, hidden = self._forward(batch.input_ids, batch.positions, batch.logits_index, metadata)
        if not self.is_driver_rank:
            if self.tensor_parallel and tree_layout(batch, scheduler_output):  # the driver's accepted tree paths
                compact_tree(batch, share_tree_moves(batch, scheduler_output, None), None, self.kv_caches,
                             self.layer_group, self.backend)
            return ModelRunnerOutput(sampled_token_ids={}, prepare_s=t1 - t0, forward_s=time.perf_counter() - t1)
        prompt_logprobs = {}
        if batch.prompt_rows is not None:  # same forward as the prefill: the rows after the sampled ones
            prompt_logprobs = gather_prompt_logprobs(logits[batch.num_sample_rows:], batch.prompt_rows,
                                                     self.sampler.vocab_size)
            logits = logits[:batch.num_sample_rows]
        if hidden is not None:  # (num_tokens, hidden) for an EAGLE-style drafter
            hidden_states = TargetHiddenStates(
                request_ids=[r.request_id for r in batch.requests],
                query_start_loc=batch.query_start_loc_cpu, context_lens=batch.context_lens_cpu, hidden_states=hidden)
        t2 = time.perf_counter()
        sampled, logprobs, accepted, errors = {}, {}, {}, {}
        if batch.sample_requests:
            plain = [i for i, n in enumerate(batch.num_spec) if n == 0]
            row_start = np.concatenate([[0], np.cumsum(np.array(batch.num_spec) + 1)])
            if plain:
                reqs = [batch.sample_requests[i] for i in plain]
                rows = (logits[torch.from_numpy(row_start[plain]).to(logits.device)]
                        if len(plain) < len(batch.num_spec) else logits)
                results = guard_requests(lambda x, rs, _: self._sample(x, rs, scheduler_output), rows, reqs,
                                         [1] * len(reqs), "sampler", self._generators(reqs), errors)
                for request, result in zip(reqs, results):
                    if result is not None:
                        sampled[request.request_id] = [result[0]]
                        if result[1] is not None and request.sampling_params.logprobs is not None:
                            logprobs[request.request_id] = [result[1]]
            if len(plain) < len(batch.num_spec):
                self._verify(logits, batch, row_start, so=scheduler_output, out=(sampled, logprobs, accepted, errors),
                             hidden=hidden)
        t3 = time.perf_counter()
        return ModelRunnerOutput(sampled, logprobs, prepare_s=t1 - t0, forward_s=t2 - t1, sample_s=t3 - t2,
                                 num_accepted_tokens=accepted, hidden_states=hidden_states, request_errors=errors,
                                 prompt_logprobs=prompt_logprobs)

    def _sample(self, rows: torch.Tensor, reqs: list[Any], so: SchedulerOutput) -> list[tuple[int, dict | None]]:
        """Grammar bitmask (the driver's), then the sampler: ``(token id, logprobs or None)`` per request."""
        if so.grammar_bitmask is not None:
            apply_grammar_bitmask(rows, reqs, so, num_rows_each=1)
        out = self.sampler(rows, reqs)
        return [(t, out.logprobs[j] if out.logprobs is not None else None) for j, t in enumerate(out.token_ids)]

    def _generators(self, reqs: list[Any]) -> list[torch.Generator]:
        """The generators a sampling call over ``reqs`` may advance (the engine's, the seeded requests')."""
        if all(r.sampling_params.greedy for r in reqs):
            return []
        return [self.sampler.generator] + [r.generator for r in reqs if r.generator is not None]

    def _verify(self, logits: torch.Tensor, batch: BatchInputs, row_start: np.ndarray, so: SchedulerOutput,
                out: tuple[dict, dict, dict, dict], hidden: torch.Tensor | None = None) -> None:
        """Rejection-sample the speculating requests' k+1 rows each; fills ``out`` in place. A draft tree's accepted
        path is then moved into place (:func:`~framework.worker.spec_tree_ranks.compact_tree`), in the KV cache and in ``hidden`` (when kept)."""
        sampled, logprobs, accepted, errors = out
        spec = [i for i, n in enumerate(batch.num_spec) if n > 0]
        rows = np.concatenate([np.arange(row_start[i], row_start[i + 1]) for i in spec])
        reqs = [batch.sample_requests[i] for i in spec]
        verify_logits = logits[torch.from_numpy(rows).to(logits.device)]
        trees = so.scheduled_spec_decode_parents

        def verify(x: torch.Tensor, rs: list[Any], rows_each: list[int]) -> list[tuple[list[int], int, Any, Any]]:
            drafts = [so.scheduled_spec_decode_tokens[r.request_id] for r in rs]
            if so.grammar_bitmask is not None:  # the driver's masks per verify row (output + drafts so far)
                apply_grammar_bitmask(x, rs, so, num_rows_each=rows_each)
            parents = [trees.get(r.request_id) for r in rs] if trees else None
            res = self.rejection_sampler(x, rs, drafts, draft_parents=parents)
            return [(res.token_ids[j], res.num_accepted[j], res.logprobs[j] if res.logprobs is not None else None,
                     res.accepted_nodes[j] if res.accepted_nodes is not None else None) for j in range(len(rs))]

        rows_each = [batch.num_spec[i] + 1 for i in spec]
        results = guard_requests(verify, verify_logits, reqs, rows_each, "rejection sampler", self._generators(reqs),
                                 errors)
        moves = []
        for request, result in zip(reqs, results):
            if result is None:
                continue
            sampled[request.request_id], accepted[request.request_id] = result[0], result[1]
            if result[2] is not None and request.sampling_params.logprobs is not None:
                logprobs[request.request_id] = result[2]
            if result[3]:  # token index of the tree's node 0: the last k tokens of the request's query are its nodes
                end = int(batch.query_start_loc_cpu[batch.requests.index(request) + 1])
                moves.append((end - len(so.scheduled_spec_decode_tokens[request.request_id]), result[3]))
        if self.tensor_parallel and tree_layout(batch, so):  # every rank moves its shard of the K/V
            moves = share_tree_moves(batch, so, moves)
        if moves:
            compact_tree(batch, moves, hidden, self.kv_caches, self.layer_group, self.backend)

    def _swap(self, so: SchedulerOutput) -> None:
        """The step's swap copies through the backend: every swap-out, then every swap-in, before
        the forward (a block freed by a swap-out may be rewritten by this very step)."""
        for blocks, slots in so.swap_out:
            self.backend.copy_blocks(self.kv_tensors, blocks, self.swap_caches, slots)
        for slots, blocks in so.swap_in:
            self.backend.copy_blocks(self.swap_caches, slots, self.kv_tensors, blocks)

    def prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        """This step's flattened inputs (:func:`framework.worker.input_batch.prepare_inputs`)."""
        return prepare_inputs(so, self.block_size, self.device)
