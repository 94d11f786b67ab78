"""Train an EAGLE-1 draft head for a target model on text the target generates itself (CPU).

EAGLE (Li et al., ICML 2024, Sec. 3.3 "Training"): the head sees the target's feature f_i (last
hidden state, after the final norm) and the embedding of the next token x_{i+1}, and learns to
predict f_{i+1}: a Smooth-L1 regression on the feature plus 0.1 x cross-entropy of the target's
LM head on the predicted feature against the target's own greedy token there (self-distillation,
since greedy acceptance is what the head is for). The cross-entropy uses a random quarter of the
positions of each batch (``--cls-fraction``): the vocabulary-wide LM head would otherwise take most
of the CPU time. Features get uniform noise U(-a, a) during
training, as in the paper, so the head tolerates its own prediction errors when it drafts on
predicted features.

Steps (each timed and printed):
  1. generate: the target continues synthetic prompts disjoint from ``data/prompts.txt`` (the
     benchmark prompts), half greedily, half sampled, through servelab itself, keeping the
     target's last hidden states of every position from those same forwards (the runner's
     ``keep_hidden_states``, as for EAGLE drafting: features in the serving dtype, no second pass);
  2. labels: the target's greedy token at every position (its LM head on the kept features);
  3. train: AdamW over padded causal batches until ``--train-seconds`` or ``--epochs``;
  4. save: ``--out`` in the published EAGLE layout (``config.json`` + ``pytorch_model.bin``);
  5. eval (``--eval``): greedy servelab run on ``data/prompts.txt`` (story models: fresh story
     openings) with ``spec_decode=eagle``, printing the acceptance rate and mean accepted length.

Examples:
  python -m experiments.quality.train_eagle --out outputs/eagle-smollm2            # SmolLM2-135M, <= 15 min
  python -m experiments.quality.train_eagle --model stories260K --out models/stories260K-eagle \\
      --num-sequences 512 --max-tokens 200 --train-seconds 120
Then: python run.py spec_decode=eagle spec_decode.params.model=outputs/eagle-smollm2
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

from experiments.common import REPO_ROOT  # noqa: E402

TOPICS = ["volcanoes", "bread baking", "the moon", "bicycles", "honeybees", "chess", "rain forests", "batteries",
          "the Roman empire", "photosynthesis", "jazz", "recycling", "earthquakes", "coffee", "sleep", "maps",
          "the internet", "glaciers", "vaccines", "trains", "solar panels", "octopuses", "gardening", "money",
          "the heart", "clouds", "origami", "electric cars", "dinosaurs", "tea", "rivers", "robots", "pyramids",
          "friendship", "music theory", "deserts", "the printing press", "whales", "mountains", "cheese",
          "airplanes", "the ocean tides", "birds' migration", "running", "spiders", "the alphabet", "bridges"]
PREAMBLES = ["", "", "You are a friendly travel agent. Keep every answer under four sentences. ",
             "You are a science teacher for middle-school students. Use simple words and one example. ",
             "You are a careful technical writer. Answer in a numbered list. ",
             "You are a helpful museum guide. Be warm, accurate and brief; admit when you do not know. ",
             "You are a cooking assistant. Give practical advice a beginner can follow at home. ",
             "You work at a bicycle repair shop. Explain the fix step by step, politely. ",
             "Act as a tutor. First restate the question in one line, then answer it. "]
TEMPLATES = ["Explain {t} to a curious twelve-year-old.", "Write a short story that involves {t}.",
             "List five interesting facts about {t}.", "What are the main advantages and drawbacks of {t}?",
             "Describe {t} in one paragraph, then give an example.", "Write a short poem about {t}.",
             "How would you teach a beginner about {t}? Give steps.", "Summarise the history of {t} briefly."]
STORY_STARTS = ["Once upon a time, there was a {a} {n}", "One day, {p} found a {a} {n}", "{p} wanted a {a} {n}.",
                "{p} and {q} went to the park. They saw a {a} {n}", "The {a} {n} was sad because",
                "{p} liked to play with the {n}. One day", "There was a {a} {n} who lived in a"]
NAMES = ["Lily", "Tim", "Ben", "Sue", "Max", "Anna", "Tom", "Mia", "Sam", "Zoe"]
ADJS = ["big", "little", "red", "happy", "shiny", "old", "funny", "kind", "tiny", "blue"]
NOUNS = ["dog", "ball", "tree", "cat", "car", "bird", "box", "cake", "boat", "flower"]


def training_prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    """``n`` synthetic prompt token ids (chat-templated when the tokenizer has a template)."""
    rng = random.Random(seed)
    if getattr(tokenizer, "chat_template", None):
        texts = [rng.choice(PREAMBLES) + rng.choice(TEMPLATES).format(t=rng.choice(TOPICS)) for _ in range(n)]
        return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                        tokenize=False), add_special_tokens=False).input_ids
                for t in texts]
    texts = [rng.choice(STORY_STARTS).format(a=rng.choice(ADJS), n=rng.choice(NOUNS), p=rng.choice(NAMES),
                                             q=rng.choice(NAMES)) for _ in range(n)]
    return [tokenizer(t).input_ids for t in texts]


def generate(model: str, prompts: list[list[int]], max_tokens: int, temperature: float, dtype: str,
             seed: int) -> tuple[list[list[int]], list[torch.Tensor], Any]:
    """Prompt + continuation token ids for every prompt, generated by servelab, and the target's
    last hidden states ``(T - 1, hidden) float32`` of every computed position, taken from the same
    forwards (the runner's ``keep_hidden_states``: no second pass over the text). Every other
    prompt is continued greedily, the rest sampled at ``temperature`` (top-p 0.95). Also returns
    the engine's model (for its embedding and LM head)."""
    from framework import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, seed=seed, max_num_seqs=64, grammar="none", enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.keep_hidden_states = True
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}  # request -> (first position, rows) in step order
    execute = runner.execute_model

    def capture(scheduler_output: Any) -> Any:
        out = execute(scheduler_output)
        hs = out.hidden_states
        if hs is not None:
            for i, rid in enumerate(hs.request_ids):
                lo, hi = int(hs.query_start_loc[i]), int(hs.query_start_loc[i + 1])
                rows.setdefault(rid, []).append((int(hs.context_lens[i]), hs.hidden_states[lo:hi].float().clone()))
        return out

    runner.execute_model = capture
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else temperature, top_p=0.95, max_tokens=max_tokens)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seqs, feats = [], []
    for p, o in zip(prompts, outs):
        seqs.append(p + list(o.outputs[0].token_ids))
        f = torch.zeros(len(seqs[-1]) - 1, runner.model.config.hidden_size)
        for start, chunk in rows[o.request_id]:  # a recompute after preemption rewrites the same rows
            f[start:start + len(chunk)] = chunk[:max(0, len(f) - start)]
        feats.append(f)
    return seqs, feats, llm.engine.runner.model


