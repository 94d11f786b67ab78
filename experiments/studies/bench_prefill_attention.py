"""Prefill attention of the torch reference (``torch_paged``'s prefill path) per ``prefill_tile``.

Captures the attention metadata of a workload's prefill steps (``bench_offline.py`` prompts, one
eager engine, prefix caching off, ``max_tokens=1``), then times ``TorchAttentionBackend.attend`` on
them (random bf16 queries and caches in the ``HDN`` layout, metadata built per step as the engine
does) for every tile size, in alternating rounds in one process, and prints the median seconds per
30-layer prefill with its ratio to the first tile size. ``--engine`` instead times whole prefills
(``max_tokens=1`` generates of compiled engines, one per tile size, alternating) and checks that
their greedy first tokens agree::

    .venv/bin/python -m experiments.studies.bench_prefill_attention --workload mixed --tiles 0,32,64,128
    .venv/bin/python -m experiments.studies.bench_prefill_attention --workload mixed --tiles 0,64 --engine
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from experiments.common import add_model_workload_args, build_workload, load_texts  # noqa: E402


def capture_prefill_metadata(model: str, prompts: list[list[int]]) -> tuple[list[dict], dict]:
    """The ``CommonAttentionMetadata`` fields of each prefill step, and the model's attention shape."""
    from framework import LLM, SamplingParams
    from framework.model_executor.model_loader import load_model_config
    from plugins.attention.torch_paged import TorchPagedAttentionBackend

    steps: list[dict] = []
    build = TorchPagedAttentionBackend.build_metadata

    def recording(self: TorchPagedAttentionBackend, common: object) -> object:
        if common.num_tokens > common.num_reqs:  # type: ignore[attr-defined]
            steps.append({f.name: getattr(common, f.name) for f in dataclasses.fields(common)})  # type: ignore[arg-type]
        return build(self, common)  # type: ignore[arg-type]

    TorchPagedAttentionBackend.build_metadata = recording  # type: ignore[method-assign]
    try:
        llm = LLM(model=model, dtype="bfloat16", attention="torch_paged", enable_prefix_caching=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        TorchPagedAttentionBackend.build_metadata = build  # type: ignore[method-assign]
    hf = load_model_config(model)
    shape = {"num_heads": hf.num_attention_heads, "num_kv_heads": hf.num_key_value_heads,
             "head_size": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
             "layers": hf.num_hidden_layers, "block_size": steps[0]["block_size"]}
    return steps, shape


def time_attend(steps: list[dict], shape: dict, tiles: list[int], rounds: int) -> dict[int, list[float]]:
    """Seconds per ``layers``-layer prefill (all captured steps) of each tile size, per round."""
    from framework.interfaces.attention import CommonAttentionMetadata
    from plugins.attention.torch import TorchAttentionBackend

    h, kvh, d = shape["num_heads"], shape["num_kv_heads"], shape["head_size"]
    backends = {t: TorchAttentionBackend(h, kvh, d, d ** -0.5, shape["block_size"], torch.bfloat16,
                                         torch.device("cpu"), kv_layout="HDN", prefill_tile=t) for t in tiles}
    gen = torch.Generator().manual_seed(0)
    data = []
    for fields in steps:
        common = CommonAttentionMetadata(**fields)
        shape_c = backends[tiles[0]].get_kv_cache_shape(int(common.block_table.max()) + 1)
        data.append((common, torch.randn(shape_c, generator=gen).to(torch.bfloat16),
                     torch.randn(common.num_tokens, h, d, generator=gen).to(torch.bfloat16)))
    reps = 3  # layers timed per step and round (scaled to ``layers``)
    times: dict[int, list[float]] = {t: [] for t in tiles}
    for _ in range(rounds):
        for t in tiles:
            start = time.perf_counter()
            for common, cache, query in data:
                metadata = backends[t].build_metadata(common)
                for _ in range(reps):
                    backends[t].attend(query, cache, metadata)
            times[t].append((time.perf_counter() - start) / reps * shape["layers"])
    return times


def time_engines(model: str, prompts: list[list[int]], tiles: list[int], rounds: int) -> tuple[dict[int, list[float]], list[int]]:
    """Seconds per whole prefill (``max_tokens=1`` generate) of compiled engines, and per tile size how
    many first tokens equal the first tile size's."""
    from framework import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    engines = {t: LLM(model=model, dtype="bfloat16", attention="torch_paged", enable_prefix_caching=False,
                      compile=True, attention_params={"prefill_tile": t}) for t in tiles}
    for llm in engines.values():
        llm.generate(inputs[:2], params)
    times: dict[int, list[float]] = {t: [] for t in tiles}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(rounds):
        for t, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(inputs, params)
            times[t].append(time.perf_counter() - start)
            tokens[t] = [list(o.outputs[0].token_ids) for o in outs]
    same = [sum(a == b for a, b in zip(tokens[tiles[0]], tokens[t])) for t in tiles]
    return times, same


def main(argv: list[str] | None = None) -> dict[int, list[float]]:
    """Run the benchmark; returns each tile size's seconds per round."""
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_workload_args(p)
    p.add_argument("--tiles", default="0,32,64,128", help="comma list of prefill_tile values (the first is the base)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--engine", action="store_true", help="time whole compiled prefills instead of attention alone")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or 2)
    tiles = [int(t) for t in args.tiles.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model), local_files_only=True)
    prompts, _ = build_workload(tokenizer, load_texts(Path(args.prompts_file)), args)
    if args.engine:
        times, same = time_engines(args.model, prompts, tiles, args.rounds)
        what = "whole prefill (compiled engine)"
    else:
        steps, shape = capture_prefill_metadata(args.model, prompts)
        times, same = time_attend(steps, shape, tiles, args.rounds), []
        what = f"attention of {len(steps)} prefill steps x {shape['layers']} layers"
    base = statistics.median(times[tiles[0]])
    print(f"{args.workload}, {len(prompts)} prompts: {what}")
    for i, t in enumerate(tiles):
        med = statistics.median(times[t])
        agree = f"  first tokens equal to tile {tiles[0]}: {same[i]}/{len(prompts)}" if same else ""
        print(f"prefill_tile={t:4d}: median {med:6.3f} s ({med / base:.3f}x)  all "
              + " ".join(f"{x:.3f}" for x in times[t]) + agree)
    return times


if __name__ == "__main__":
    main()
