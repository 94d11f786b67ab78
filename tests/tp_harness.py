"""Tensor-parallel ranks for the TP tests: ``spawn_ranks`` starts one process per rank (gloo on CPU,
one thread each), runs a function there and returns what every rank returned.

Importable by the spawned children because ``tests/`` is on pytest's pythonpath (the children get
the parent's ``sys.path``); test modules themselves are imported by path (``--import-mode=importlib``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, tp_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp_size)
    try:
        torch.save(fn(rank, tp_size, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], tp_size: int, *args: Any) -> list[Any]:
    """``[fn(rank, tp_size, *args) for rank in range(tp_size)]``, each in its own process of a gloo group.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
    """
    import torch.multiprocessing as mp

    from framework.distributed.process_start import process_context

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(tp_size, _free_port(), out_dir, fn, args), nprocs=tp_size,
                           start_method=process_context().get_start_method())  # forked from a server that imported torch once
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(tp_size)]


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, tp_rank: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache (each rank caches its heads): the driver
    picks each token from the full logits and broadcasts it (what ``generate(do_sample=False)`` does)."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = out.logits[0, -1].argmax().reshape(1) if tp_rank == 0 else torch.zeros(1, dtype=torch.long)
        dist.broadcast(token, src=0)
        tokens.append(int(token))
        out = model(input_ids=token[None], cache=out.cache, use_cache=True)
    return tokens


def replicated_free_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters other than norms (norm weights stay whole on every rank), tied counted once."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" not in n)


def _compile_check(model: torch.nn.Module, ids: torch.Tensor, backend_name: str) -> dict[str, Any]:
    """Whole model under ``torch.compile(fullgraph=True)`` with ``backend_name`` (``eager``: dynamo's
    graph run as is, ~6 s for 2 layers here; ``inductor``: generated C++, about a minute): logits and
    the collectives in dynamo's graph."""
    graphs = []
    compiler = torch._dynamo.lookup_backend(backend_name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return compiler(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.inference_mode():
        logits = compiled(input_ids=ids, use_cache=False).logits
    ops = Counter(str(n.target) for gm in graphs for n in gm.graph.nodes if "c10d_functional" in str(n.target))
    return {"compiled_logits": logits, "collectives": dict(ops), "num_graphs": len(graphs)}


def _transformers_tp(path: str, prompt: list[int], new_tokens: int, tp_size: int) -> dict[str, Any]:
    """transformers' own tensor parallelism (``DistributedConfig(tp_size=...)``, the successor of
    ``from_pretrained(tp_plan="auto")``; DTensor, needs ``accelerate``) in the same process group:
    logits and ``generate`` greedy tokens."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_size=tp_size))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    return {"hf_tp_logits": logits, "hf_tp_tokens": tokens}


@torch.inference_mode()
def runner_logits(path: str, tp_rank: int, tp_size: int, attention: str = "torch") -> torch.Tensor:
    """Logits of one engine step through ``ModelRunner`` (servelab attention, ``attention`` backend
    built with this rank's heads from ``rank_layout``, paged KV cache of this rank's KV heads): three
    prompts of 5, 37 and 70 tokens scheduled by the real ``Scheduler`` (identical on every rank)."""
    from framework import registry
    from framework.core.request import Request
    from framework.core.sampling_params import SamplingParams
    from framework.core.scheduler import Scheduler
    from framework.core.stop import StopChecker
    from framework.model_executor.forward_context import (
        ForwardContext,
        forward_context,
        register_attention_implementation,
    )
    from framework.model_executor.tensor_parallel import rank_layout
    from framework.model_executor.tp_weights import load_tp_model
    from framework.sample.sampler import Sampler
    from framework.worker.model_runner import ModelRunner

    lm = load_tp_model(path, "float32", "cpu", tp_rank, tp_size, register_attention_implementation())
    layout, config = rank_layout(lm.config, tp_rank, tp_size), lm.config
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    backend = registry.create("attention", attention, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
                              head_size=head_size, scale=head_size ** -0.5, block_size=16, dtype=torch.float32,
                              device=torch.device("cpu"))
    runner = ModelRunner(lm.model, backend, 32, config.num_hidden_layers, torch.float32, torch.device("cpu"),
                         Sampler(config.vocab_size))
    allocator = registry.create("kv_allocator", "paged", num_blocks=32, block_size=16, enable_prefix_caching=False,
                                max_model_len=config.max_position_embeddings)
    scheduler = Scheduler(registry.create("scheduler", "fcfs"), allocator, StopChecker(lm.tokenizer), max_num_seqs=8,
                          max_num_batched_tokens=256, max_model_len=config.max_position_embeddings)
    for i, n in enumerate((5, 37, 70)):
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=[1 + (7 * j + i) % 500 for j in range(n)],
                                      sampling_params=SamplingParams(max_tokens=4)))
    batch = runner.prepare_inputs(scheduler.schedule())
    metadata = backend.build_metadata(batch.common)
    with forward_context(ForwardContext(backend, metadata, runner.kv_caches)):
        return runner._forward(batch.input_ids, batch.positions, batch.logits_index, metadata)[0]


def run_cases(tp_rank: int, tp_size: int, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case (``name``, ``path``, ``prompt``, ``new_tokens``, ``checks`` among ``compile_<backend>``
    (``eager``: dynamo only, ``aot_eager``, ``inductor``), ``compile_agreement``, ``prepack``, ``int8_wo``,
    ``transformers_tp``, ``runner``): load this rank's shard (float32, eager attention), then record logits and
    per-layer hidden states of one forward, a greedy continuation, the non-norm parameter bytes and
    each extra check's logits."""
    from framework.model_executor.prepack import prepack_linears
    from framework.model_executor.tp_weights import load_tp_model

    results = {}
    for case in cases:
        lm = load_tp_model(case["path"], "float32", "cpu", tp_rank, tp_size, attn_implementation="eager")
        ids = torch.tensor([case["prompt"]])
        with torch.inference_mode():
            out = lm.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        res: dict[str, Any] = {"logits": out.logits, "hidden": out.hidden_states,
                               "tokens": greedy(lm.model, case["prompt"], case["new_tokens"], tp_rank),
                               "bytes": replicated_free_bytes(lm.model), "path": case["path"]}
        checks = case.get("checks", ())
        for backend_name in ("eager", "aot_eager", "inductor"):
            if f"compile_{backend_name}" in checks:
                res.update(_compile_check(lm.model, ids, backend_name))
        if "compile_agreement" in checks:
            res["compile_agreement"] = compile_agreement(lm.model, tp_rank, tp_size)
        if "prepack" in checks:
            res["num_prepacked"] = prepack_linears(lm.model)
            res["module_classes"] = {type(m).__name__ for m in lm.model.modules()}
            with torch.inference_mode():
                res["prepacked_logits"] = lm.model(input_ids=ids, use_cache=False).logits
        if "runner" in checks:
            res["runner_logits"] = runner_logits(case["path"], tp_rank, tp_size)
        if "transformers_tp" in checks and importlib.util.find_spec("accelerate") is not None:
            res.update(_transformers_tp(case["path"], case["prompt"], case["new_tokens"], tp_size))
        if "int8_wo" in checks:
            from plugins.quant.int8_wo import Int8WeightOnly

            Int8WeightOnly().apply(lm.model)
            with torch.inference_mode():
                res["int8_logits"] = lm.model(input_ids=ids, use_cache=False).logits
        results[case["name"]] = res
    return results


def compile_agreement(model: torch.nn.Module, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """``CompiledDecoder.agree_across_ranks`` when only the last rank fell back (nothing compiles:
    the fallback is a stand-in), then a failing compiled layer call on a warmed-up TP rank. The
    model's layers get their class ``forward`` back at the end."""
    from framework.compilation.decoder import CompiledDecoder

    num_layers = model.config.num_hidden_layers
    kv_caches, groups = [torch.zeros(1)] * num_layers, [0] * num_layers
    decoder = CompiledDecoder(model, kv_caches, groups, tensor_parallel=True)
    decoder.stats.active = True
    if tp_rank == tp_size - 1:
        decoder._fall_back("torch.compile failed (BackendCompilerFailed: stand-in)")
    decoder.agree_across_ranks()
    out: dict[str, Any] = {"active": decoder.stats.active, "reason": decoder.stats.fallback_reason,
                           "compiling": decoder.compiling}

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stand-in compile error")

    late = CompiledDecoder(model, kv_caches, groups, tensor_parallel=True)
    late.graphs.run, late._warmed_up = fails, True
    try:
        late._layer_forward(0, torch.zeros(1, 2, model.config.hidden_size))
    except RuntimeError as err:
        out["late_failure"] = str(err)
    for layer in late.graphs.layers:
        vars(layer).pop("forward", None)
    return out