@torch.no_grad()
def with_labels(seqs: list[list[int]], feats: list[torch.Tensor], lm_head: Any,
                chunk: int = 4096) -> list[tuple[torch.Tensor, ...]]:
    """Per sequence: token ids ``(T,) int64``, features ``(T - 1, hidden) float32`` and the target's
    greedy labels ``(T - 1,) int64`` (label t = argmax of the LM head on feature t)."""
    weight = lm_head.weight.float()
    out = []
    for seq, f in zip(seqs, feats):
        labels = torch.cat([(f[i:i + chunk] @ weight.T).argmax(-1) for i in range(0, len(f), chunk)])
        out.append((torch.tensor(seq), f, labels))
    return out


def batches(data: list[tuple[torch.Tensor, ...]], batch: int, max_len: int, rng: random.Random):
    """Padded training batches of windows of at most ``max_len`` pairs: (ids, feats, target feats,
    labels, valid mask), pair i = (x_{i+1}, f_i) -> (f_{i+1}, label_{i+1})."""
    windows = []
    for ids, feats, labels in data:  # feats/labels: positions 0 .. len(ids) - 2
        for a in range(0, len(feats) - 1, max_len):
            b = min(a + max_len, len(feats) - 1)
            if b - a >= 2:
                windows.append((ids[a + 1:b + 1], feats[a:b], feats[a + 1:b + 1], labels[a + 1:b + 1]))
    rng.shuffle(windows)
    for s in range(0, len(windows), batch):
        group = windows[s:s + batch]
        width = max(len(w[0]) for w in group)
        hidden = group[0][1].shape[1]
        x = torch.zeros(len(group), width, dtype=torch.long)
        f = torch.zeros(len(group), width, hidden)
        y = torch.zeros(len(group), width, hidden)
        lab = torch.zeros(len(group), width, dtype=torch.long)
        valid = torch.zeros(len(group), width, dtype=torch.bool)
        for j, (wi, wf, wy, wl) in enumerate(group):
            n = len(wi)
            x[j, :n], f[j, :n], y[j, :n], lab[j, :n], valid[j, :n] = wi, wf, wy, wl, True
        yield x, f, y, lab, valid


