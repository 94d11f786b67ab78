"""Speed per model family: Qwen3- and Gemma-3-shaped models against the Llama family of the same size.

Issue 36's speed check: no family may be more than 10% slower per token than a Llama of the same
size without a reason. Every family gets the same dimensions (by default SmolLM2-135M's: hidden 576,
30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152; ~135M parameters) and random
weights (fixed seed), saved once under ``--model-dir``, so the per-token differences are the
family's own: Qwen3's q/k norms, Gemma 3's four norms per layer, embedding scaling and 5:1
local/global layers with a ``--window``-token sliding window (and per-type RoPE). Each family runs:

* ``ours``  ``LLM(...).generate`` (the engine's defaults: ``torch_paged``, prepacked bf16 linears on CPU;
  ``--compile`` adds ``engine.compile``), greedy, ``ignore_eos``;
* ``hf``    transformers ``generate`` on the same left-padded batch (sdpa attention; windows as masks),

at each batch size of ``--batch-sizes`` (default 1 and 64), all in one process, through
``experiments/offline/bench_offline.py``'s runners. Reported: output tok/s, ms per output token of a sequence
(wall seconds / output length), ``vs llama`` (ours' tok/s over the Llama family's at the same batch)
and ``vs hf``.

Example (the lead's measured pass; never time on a shared machine)::

    .venv/bin/python -m experiments.offline.bench_families --batch-sizes 1,64 --input-len 128 --output-len 128 \
        --json-out experiments/results/families.json
    .venv/bin/python -m experiments.offline.bench_families --tiny          # seconds-long smoke run (tests)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from experiments.common import REPO_ROOT, code_state, machine_info
from experiments.offline.bench_offline import run_hf_static, run_ours

FAMILIES = ("llama", "qwen3", "gemma3")
#: SmolLM2-135M's dimensions, shared by every family (``--tiny``: a 2-layer model of stories260K's vocabulary).
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)
console = Console()


def family_config(family: str, shape: dict[str, int], window: int) -> Any:
    """The transformers config of ``family`` with ``shape`` (Gemma 3: five local layers per global one)."""
    import transformers

    common = dict(shape, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "gemma3":
        layers = shape["num_hidden_layers"]
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        return transformers.Gemma3TextConfig(**common, sliding_window=window, layer_types=types,
                                             query_pre_attn_scalar=shape["head_dim"])
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def build_model(family: str, args: argparse.Namespace) -> tuple[str, int]:
    """Save ``family``'s random-weight model (bf16 on disk, seed 0) with the tokenizer of ``--tokenizer``
    under ``--model-dir`` unless it is there; returns ``(folder, parameter count)``."""
    from transformers import AutoModelForCausalLM

    from framework.model_executor.model_loader import resolve_model_path

    shape = TINY_SHAPE if args.tiny else SHAPE
    folder = Path(args.model_dir) / f"{family}-{'tiny' if args.tiny else 'base'}-w{args.window}"
    config = family_config(family, shape, args.window)
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        source = Path(resolve_model_path(args.tokenizer))
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
            if (source / name).is_file():
                shutil.copy(source / name, folder / name)
        del model
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return str(folder), params


def prompts_for(args: argparse.Namespace, batch: int, vocab: int) -> list[list[int]]:
    """``batch`` random token-id prompts of ``--input-len`` tokens (seeded; ids past the specials)."""
    rng = random.Random(args.seed)
    return [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(batch)]


def run_family(family: str, folder: str, batch: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both systems on one family at one batch size: ``{system: {seconds, tok_s, ms_per_token, ...}}``."""
    vocab = (TINY_SHAPE if args.tiny else SHAPE)["vocab_size"]
    prompts, out_lens = prompts_for(args, batch, vocab), [args.output_len] * batch
    run_args = SimpleNamespace(model=folder, dtype=args.dtype, prefix_caching="off", max_num_seqs=max(batch, 1),
                               max_num_batched_tokens=None, compile=args.compile, warmup=True, hf_batch_size=0,
                               attention_params=json.loads(args.attention_params))
    results = {}
    for system, runner in (("ours", run_ours), ("hf", run_hf_static)):
        if system not in args.systems.split(","):
            continue
        r = runner(prompts, out_lens, run_args)
        gc.collect()
        seconds = r["seconds"]
        results[system] = {"seconds": seconds, "tok_s": batch * args.output_len / seconds,
                           "ms_per_token": 1000 * seconds / args.output_len,
                           "short_outputs": sum(len(t) < n for t, n in zip(r["tokens"], out_lens)),
                           **({"step_split": r["extra"]["step_split"]} if system == "ours" else {})}
    return results


