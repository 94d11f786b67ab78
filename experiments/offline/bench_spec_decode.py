"""Speculative decoding benchmark: no speculation vs each drafter x k, with transformers' assisted
generation as the peer, on the same prompts and output lengths in one process.

Systems (greedy, ``ignore_eos``, every request emits exactly ``--output-len`` tokens):

* ``ours_nospec``        ``LLM(...).generate`` without a drafter;
* ``ours_<drafter>_k<k>`` the same with ``drafter=<drafter>`` and ``num_speculative_tokens=k``;
* ``hf_nospec``          ``model.generate`` one prompt at a time (batch 1 only);
* ``hf_prompt_lookup_k<k>`` ``model.generate(prompt_lookup_num_tokens=k)`` (transformers' n-gram
  assisted generation; batch 1 only, transformers does not batch assisted generation);
* ``hf_assisted_k<k>``   ``model.generate(assistant_model=draft, num_assistant_tokens=k,
  num_assistant_tokens_schedule="constant")`` when ``--draft-model`` is given (batch 1 only).

Batch 1 runs the prompts one after another; batch N submits N at a time to ``generate``.
Workloads: ``chat`` (the shipped ``data/prompts.txt``, chat template when the tokenizer has one)
and ``grounded`` (a passage from the same file, then "Repeat the passage above word for word and
then continue it"), where prompt lookup should shine. Printed: output tok/s, acceptance rate, mean
accepted length, speed-up over ``ours_nospec`` and over the transformers system of the same kind.

Drafters: ``ngram``, ``draft_model`` (needs ``--draft-model PATH``) and ``eagle`` (needs
``--eagle-model PATH``, e.g. ``models/stories260K-eagle`` or a head from
``experiments/quality/train_eagle.py``). transformers has no EAGLE generation, so ``eagle`` rows are
compared with ``hf_nospec`` only.

``--trees`` runs the token-tree comparison instead, in one run: per tree drafter (``medusa``, ``eagle``), no
speculation vs its chain (``num_speculative_tokens``) vs a static tree (``--static-tree``: Medusa choice paths; for
``eagle`` its chain plus sibling leaves, ``--eagle-static-tree``) vs a dynamic tree (EAGLE-2, ``tree=dynamic``;
``eagle`` only), at each ``--batch-sizes`` (default there 1,4,16). Printed per row: drafts accepted per verify step
(mean accepted length), tokens per verify step (accepted + the target's own), output tok/s, and the CPU model and
ISA. Medusa heads exist for stories260K only (``models/stories260K-medusa``): with another ``--model`` and no
``--medusa-model`` the medusa rows run on stories260K and the output says so (train SmolLM2 heads with
``python -m experiments.quality.train_medusa --out outputs/medusa-smollm2 --eval``). EAGLE on SmolLM2 needs
``--eagle-model`` (``experiments/quality/train_eagle.py``); without it the eagle rows run on stories260K too.

Example (the lead's quiet-machine run)::

    .venv/bin/python -m experiments.offline.bench_spec_decode --model smollm2 --dtype bfloat16 --threads 2 \
        --workloads chat,grounded --batch-sizes 1,16 --ks 1,2,4 --num-prompts 16 --output-len 128 \
        --json-out experiments/results/spec_decode.json
    .venv/bin/python -m experiments.offline.bench_spec_decode --trees --model smollm2 --dtype bfloat16 --threads 2 \
        --workloads chat --num-prompts 16 --output-len 64 --eagle-model outputs/eagle-smollm2 \
        --json-out experiments/results/spec_trees.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from experiments.common import REPO_ROOT, bench_dtype, machine_info  # noqa: E402

GROUNDED_INSTRUCTION = "\n\nRepeat the passage above word for word, then continue it:\n"
STORIES = "stories260K"
#: heads shipped for stories260K (``models/README.md``)
SHIPPED_HEADS = {"medusa": str(REPO_ROOT / "models" / "stories260K-medusa"),
                 "eagle": str(REPO_ROOT / "models" / "stories260K-eagle")}
MEDUSA_TREE = "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,0,0,0]]"
EAGLE_TREE = "[[0],[1],[2],[0,0],[0,1],[0,0,0],[0,0,1]]"  # the chain plus sibling leaves (draft passes: 3)


def resolve_model(name: str) -> str:
    """A model alias (``smollm2``, ``stories260K``, ...) or folder -> local HF folder, via the engine's
    own resolver (:func:`framework.model_executor.model_loader.resolve_model_path`), so transformers peers load the
    same weights offline."""
    from framework.model_executor.model_loader import resolve_model_path

    return resolve_model_path(name)


def build_prompts(workload: str, tokenizer: Any, num_prompts: int, prompts_file: str) -> list[list[int]]:
    """Prompt token ids of ``workload`` (``chat`` or ``grounded``), ``num_prompts`` of them."""
    lines = [ln.strip() for ln in Path(prompts_file).read_text().splitlines() if ln.strip()]
    texts = []
    for i in range(num_prompts):
        line = lines[i % len(lines)]
        if workload == "grounded":
            passage = " ".join(lines[(i + j) % len(lines)] for j in range(2))
            line = passage + GROUNDED_INSTRUCTION
        texts.append(line)
    if getattr(tokenizer, "chat_template", None):
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=False) for t in texts]
        return [tokenizer(r, add_special_tokens=False).input_ids for r in rendered]
    return [tokenizer(t).input_ids for t in texts]


def run_ours(model: str, dtype: str, prompts: list[list[int]], batch: int, output_len: int,
             drafter: str = "none", k: int = 0, draft_model: str | None = None,
             eagle_model: str | None = None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Output tok/s and speculation stats of our engine over ``prompts``, ``batch`` at a time (``params``: the
    drafter's whole ``spec_decode.params``, else built from ``k`` and the drafter's model)."""
    from framework import LLM, SamplingParams

    if params is None:
        params = {"num_speculative_tokens": k} if drafter != "none" else {}
        if drafter == "draft_model":
            params["model"] = draft_model
        if drafter == "eagle":
            params["model"] = eagle_model
    llm = LLM(model=model, dtype=dtype, drafter=drafter, drafter_params=params, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=4))  # warmup
    # engine.compile=auto decides on the whole workload up front (as one generate call of every prompt would), so
    # a compile it pays for happens before the clock starts, not inside one system's timed loop
    llm.engine.maybe_compile([output_len] * len(prompts))
    llm.engine.metrics.reset()  # the warm-up's steps do not count
    n_out, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], sp)
        n_out += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    s = llm.engine.metrics.summary()
    return {"output_tok_s": n_out / wall, "wall_s": wall, "acceptance": s.get("spec_acceptance_rate"),
            "mean_accepted_len": s.get("spec_mean_accepted_length"), "tokens_per_forward": s["tokens_per_forward"],
            "draft_s": s.get("spec_draft_s"), "verify_s": s.get("spec_verify_s"),
            "num_draft_tokens": s.get("spec_num_draft_tokens")}


