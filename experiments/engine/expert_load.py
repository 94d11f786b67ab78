"""Expert load per MoE layer, and what EPLB makes of it: tokens routed to each expert, a heatmap, and each
layer's busiest-rank load under the identity placement (vLLM's default EP layout) against EPLB's
(``framework/model_executor/eplb.py``).

The load is what an expert-parallel engine's ``expert_load`` counts (``framework/model_executor/expert_parallel.py``:
every token's top-k choices), measured here in one process through transformers' own experts modules, so no
ranks are needed. Writes ``expert_load.json`` (``expert_load``: per layer, per expert token counts; the max rank
load before / after EPLB) and ``expert_load.png``.

    .venv/bin/python -m experiments.engine.expert_load --model <MoE folder> --ranks 2 --num-redundant-experts 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from framework.model_executor.eplb import default_maps, max_rank_load, rebalance_experts


@torch.inference_mode()
def measure_expert_load(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """``(num_moe_layers, num_experts)`` int64: tokens routed to each expert while greedy ``generate`` runs
    each prompt (prompt tokens and generated ones), counted from each experts module's ``top_k_index``.

    Raises:
        ValueError: the model has no experts module (a dense model).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]
    if not experts:
        raise ValueError(f"{model_dir} has no experts modules: expert load needs a mixture-of-experts model")
    load = torch.zeros(len(experts), experts[0].num_experts, dtype=torch.int64)

    def counter(layer: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            load[layer] += torch.bincount(args[1].flatten(), minlength=load.shape[1])
        return hook

    handles = [module.register_forward_pre_hook(counter(i)) for i, module in enumerate(experts)]
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    return load


def eplb_summary(load: torch.Tensor, num_ranks: int, num_redundant_experts: int) -> dict[str, list[float]]:
    """Per layer, the busiest rank's load (tokens) under the identity placement and under EPLB's maps."""
    num_layers, num_experts = load.shape
    identity = default_maps(num_layers, num_experts, num_experts, num_ranks)
    balanced = rebalance_experts(load, num_experts + num_redundant_experts, num_ranks)
    return {"max_rank_load_identity": max_rank_load(load, identity, num_ranks).tolist(),
            "max_rank_load_eplb": max_rank_load(load, balanced, num_ranks).tolist(),
            "mean_rank_load": (load.sum(-1).float() / num_ranks).tolist()}


def plot_expert_load(load: torch.Tensor, summary: dict[str, list[float]], path: str | Path) -> Path:
    """A heatmap of ``load (layers, experts)`` beside each layer's busiest-rank load (identity, EPLB, mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (heat, bars) = plt.subplots(1, 2, figsize=(11, 0.5 * load.shape[0] + 2.5))
    image = heat.imshow(load.numpy(), aspect="auto", cmap="viridis")
    heat.set(xlabel="expert", ylabel="MoE layer", title="tokens routed per expert")
    fig.colorbar(image, ax=heat)
    layers = range(load.shape[0])
    for key, label in (("max_rank_load_identity", "busiest rank, identity"), ("max_rank_load_eplb", "busiest rank, EPLB"),
                       ("mean_rank_load", "mean rank")):
        bars.plot(summary[key], list(layers), marker="o", label=label)
    bars.set(xlabel="tokens", ylabel="MoE layer", title="load per rank")
    bars.invert_yaxis()
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> dict:
    """Measure, summarise and plot; returns what ``expert_load.json`` holds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local MoE model folder (Mixtral, Qwen3-MoE, OLMoE...)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-redundant-experts", type=int, default=2)
    parser.add_argument("--out", default=".", help="folder for expert_load.json and expert_load.png")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    load = measure_expert_load(args.model, prompts, args.max_tokens)
    result = {"model": args.model, "ranks": args.ranks, "num_redundant_experts": args.num_redundant_experts,
              "expert_load": load.tolist(), **eplb_summary(load, args.ranks, args.num_redundant_experts)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "expert_load.json").write_text(json.dumps(result, indent=1))
    plot_expert_load(load, result, out / "expert_load.png")
    print(json.dumps({k: v for k, v in result.items() if k != "expert_load"}))
    return result


if __name__ == "__main__":
    main()