def render(rows: list[dict[str, Any]], title: str) -> Table:
    """Rows of (family, batch, system) with tok/s, ms/token and the ratios."""
    table = Table(title=title, header_style="bold")
    for column in ("family", "params", "batch", "system", "tok/s", "ms/token", "vs llama", "vs hf"):
        table.add_column(column, justify="right" if column not in ("family", "system") else "left")
    for r in rows:
        table.add_row(r["family"], f"{r['params'] / 1e6:.1f}M", str(r["batch"]), r["system"], f"{r['tok_s']:.1f}",
                      f"{r['ms_per_token']:.2f}", r.get("vs_llama", "-"), r.get("vs_hf", "-"))
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--window", type=int, default=512, help="Gemma 3's sliding window, tokens")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: what dtype=auto runs a bf16 checkpoint in on this CPU (float32 on AVX2 only)")
    p.add_argument("--systems", default="ours,hf")
    p.add_argument("--compile", action="store_true", help="ours: engine.compile=true")
    p.add_argument("--attention-params", default="{}", help="ours: the attention backend's params as JSON, e.g. "
                   '\'{"compile": false}\' (the torch_paged kernel eager: no start-up compile, for smoke runs)')
    p.add_argument("--model-dir", default=None, help="where the random-weight models are saved and reused "
                   "(default: <servelab cache>/bench_families, see $SERVELAB_CACHE)")
    p.add_argument("--tokenizer", default="smollm2", help="model whose tokenizer the saved models get")
    p.add_argument("--tiny", action="store_true", help="2-layer models, stories260K's tokenizer, 4 tokens: a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = torch default")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.dtype == "auto":
        from framework.platform import choose_dtype

        args.dtype = choose_dtype("auto", "bfloat16", "cpu").dtype
    if args.tiny:
        args.tokenizer = str(REPO_ROOT / "models" / "stories260K")
        args.window = min(args.window, 8)
    if args.model_dir is None:
        from framework.model_executor.model_loader import servelab_cache_dir

        args.model_dir = str(servelab_cache_dir() / "bench_families")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    code = code_state()
    rows: list[dict[str, Any]] = []
    for family in args.families.split(","):
        folder, params = build_model(family, args)
        for batch in map(int, args.batch_sizes.split(",")):
            console.print(f"[bold]{family}[/bold] ({params / 1e6:.1f}M parameters), batch {batch} ...")
            for system, r in run_family(family, folder, batch, args).items():
                rows.append({"family": family, "params": params, "batch": batch, "system": system, **r})
    ours = {(r["family"], r["batch"]): r["tok_s"] for r in rows if r["system"] == "ours"}
    hf = {(r["family"], r["batch"]): r["tok_s"] for r in rows if r["system"] == "hf"}
    for r in rows:
        if r["system"] == "ours" and ("llama", r["batch"]) in ours:
            r["vs_llama"] = f"{r['tok_s'] / ours[('llama', r['batch'])]:.2f}x"
        if r["system"] == "ours" and (r["family"], r["batch"]) in hf:
            r["vs_hf"] = f"{r['tok_s'] / hf[(r['family'], r['batch'])]:.2f}x"
    console.print(render(rows, f"families, {args.dtype}, input {args.input_len}, output {args.output_len}, "
                               f"{torch.get_num_threads()} threads{', compiled' if args.compile else ''}"))
    result = {"args": vars(args), "rows": rows, "code": code, "machine": machine_info()}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