def head_config(target_config: Any) -> Any:
    """A one-layer Llama config with the target's widths (the EAGLE-1 head shape)."""
    from transformers import LlamaConfig

    tc = target_config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 1e4)}
    return LlamaConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_hidden_layers=1,
                       num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                       head_dim=head_dim, rms_norm_eps=tc.rms_norm_eps, vocab_size=tc.vocab_size,
                       max_position_embeddings=tc.max_position_embeddings, rope_parameters=rope,
                       hidden_act=tc.hidden_act, attention_bias=False, mlp_bias=False,
                       bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id)


def train(head: Any, lm_head: Any, train_data: list, args: argparse.Namespace) -> None:
    """AdamW with linear warm-up; stops at ``args.train_seconds`` or ``args.epochs``."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng, t0, step = random.Random(args.seed), time.perf_counter(), 0
    for epoch in range(args.epochs):
        for x, f, y, lab, valid in batches(train_data, args.batch_size, args.max_len, rng):
            if time.perf_counter() - t0 > args.train_seconds:
                print(f"  time budget reached after {step} steps ({epoch} full epochs)")
                return
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / 50)
            noisy = f + (torch.rand_like(f) * 2 - 1) * args.noise
            pos = torch.arange(x.shape[1])[None].expand_as(x)
            pred = head(x, pos, noisy)
            reg = F.smooth_l1_loss(pred[valid], y[valid])
            # the LM head (hidden x vocab) dominates a step; its loss uses a random subset of rows
            rows = torch.nonzero(valid.flatten()).squeeze(1)
            rows = rows[torch.randperm(len(rows))[:max(1, int(len(rows) * args.cls_fraction))]]
            cls = F.cross_entropy(lm_head(pred.flatten(0, 1)[rows]), lab.flatten()[rows])
            loss = reg + args.cls_weight * cls
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            if step % 50 == 0:
                with torch.no_grad():
                    acc = (lm_head(pred.flatten(0, 1)[rows]).argmax(-1) == lab.flatten()[rows]).float().mean().item()
                print(f"  step {step:5d} epoch {epoch} loss {loss.item():.4f} (reg {reg.item():.4f} "
                      f"cls {cls.item():.3f}) top-1 {acc:.3f}  {time.perf_counter() - t0:6.0f}s", flush=True)
            step += 1
    print(f"  {args.epochs} epochs done after {step} steps")


@torch.no_grad()
def top1(head: Any, lm_head: Any, data: list, args: argparse.Namespace) -> float:
    """Fraction of held-out pairs whose first draft (from the target's true feature) is the target's
    greedy token: an upper bound on the first draft position's acceptance."""
    hits = total = 0
    for x, f, _, lab, valid in batches(data, args.batch_size, args.max_len, random.Random(0)):
        pred = head(x, torch.arange(x.shape[1])[None].expand_as(x), f)
        hits += (lm_head(pred[valid]).argmax(-1) == lab[valid]).sum().item()
        total += valid.sum().item()
    return hits / max(total, 1)


def evaluate(model: str, out: str, dtype: str, k: int, num_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Greedy servelab run with the new head on ``data/prompts.txt`` (chat models) or on story
    openings of another seed (story models); the spec-decode summary."""
    from experiments.offline.bench_spec_decode import build_prompts
    from framework import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, drafter="eagle", drafter_params={"model": out, "num_speculative_tokens": k},
              grammar="none")
    tok = llm.get_tokenizer()
    if getattr(tok, "chat_template", None):  # the benchmark's chat prompts (never trained on)
        prompts = build_prompts("chat", tok, num_prompts, str(REPO_ROOT / "data" / "prompts.txt"))
    else:  # story models: fresh story openings (another seed than training)
        prompts = training_prompts(tok, num_prompts, seed=10_000)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return llm.engine.metrics.summary()


def add_generation_args(p: argparse.ArgumentParser, layout: str, batch_size: int) -> None:
    """The options every drafter-training script shares: the target, the output folder (``layout``: the format
    written), the generation pass that makes the training data and the training budget (seconds, epochs,
    ``batch_size`` sequences or pairs per step)."""
    p.add_argument("--model", default="smollm2", help="target: smollm2, stories260K or a folder")
    p.add_argument("--out", required=True, help=f"output folder ({layout} layout)")
    p.add_argument("--num-sequences", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=160, help="generated tokens per sequence")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--gen-dtype", default="bfloat16", help="dtype of the generation pass")
    p.add_argument("--train-seconds", type=float, default=480.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=batch_size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_generation_args(p, "EAGLE", batch_size=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.1, help="uniform feature noise amplitude (EAGLE: 0.1)")
    p.add_argument("--cls-weight", type=float, default=0.1)
    p.add_argument("--cls-fraction", type=float, default=0.25,
                   help="fraction of positions per batch in the cross-entropy term (the LM head is the cost)")
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of sequences held out for top-1")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", action="store_true", help="measure acceptance on data/prompts.txt afterwards")
    p.add_argument("--eval-k", type=int, default=4)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path
    from plugins.spec_decode._eagle_head import EagleHead, save_head

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = training_prompts(tokenizer, args.num_sequences, args.seed)
    seqs, feats, model = generate(path, prompts, args.max_tokens, args.temperature, args.gen_dtype, args.seed)
    t_gen = time.perf_counter()
    print(f"1. generated {sum(len(s) for s in seqs)} tokens in {len(seqs)} sequences, with their target features: "
          f"{t_gen - t_start:.0f}s")
    embed = torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().float(), freeze=True)
    lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    lm_head.weight = torch.nn.Parameter(model.get_output_embeddings().weight.detach().float(), requires_grad=False)
    target_config = model.config
    del model
    data = with_labels(seqs, feats, lm_head)
    t_feat = time.perf_counter()
    print(f"2. greedy labels of {sum(len(d[1]) for d in data)} positions: {t_feat - t_gen:.0f}s")
    random.Random(args.seed).shuffle(data)
    n_hold = max(1, int(len(data) * args.holdout))
    held, train_data = data[:n_hold], data[n_hold:]
    config = head_config(target_config)
    config._attn_implementation = "sdpa"  # causal, no padding mask needed (padding is on the right)
    head = EagleHead(config, embed, bias=True)
    train(head, lm_head, train_data, args)
    t_train = time.perf_counter()
    head.eval()
    acc = top1(head, lm_head, held, args)
    print(f"3. trained {sum(p.numel() for p in head.head_state_dict().values())} parameters: "
          f"{t_train - t_feat:.0f}s; held-out first-draft top-1 {acc:.3f}")
    save_head(head, args.out)
    print(f"4. saved {args.out} (total {time.perf_counter() - t_start:.0f}s = {(time.perf_counter() - t_start) / 60:.1f} min)")
    if args.eval:
        s = evaluate(path, args.out, args.gen_dtype, args.eval_k, 32, 128)
        print(f"5. eval k={args.eval_k}, greedy, 32 held-out prompts x 128 tokens: acceptance rate "
              f"{s['spec_acceptance_rate']:.3f}, mean accepted length {s['spec_mean_accepted_length']:.2f}, "
              f"tokens per forward {s['tokens_per_forward']:.2f}")


if __name__ == "__main__":
    main()
