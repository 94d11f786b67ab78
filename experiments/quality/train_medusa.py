"""Train Medusa-1 heads for a target model on text the target generates itself (CPU).

Medusa (Cai et al., ICML 2024, Sec. 2.2.1 "Training Strategies", Medusa-1: frozen backbone): head ``k`` (0-based)
reads the target's last hidden state ``h_t`` and learns, by cross-entropy, the token ``k + 2`` positions ahead; the
losses are weighted ``lambda_k = 0.8 ** k``. As in Medusa's self-distillation (Sec. 2.3.2) the text and the labels are
the target's own: the labels are the target's greedy token at each position (what greedy verification accepts).
Each head's LM head starts as a copy of the target's and its residual blocks as the identity (zero weights), so an
untrained head predicts the next token, as in Medusa's code.

Steps (each timed and printed):
  1. generate: the target continues synthetic prompts (``experiments.quality.train_eagle``'s), half greedily, half
     sampled, keeping its last hidden states of every position from those same forwards;
  2. labels: the target's greedy token at every position (its LM head on the kept features);
  3. train: AdamW over random batches of positions until ``--train-seconds`` or ``--epochs``;
  4. save: ``--out`` in the public Medusa layout (``config.json`` + ``medusa_lm_head.safetensors``);
  5. eval (``--eval``): greedy servelab run on fresh prompts with ``spec_decode=medusa`` and the default tree.

Examples:
  python -m experiments.quality.train_medusa --model stories260K --out models/stories260K-medusa \\
      --num-sequences 512 --max-tokens 200 --train-seconds 120
  python -m experiments.quality.train_medusa --out outputs/medusa-smollm2 --train-seconds 600 --eval
Then: python run.py spec_decode=medusa spec_decode.params.model=outputs/medusa-smollm2
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from experiments.quality.train_eagle import add_generation_args, generate, training_prompts, with_labels  # noqa: E402

LOSS_DECAY = 0.8  # lambda_k = 0.8 ** k (Medusa, Sec. 2.2.1)


def pairs(data: list[tuple[torch.Tensor, ...]], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position with a label for every head: features ``(N, hidden) float32`` and labels ``(N, num_heads)``
    int64, label ``k`` = the target's greedy token ``k + 2`` positions after the feature's."""
    feats, labels = [], []
    for _, f, lab in data:  # lab[t] = greedy token after position t (predicted from f[t])
        n = len(f) - num_heads
        if n <= 0:
            continue
        feats.append(f[:n])
        labels.append(torch.stack([lab[k + 1:k + 1 + n] for k in range(num_heads)], dim=1))
    return torch.cat(feats), torch.cat(labels)


def train(heads: Any, feats: torch.Tensor, labels: torch.Tensor, args: argparse.Namespace) -> None:
    """AdamW with linear warm-up on the weighted per-head cross-entropies; stops at ``args.train_seconds`` or
    ``args.epochs``."""
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    weights = torch.tensor([LOSS_DECAY ** k for k in range(labels.shape[1])])
    gen, t0, step = torch.Generator().manual_seed(args.seed), time.perf_counter(), 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(feats), generator=gen)
        for s in range(0, len(order), args.batch_size):
            if time.perf_counter() - t0 > args.train_seconds:
                print(f"  time budget reached after {step} steps ({epoch} full epochs)")
                return
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / 50)
            idx = order[s:s + args.batch_size]
            logits = heads(feats[idx])  # (K, B, vocab)
            losses = torch.stack([F.cross_entropy(logits[k], labels[idx, k]) for k in range(len(weights))])
            loss = (weights * losses).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 100 == 0:
                print(f"  step {step:5d} epoch {epoch} loss {loss.item():.4f} per head "
                      f"{[round(x, 3) for x in losses.tolist()]}  {time.perf_counter() - t0:5.0f}s", flush=True)
            step += 1
    print(f"  {args.epochs} epochs done after {step} steps")


@torch.no_grad()
def top1(heads: Any, feats: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per head, the fraction of held-out positions whose top guess is the target's greedy token."""
    return (heads(feats).argmax(-1) == labels.T).float().mean(dim=1).tolist()


def evaluate(model: str, out: str, dtype: str, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Greedy servelab run with the new heads and ``conf/spec_decode/medusa.yaml``'s tree on fresh story or chat
    prompts (another seed than training); the spec-decode summary."""
    import yaml

    from experiments.common import REPO_ROOT
    from framework import LLM, SamplingParams

    tree = yaml.safe_load((REPO_ROOT / "conf" / "spec_decode" / "medusa.yaml").read_text())["params"]["tree"]
    llm = LLM(model=model, dtype=dtype, drafter="medusa", drafter_params={"model": out, "tree": tree}, grammar="none")
    prompts = training_prompts(llm.get_tokenizer(), num_prompts, seed=10_000)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return llm.engine.metrics.summary()


def main(argv: list[str] | None = None) -> None:
    """Generate, label, train, save (and evaluate) Medusa heads; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_generation_args(p, "Medusa", batch_size=256)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head (Medusa-1: 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of sequences held out for top-1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", action="store_true", help="measure acceptance on fresh prompts afterwards")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path
    from plugins.spec_decode._medusa_heads import MedusaConfig, MedusaHeads, save_medusa_heads

    path = resolve_model_path(args.model)
    prompts = training_prompts(AutoTokenizer.from_pretrained(path), args.num_sequences, args.seed)
    seqs, feats, model = generate(path, prompts, args.max_tokens, args.temperature, args.gen_dtype, args.seed)
    t_gen = time.perf_counter()
    print(f"1. generated {sum(len(s) for s in seqs)} tokens in {len(seqs)} sequences: {t_gen - t_start:.0f}s")
    lm_weight = model.get_output_embeddings().weight.detach().float()
    lm_head = torch.nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=False)
    lm_head.weight = torch.nn.Parameter(lm_weight, requires_grad=False)
    del model
    data = with_labels(seqs, feats, lm_head)
    random.Random(args.seed).shuffle(data)
    n_hold = max(1, int(len(data) * args.holdout))
    held, train_data = pairs(data[:n_hold], args.num_heads), pairs(data[n_hold:], args.num_heads)
    t_lab = time.perf_counter()
    print(f"2. greedy labels of {len(train_data[0]) + len(held[0])} positions: {t_lab - t_gen:.0f}s")
    heads = MedusaHeads(MedusaConfig(args.num_heads, args.num_layers, lm_weight.shape[1], lm_weight.shape[0]))
    with torch.no_grad():
        for head in heads.heads:  # Medusa's initialisation: each head's LM head is the target's
            head[-1].weight.copy_(lm_weight)
    train(heads, *train_data, args)
    heads.eval()
    print(f"3. trained {sum(p.numel() for p in heads.parameters())} parameters: {time.perf_counter() - t_lab:.0f}s; "
          f"held-out top-1 per head {[round(x, 3) for x in top1(heads, *held)]}")
    save_medusa_heads(heads, args.out, base_model=str(args.model))
    print(f"4. saved {args.out} (total {time.perf_counter() - t_start:.0f}s)")
    if args.eval:
        s = evaluate(path, args.out, args.gen_dtype, 32, 128)
        print(f"5. eval, greedy, 32 held-out prompts x 128 tokens: mean accepted length "
              f"{s['spec_mean_accepted_length']:.2f}, acceptance by depth "
              f"{[round(x, 3) for x in s['spec_acceptance_by_position']]}, tokens per forward "
              f"{s['tokens_per_forward']:.2f}")


if __name__ == "__main__":
    main()