def run_hf(model: str, dtype: str, prompts: list[list[int]], output_len: int, k: int = 0,
           draft_model: str | None = None) -> dict[str, Any]:
    """transformers ``generate`` at batch 1: prompt lookup when ``k > 0``, assisted generation with
    ``draft_model`` when given."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    kwargs: dict[str, Any] = {"prompt_lookup_num_tokens": k} if k else {}
    if draft_model:
        kwargs = {"assistant_model": AutoModelForCausalLM.from_pretrained(draft_model, dtype=getattr(torch, dtype)),
                  "num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant"}
        hf.generation_config.num_assistant_tokens = k
    n_out, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            seq = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, **kwargs)
            n_out += seq.shape[1] - len(ids)
    wall = time.perf_counter() - t0
    return {"output_tok_s": n_out / wall, "wall_s": wall}


def tree_systems(args: argparse.Namespace, model: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """The ``--trees`` comparison's speculating systems: ``(target model folder, drafter, system, params)``, the
    chain, the static tree and (``eagle``) the dynamic tree of each tree drafter, each on the target its heads fit
    (a note printed where that is stories260K instead of ``--model``)."""
    stories = resolve_model(STORIES)
    on_stories = Path(model).resolve() == Path(stories).resolve()
    heads = {"medusa": args.medusa_model, "eagle": args.eagle_model}
    systems = []
    for drafter in ("medusa", "eagle"):
        target, head = model, heads[drafter]
        if head is None:
            head, target = SHIPPED_HEADS[drafter], stories
            if not on_stories:
                print(f"note: no {drafter} heads for {args.model} (--{drafter}-model): {drafter} runs on stories260K "
                      f"only, with {head}")
        static = json.loads(args.static_tree if drafter == "medusa" else args.eagle_static_tree)
        chain = {"model": head, "num_speculative_tokens": args.tree_depth}
        systems += [(target, drafter, "chain", chain), (target, drafter, "static_tree", {"model": head, "tree": static})]
        if drafter == "eagle":
            systems.append((target, drafter, "dynamic_tree", {**chain, "tree": "dynamic", "topk": args.topk,
                                                              "num_draft_tokens": args.num_draft_tokens}))
    return systems


def run_trees(args: argparse.Namespace) -> list[dict[str, Any]]:
    """No speculation vs chain vs static tree vs dynamic tree, per tree drafter and batch size (``--trees``)."""
    from transformers import AutoTokenizer

    machine = machine_info()
    print(f"CPU: {machine['cpu']} | ISA: {machine['isa']} | torch threads: {machine['torch_threads']}")
    workload = args.workloads.split(",")[0]
    systems = tree_systems(args, resolve_model(args.model))
    rows: list[dict[str, Any]] = []
    for target in dict.fromkeys(t for t, _, _, _ in systems):
        prompts = build_prompts(workload, AutoTokenizer.from_pretrained(target), args.num_prompts, args.prompts_file)
        dtype = bench_dtype(target, args.dtype)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            base = {"model": Path(target).name, "workload": workload, "batch": batch}
            rows.append({**base, "drafter": "none", "system": "nospec",
                         **run_ours(target, dtype, prompts, batch, args.output_len)})
            for _, drafter, system, params in (x for x in systems if x[0] == target):
                rows.append({**base, "drafter": drafter, "system": system,
                             **run_ours(target, dtype, prompts, batch, args.output_len, drafter, params=params)})
    for r in rows:
        r["accepted_per_step"] = None if r["mean_accepted_len"] is None else r["mean_accepted_len"] - 1
    _print_trees(rows, machine)
    return rows


def _print_trees(rows: list[dict[str, Any]], machine: dict[str, Any]) -> None:
    """The ``--trees`` table: accepted drafts and tokens per verify step, output tok/s, speed-up over no speculation."""
    table = Table(title=f"token trees (greedy) on {machine['cpu']} [{machine['isa']}]")
    for col in ("model", "batch", "drafter", "system", "accepted/step", "tok/verify step", "tok/s", "vs nospec"):
        table.add_column(col)
    fmt = (lambda v: "-" if v is None else f"{v:.2f}")  # noqa: E731
    for r in rows:
        nospec = next(x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"]
                      and x["system"] == "nospec")["output_tok_s"]
        table.add_row(r["model"], str(r["batch"]), r["drafter"], r["system"], fmt(r["accepted_per_step"]),
                      fmt(r["mean_accepted_len"]), f"{r['output_tok_s']:.1f}", f"{r['output_tok_s'] / nospec:.2f}x")
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", help="auto: the dtype servelab's dtype=auto picks on this CPU (float32 for bf16 on AVX2 only)")
    p.add_argument("--workloads", default="chat,grounded")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,16; with --trees 1,4,16)")
    p.add_argument("--ks", default="1,2,4")
    p.add_argument("--drafters", default="ngram", help="comma list of ngram,draft_model,eagle")
    p.add_argument("--draft-model", default=None, help="draft_model's model (e.g. stories260K-draft)")
    p.add_argument("--eagle-model", default=None, help="eagle's head folder (e.g. models/stories260K-eagle)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-file", default=str(REPO_ROOT / "data" / "prompts.txt"))
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--json-out", default=None)
    p.add_argument("--trees", action="store_true", help="the token-tree comparison (see the module docstring)")
    p.add_argument("--medusa-model", default=None, help="--trees: medusa heads for --model (else stories260K's)")
    p.add_argument("--static-tree", default=MEDUSA_TREE, help="--trees: medusa's static tree (JSON choice paths)")
    p.add_argument("--eagle-static-tree", default=EAGLE_TREE, help="--trees: eagle's static tree (JSON)")
    p.add_argument("--tree-depth", type=int, default=3, help="--trees: chain length and dynamic-tree depth")
    p.add_argument("--topk", type=int, default=4, help="--trees: EAGLE-2 expansion width")
    p.add_argument("--num-draft-tokens", type=int, default=16, help="--trees: EAGLE-2 nodes kept per tree")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batch_sizes = args.batch_sizes or ("1,4,16" if args.trees else "1,16")
    if args.trees:
        rows = run_trees(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": vars(args), "machine": machine_info(), "rows": rows},
                                                      indent=2))
        return rows
    args.dtype = bench_dtype(args.model, args.dtype)
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ks = [int(k) for k in args.ks.split(",")]
    draft = resolve_model(args.draft_model) if args.draft_model else None
    rows: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        prompts = build_prompts(workload, tokenizer, args.num_prompts, args.prompts_file)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            base = dict(workload=workload, batch=batch)
            rows.append({**base, "system": "ours_nospec", **run_ours(model, args.dtype, prompts, batch, args.output_len)})
            for drafter in args.drafters.split(","):
                for k in ks:
                    rows.append({**base, "system": f"ours_{drafter}_k{k}", "k": k,
                                 **run_ours(model, args.dtype, prompts, batch, args.output_len, drafter, k,
                                            draft, args.eagle_model)})
            if batch == 1 and not args.no_hf:
                rows.append({**base, "system": "hf_nospec", **run_hf(model, args.dtype, prompts, args.output_len)})
                for k in ks:
                    rows.append({**base, "system": f"hf_prompt_lookup_k{k}", "k": k,
                                 **run_hf(model, args.dtype, prompts, args.output_len, k)})
                    if draft:
                        rows.append({**base, "system": f"hf_assisted_k{k}", "k": k,
                                     **run_hf(model, args.dtype, prompts, args.output_len, k, draft)})
    _print(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    """One table: tok/s, acceptance, and speed-ups over ours_nospec and the transformers peer."""
    table = Table(title="speculative decoding (output tok/s, greedy)")
    for col in ("workload", "batch", "system", "tok/s", "accept", "accepted len", "tok/fwd", "vs nospec", "vs hf"):
        table.add_column(col)
    for r in rows:
        same = [x for x in rows if x["workload"] == r["workload"] and x["batch"] == r["batch"]]
        nospec = next(x for x in same if x["system"] == "ours_nospec")["output_tok_s"]
        peer_name = ({"ngram": f"hf_prompt_lookup_k{r.get('k')}", "draft_model": f"hf_assisted_k{r.get('k')}"}
                     .get(r["system"].split("_k")[0].removeprefix("ours_"), "hf_nospec"))
        peer = next((x["output_tok_s"] for x in same if x["system"] == peer_name), None)
        vs_hf = f"{r['output_tok_s'] / peer:.2f}x" if peer and r["system"].startswith("ours") else "-"
        fmt = (lambda v: "-" if v is None else f"{v:.2f}")  # noqa: E731
        table.add_row(r["workload"], str(r["batch"]), r["system"], f"{r['output_tok_s']:.1f}", fmt(r.get("acceptance")),
                      fmt(r.get("mean_accepted_len")), fmt(r.get("tokens_per_forward")),
                      f"{r['output_tok_s'] / nospec:.2f}x", vs_hf)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
