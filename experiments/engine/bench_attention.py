"""Attention backends head to head: kernel-only prefill and decode times, and end-to-end output tok/s.

For each backend of ``--backends`` (default: on CUDA ``triton``, ``flash_attn``, ``flashinfer``,
``xformers`` (those installed) and the ``torch`` reference; on CPU ``torch`` and ``torch_paged``):

* **kernel** — one layer's ``forward`` (K/V write + attention) on random q/k/v with the model's head
  shape, median of ``--repeats`` calls after warm-ups (CUDA: synchronised), at each batch size:
  *prefill* = ``batch`` fresh requests of ``--input-len`` tokens (at most ``--max-prefill-tokens``
  tokens in all: the batch is cut to fit), *decode* = ``batch`` requests of one token each over a
  ``--input-len``-token context. Metadata is built outside the timed calls (once per step in the engine).
* **end to end** — ``LLM(...).generate`` of ``batch`` random-token prompts of ``--input-len`` tokens,
  ``--output-len`` greedy tokens each (``ignore_eos``), after a small warm-up generate; output tok/s =
  ``batch * output_len / seconds``. With ``--cuda-graphs on,off`` on CUDA, each backend that
  ``supports_cuda_graphs`` runs with decode CUDA graphs (``engine.enforce_eager=null``) and without
  (``true``); elsewhere only ``off``. ``engine.compile=false`` throughout.

A backend that cannot run here (missing package, refused configuration) is reported with its reason
instead of numbers. The model is ``--model`` (default SmolLM2-135M-Instruct, bf16); with
``--random-weights`` a seeded random-weight copy of its architecture (``scripts/gpu_check.sh`` uses
this where the weights cannot travel; the timings are the same computation).

Examples::

    python -m experiments.engine.bench_attention --json-out bench_attention.json            # GPU: the full table
    .venv/bin/python -m experiments.engine.bench_attention --model models/stories260K --dtype float32 \
        --batch-sizes 1,4 --input-len 16 --output-len 4 --repeats 2 \
        --backend-params '{"torch_paged": {"compile": false}}'                        # seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from experiments.common import bench_dtype, machine_info

GPU_BACKENDS = ("triton", "flash_attn", "flashinfer", "xformers")
CPU_BACKENDS = ("torch", "torch_paged")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--random-weights", action="store_true", help="a seeded random-weight copy of --model's architecture")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="auto: the dtype servelab's dtype=auto picks on this CPU (float32 for bf16 on AVX2 only)")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--backends", default="", help="comma-separated; default: every backend this device can run")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (kernel: prefill length, decode context)")
    p.add_argument("--output-len", type=int, default=64, help="end to end: greedy tokens per request")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="kernel prefill: tokens per call at most")
    p.add_argument("--cuda-graphs", default="on,off", help="on,off | on | off (on: CUDA and capturable backends only)")
    p.add_argument("--repeats", type=int, default=10, help="kernel: timed calls (median)")
    p.add_argument("--skip-e2e", action="store_true", help="kernel timings only")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=0, help="0: 4 GiB on CUDA, 1 GiB on CPU")
    p.add_argument("--backend-params", default="{}", help='JSON per backend, e.g. \'{"torch_paged": {"compile": false}}\'')
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def device_info(device: torch.device) -> dict[str, Any]:
    """Where the numbers come from: the machine (:func:`experiments.common.machine_info`), the device, its GPU
    model on CUDA, the triton version."""
    info = machine_info() | {"device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def default_backends(device: torch.device) -> list[str]:
    """Registered backends for this device: on CUDA the GPU kernels and the ``torch`` reference (not
    ``torch_paged``, a CPU design whose inductor warm-up would take most of a GPU check), else the CPU ones."""
    from framework import registry

    names = registry.available("attention")
    wanted = GPU_BACKENDS + ("torch",) if device.type == "cuda" else CPU_BACKENDS
    return [n for n in wanted if n in names]


def random_weight_copy(model: str, dtype: str, out_dir: Path) -> str:
    """Save a seeded random-weight model with ``model``'s config and tokenizer under ``out_dir`` (once)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from framework.model_executor.model_loader import resolve_model_path

    src = Path(resolve_model_path(model))
    if not (out_dir / "config.json").is_file():
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(src)
        AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(out_dir)
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                shutil.copy(f, out_dir / f.name)
    return str(out_dir)


def block_size_for(name: str) -> int:
    """16, or the backend's page-size rule (flash_attn: 256)."""
    from framework import registry

    return max(16, registry.get_class("attention", name).block_size_multiple)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(spec: list[tuple[int, int]], block_size: int, device: torch.device) -> Any:
    """Runner-style metadata of ``spec = [(context_len, query_len), ...]`` (decodes first), blocks in order."""
    from framework.interfaces import CommonAttentionMetadata

    tables, slots, next_block = [], [], 0
    for c, q in spec:
        n = -(-(c + q) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        next_block += n
    q_lens, seq_lens = [q for _, q in spec], [c + q for c, q in spec]
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    nd = sum(q == 1 for q in q_lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device), block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens, num_reqs=len(spec), num_tokens=sum(q_lens), num_decodes=nd, num_decode_tokens=nd,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size), next_block


