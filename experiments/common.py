"""What the experiment scripts share: the offline workload (``--model``/``--workload`` arguments, prompt token
ids, output lengths), the dtype a benchmark runs in, the machine and code a result was measured on, and one
Markdown table renderer. Percentiles are the engine's own (:func:`framework.metrics.collector.percentile`).

Nothing heavy is imported at module level (torch, transformers and the engine load inside the functions that
need them): ``offline/bench_offline.py`` and ``studies/nano_batch_cpu.py`` import this module, then set
``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` from ``--threads`` (:func:`set_thread_env`) before torch loads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
#: prompts used when ``--prompts-file`` is missing or empty
BUILTIN_PROMPTS = [
    "Explain photosynthesis to a twelve-year-old.",
    "Write a haiku about autumn rain.",
    "What is the capital of Australia?",
    "Give me three tips for writing a clear email to a busy manager.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the main causes of inflation?",
    "How does a refrigerator keep food cold?",
    "Describe the water cycle step by step.",
    "Tell me a bedtime story about a small dragon who learns to share.",
]


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
def add_model_workload_args(p: argparse.ArgumentParser) -> None:
    """Model, workload and thread arguments shared by the offline scripts (read by :func:`load_workload`)."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="every system's dtype; auto: the one servelab's dtype=auto picks on this CPU (float32 for a "
                        "bf16 checkpoint on an AVX2-only CPU), resolved by load_workload")
    p.add_argument("--workload", default="fixed", choices=("fixed", "mixed"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="fixed: every prompt's length; mixed: lengths "
                   "uniform in [input_len/4, 2*input_len]")
    p.add_argument("--output-len", type=int, default=128, help="fixed workload output length")
    p.add_argument("--min-output-len", type=int, default=16, help="mixed workload")
    p.add_argument("--max-output-len", type=int, default=256, help="mixed workload")
    p.add_argument("--prompts-file", default=str(REPO_ROOT / "data" / "prompts.txt"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = torch default")


def load_texts(path: Path) -> list[str]:
    """Non-empty lines of ``path``, else the built-in prompts."""
    if path.is_file():
        lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
        if lines:
            return lines
    return list(BUILTIN_PROMPTS)


def build_workload(tokenizer: Any, texts: list[str], args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    """Prompt token ids and output lengths of ``args.workload``: ``fixed`` (every prompt ``input_len``
    tokens, every output ``output_len``) or ``mixed`` (input lengths uniform in ``[input_len/4,
    2*input_len]``, output lengths in ``[min_output_len, max_output_len]``, seeded). Prompt ``i`` starts with
    text ``i``; later texts are appended as filler, then it is cut to its length."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.workload == "fixed":
        input_lens = [args.input_len] * n
        output_lens = [args.output_len] * n
    else:
        lo_in = max(8, args.input_len // 4)
        input_lens = [rng.randint(lo_in, 2 * args.input_len) for _ in range(n)]
        output_lens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(n)]
    encoded = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    newline = tokenizer("\n", add_special_tokens=False).input_ids
    prompts = []
    for i, length in enumerate(input_lens):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += encoded[j % len(encoded)] + newline
            j += 1
        prompts.append(ids[:length])
    return prompts, output_lens


def load_workload(args: argparse.Namespace) -> tuple[str, Any, list[list[int]], list[int]]:
    """``args.model``'s local path and tokenizer (no download), and :func:`build_workload`'s prompt
    token ids and output lengths for ``args``; ``args.dtype`` ``auto`` is resolved (:func:`bench_dtype`).

    Raises:
        FileNotFoundError: the model or ``args.prompts_file`` is not on this machine.
    """
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path

    path = resolve_model_path(args.model)
    if getattr(args, "dtype", None) == "auto":
        args.dtype = bench_dtype(args.model, "auto")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts, out_lens = build_workload(tokenizer, load_texts(Path(args.prompts_file)), args)
    return path, tokenizer, prompts, out_lens


def bench_dtype(model: str, dtype: str) -> str:
    """``--dtype auto`` -> the dtype servelab's ``dtype=auto`` runs ``model`` in on this CPU
    (``framework.platform.choose_dtype``: the checkpoint's, float32 for a 16-bit checkpoint on a CPU without
    native 16-bit instructions), printed with the reason, so every system of a benchmark (vLLM and
    transformers included) runs the dtype that is fast here; an explicit dtype is returned as is.

    Raises:
        FileNotFoundError, ModuleNotFoundError: ``auto`` and the model is not on this machine.
    """
    if dtype != "auto":
        return dtype
    from framework import EngineConfig
    from framework.engine.builder import dtype_choice

    choice = dtype_choice(EngineConfig(model=model))
    print(f"--dtype auto: {choice.dtype} ({choice.reason})", flush=True)
    return choice.dtype


def set_thread_env(threads: int) -> None:
    """``OMP_NUM_THREADS`` = ``MKL_NUM_THREADS`` = ``threads`` in this process's environment (0: unchanged):
    for the OpenMP/MKL runtimes loaded after this call (torch) and for child processes."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)


def reset_prefix_cache(llm: Any) -> None:
    """Drop the prefix cache of a servelab ``LLM``, so the next generate finds only the prefixes its
    own prompts share (as ``bench_vs_vllm.py`` does before every measured generate).

    Raises:
        RuntimeError: the engine refused the reset (it still held KV blocks).
    """
    if llm.engine.scheduler.kv.reset_prefix_cache() is False:
        raise RuntimeError("prefix-cache reset refused: the engine still holds KV blocks")


# ---------------------------------------------------------------------------------------------
# provenance and reporting
# ---------------------------------------------------------------------------------------------
def code_state() -> dict[str, Any]:
    """Git commit, modified tracked files and short hashes of the hot-path files, for provenance."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    hot = ("framework/worker/model_runner.py", "plugins/attention/torch.py", "framework/sample/sampler.py",
           "framework/engine/llm_engine.py", "framework/core/scheduler.py")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "modified": [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()],
            "sha1": {f: hashlib.sha1((REPO_ROOT / f).read_bytes()).hexdigest()[:10] for f in hot
                     if (REPO_ROOT / f).is_file()}}


def machine_info() -> dict[str, Any]:
    """Platform, Python, CPU (model name and its dtype-relevant ISA flags: ``framework.platform``), cores,
    torch threads and library versions, for a benchmark's report."""
    import torch
    import transformers

    from framework.platform import cpu_isa

    isa = cpu_isa()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": isa.name,
            "isa": isa.summary(), "isa_flags": sorted(isa.flags),
            "num_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table: ``header``, the separator line, then one line per row (each cell as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path | None, report: Any) -> None:
    """Write ``report`` as indented JSON to ``path`` (``None``: nothing), creating its folder."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out a matplotlib figure and save it to ``path`` (120 dpi), creating its folder."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
