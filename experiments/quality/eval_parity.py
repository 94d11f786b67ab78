"""lm-evaluation-harness on servelab (``servelab eval``: ``local-completions`` against the served config) against
lm-eval's ``hf`` backend (transformers directly) on larger local tasks: per-document loglikelihood differences,
accuracy / perplexity of both, generated strings, and both backends' wall times.

The tasks are built from this repository (no hub): ``servelab_mc_large``, generated arithmetic questions with
four numeric choices (``--num-mc``, fixed seed); ``servelab_ppl_large``, rolling loglikelihood of the
paragraphs of ``README.md`` and ``docs/*.md`` (``--num-ppl``); ``servelab_gen_large``, greedy completions of
the same arithmetic questions (``--num-gen``), cut at a newline. They are written with their YAMLs into
``--out/tasks`` and run through ``eval.include_path``.
Hydra overrides after ``--`` go to ``servelab eval`` (e.g. ``-- attention.params.compile=false``).

    .venv/bin/python -m experiments.quality.eval_parity --model smollm2 --dtype float32 --out outputs/eval_parity
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from experiments.common import REPO_ROOT

TASKS = ("servelab_mc_large", "servelab_ppl_large", "servelab_gen_large")


def write_tasks(folder: Path, num_mc: int, num_ppl: int, num_gen: int, seed: int = 0) -> None:
    """The three tasks' JSONL files and YAMLs (absolute data paths) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    questions = []
    for _ in range(max(num_mc, num_gen)):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        op = rng.choice(["+", "-"])
        answer = a + b if op == "+" else a - b
        wrong = rng.sample([answer + d for d in (-10, -2, -1, 1, 2, 10)], 3)
        choices = [str(answer)] + [str(w) for w in wrong]
        rng.shuffle(choices)
        questions.append({"question": f"What is {a} {op} {b}?", "choices": choices,
                          "answer": choices.index(str(answer)), "target": str(answer)})
    paragraphs = []
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(block.split())
            if len(text) >= 200 and not text.startswith(("|", "```", "#")):
                paragraphs.append(text[:1500])
    _jsonl(folder / "mc.jsonl", questions[:num_mc])
    _jsonl(folder / "ppl.jsonl", [{"text": t} for t in paragraphs[:num_ppl]])
    _jsonl(folder / "gen.jsonl", questions[:num_gen])
    common = "test_split: test\nmetadata:\n  version: 1.0\n"
    (folder / "mc.yaml").write_text(
        f"task: servelab_mc_large\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n"
        "  - metric: acc_norm\n" + common)
    (folder / "ppl.yaml").write_text(
        f"task: servelab_ppl_large\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n" + common)
    (folder / "gen.yaml").write_text(
        f"task: servelab_gen_large\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \" {{target}}\"\ngeneration_kwargs:\n  until:\n    - \"\\n\"\n  max_gen_toks: 16\n"
        "  do_sample: false\n  temperature: 0.0\nmetric_list:\n  - metric: exact_match\n" + common)


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def run_servelab(args: argparse.Namespace, tasks_dir: Path, run_dir: Path) -> tuple[dict, dict, float]:
    """``servelab eval`` in a subprocess; (metrics.json, resps by (task, doc_id), wall seconds)."""
    cmd = [sys.executable, "-m", "framework.entrypoints.cli", "eval", f"model.path={args.model}", f"model.dtype={args.dtype}",
           f"engine.compile={args.compile}", "tracker=none", f"eval.tasks=[{','.join(TASKS)}]",
           f"eval.include_path={tasks_dir}", f"eval.batch_size={args.batch_size}",
           f"eval.num_concurrent={args.num_concurrent}", f"hydra.run.dir={run_dir}", *args.overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    samples = {}
    for line in (run_dir / "eval_samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        samples[(row["task"], row["doc_id"])] = row["resps"]
    return json.loads((run_dir / "metrics.json").read_text()), samples, wall


def run_hf(args: argparse.Namespace, tasks_dir: Path) -> tuple[dict, dict, float]:
    """lm-eval's ``hf`` backend in this process; (scores, resps by (task, doc_id), wall seconds incl. model load)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from framework.entrypoints.eval import flat_scores
    from framework.model_executor.model_loader import resolve_model_path

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": resolve_model_path(args.model), "dtype": args.dtype, "device": "cpu"},
        tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),  # local only
        batch_size=args.hf_batch_size,
        log_samples=True, random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    wall = time.perf_counter() - t0
    samples = {(t, s["doc_id"]): json.loads(json.dumps(s["resps"])) for t, rows in out["samples"].items() for s in rows}
    return flat_scores(out["results"]), samples, wall


def _numbers(tree: object) -> list[float]:
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in _numbers(item)]
    return [float(tree)] if isinstance(tree, (int, float)) and not isinstance(tree, bool) else []


def compare(ours: dict, hf: dict) -> dict:
    """Max per-document |loglikelihood difference| per task, and how many generated strings differ."""
    out: dict[str, float] = {}
    for key, resps in ours.items():
        task = key[0]
        if task == "servelab_gen_large":
            out["gen_strings_differing"] = out.get("gen_strings_differing", 0) + (resps != hf[key])
            continue
        diff = max(abs(a - b) for a, b in zip(_numbers(resps), _numbers(hf[key]), strict=True))
        out[f"{task}_max_abs_ll_diff"] = max(out.get(f"{task}_max_abs_ll_diff", 0.0), diff)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", default="false", help="engine.compile of the served engine")
    parser.add_argument("--num-mc", type=int, default=200)
    parser.add_argument("--num-ppl", type=int, default=60)
    parser.add_argument("--num-gen", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per completions request (servelab)")
    parser.add_argument("--num-concurrent", type=int, default=1, help="requests in flight (servelab)")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--out", default="outputs/eval_parity")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1:]  # Hydra overrides for `servelab eval`
    out = Path(args.out).resolve()
    write_tasks(out / "tasks", args.num_mc, args.num_ppl, args.num_gen)
    metrics, ours, servelab_s = run_servelab(args, out / "tasks", out / "servelab_run")
    hf_scores, hf, hf_s = run_hf(args, out / "tasks")
    record = {"model": args.model, "dtype": args.dtype, "servelab_wall_s": servelab_s, "hf_wall_s": hf_s,
              "servelab_eval_s": metrics["eval_s"], "servelab": metrics["eval"], "hf": hf_scores,
              "num_docs": {t: sum(1 for k in ours if k[0] == t) for t in TASKS}, **compare(ours, hf)}
    (out / "eval_parity.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()