def time_kernel(backend: Any, spec: list[tuple[int, int]], repeats: int) -> float:
    """Median ms of one layer's ``forward`` (K/V write + attention) over the step ``spec``."""
    device, dtype = backend.device, backend.dtype
    common, num_blocks = _step(spec, backend.block_size, device)
    cache = torch.randn(backend.get_kv_cache_shape(num_blocks + 1), device=device).to(backend.cache_dtype)
    gen = {"device": device, "dtype": dtype}
    query = torch.randn(common.num_tokens, backend.num_heads, backend.head_size, **gen)
    key = torch.randn(common.num_tokens, backend.num_kv_heads, backend.head_size, **gen)
    value = torch.randn_like(key)
    metadata = backend.build_metadata(common)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):  # two warm-ups (compilation, autotuning)
            _sync(device)
            t0 = time.perf_counter()
            backend.forward(0, query, key, value, cache, metadata)
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def kernel_rows(name: str, shape: dict[str, Any], args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Kernel-only prefill and decode ms at each batch size for one backend."""
    from framework import registry

    backend = registry.create("attention", name, num_heads=shape["num_heads"], num_kv_heads=shape["num_kv_heads"],
                              head_size=shape["head_size"], scale=shape["head_size"] ** -0.5,
                              block_size=block_size_for(name), dtype=getattr(torch, args.dtype), device=device,
                              **args.backend_params.get(name, {}))
    rows = []
    for batch in args.batch_sizes:
        prefill_batch = max(1, min(batch, args.max_prefill_tokens // args.input_len))
        rows.append({"backend": name, "batch": batch,
                     "prefill_ms": time_kernel(backend, [(0, args.input_len)] * prefill_batch, args.repeats),
                     "prefill_batch": prefill_batch,
                     "decode_ms": time_kernel(backend, [(args.input_len, 1)] * batch, args.repeats)})
    return rows


def e2e_rows(name: str, graphs: bool, model: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Output tok/s of ``generate`` at each batch size, one engine per (backend, CUDA graphs)."""
    from framework import LLM, SamplingParams

    kv_bytes = args.kv_cache_memory_bytes or (4 << 30 if device.type == "cuda" else 1 << 30)
    llm = LLM(model=model, attention=name, attention_params=args.backend_params.get(name, {}), dtype=args.dtype, device=str(device), block_size=block_size_for(name),
              compile=False, enforce_eager=None if graphs else True, max_num_seqs=max(args.batch_sizes),
              kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False, grammar="none")
    captured = llm.engine.runner.cuda_graphs is not None
    vocab = llm.engine.runner.sampler.vocab_size
    gen = torch.Generator().manual_seed(0)
    warm = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in range(2)]
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rows = []
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": torch.randint(3, vocab, (args.input_len,), generator=gen).tolist()}
                   for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync(device)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"backend": name, "cuda_graphs": captured, "batch": batch, "seconds": seconds,
                     "output_tok_s": tokens / seconds})
    del llm
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table; return (and with ``--json-out`` save) the results."""
    args = parse_args(argv)
    args.dtype = bench_dtype(args.model, args.dtype)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.backend_params = json.loads(args.backend_params)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    from framework import EngineConfig, registry
    from framework.model_executor.model_loader import load_model_config

    model = args.model
    if args.random_weights:
        model = random_weight_copy(model, args.dtype, Path(os.environ.get("TMPDIR", "/tmp")) / "servelab-bench-model")
    mc = load_model_config(model)
    head_size = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    shape = {"num_heads": mc.num_attention_heads, "num_kv_heads": mc.num_key_value_heads, "head_size": head_size}
    backends = args.backends.split(",") if args.backends else default_backends(device)
    modes = [m == "on" for m in args.cuda_graphs.split(",")] if device.type == "cuda" else [False]
    result: dict[str, Any] = {"machine": device_info(device), "model": args.model, "random_weights": args.random_weights,
                              "dtype": args.dtype, "shape": shape, "input_len": args.input_len,
                              "output_len": args.output_len, "kernel": [], "e2e": [], "skipped": {}}
    for name in backends:
        try:
            config = EngineConfig(model=model, attention=name, device=str(device), dtype=args.dtype,
                                  block_size=block_size_for(name))
            problems = registry.get_class("attention", name).validate(config)
            if problems:
                result["skipped"][name] = problems[0]
                continue
            result["kernel"] += kernel_rows(name, shape, args, device)
            if args.skip_e2e:
                continue
            capturable = registry.get_class("attention", name).supports_cuda_graphs
            for graphs in sorted({g and capturable for g in modes}, reverse=True):
                result["e2e"] += e2e_rows(name, graphs, model, args, device)
        except Exception as err:  # noqa: BLE001 - a backend this machine cannot run is reported, not fatal
            result["skipped"][name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


def print_table(result: dict[str, Any]) -> None:
    """Plain-text tables of the kernel and end-to-end rows, then the skipped backends."""
    machine = result["machine"]
    print(f"# {result['model']} {result['dtype']} on {machine.get('gpu') or machine['cpu']} (torch {machine['torch']}, "
          f"triton {machine['triton']}); input {result['input_len']}, output {result['output_len']} tokens")
    print(f"{'backend':<12} {'batch':>5} {'prefill ms':>11} {'decode ms':>10}")
    for r in result["kernel"]:
        print(f"{r['backend']:<12} {r['batch']:>5} {r['prefill_ms']:>11.3f} {r['decode_ms']:>10.3f}")
    print(f"{'backend':<12} {'graphs':>6} {'batch':>5} {'output tok/s':>13}")
    for r in result["e2e"]:
        print(f"{r['backend']:<12} {'on' if r['cuda_graphs'] else 'off':>6} {r['batch']:>5} {r['output_tok_s']:>13.1f}")
    for name, why in result["skipped"].items():
        print(f"{name}: not run here ({why})")


if __name__ == "__main__":
    main()
