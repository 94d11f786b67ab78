"""Workloads: the requests one offline run feeds to the engine (a prompts file or random token ids)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from framework.workloads import synthetic as syn
from framework.workloads.item import MIN_RANDOM_TOKEN_ID, WorkloadItem

WORKLOADS = ("prompts", "random", "shared_prefix", "multi_turn", "long_tail")
def _read_records(path: Path) -> list[dict[str, Any]]:
    """Records ``{"prompt": ..., ...}`` of a ``.txt`` (one prompt per non-blank line) or ``.jsonl`` file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".txt":
        return [{"prompt": line.strip()} for line in lines if line.strip()]
    if path.suffix != ".jsonl":
        raise ValueError(f"workload file {path} must end in .txt (one prompt per line) or .jsonl")
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}:{lineno}: each line must be an object with a string "prompt"')
        records.append(record)
    return records


def render_chat(prompt: str, tokenizer: Any) -> str:
    """``prompt`` as a single user turn through the tokenizer's chat template, generation prompt added.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("workload.chat=true but the model's tokenizer has no chat template; "
                         "set workload.chat=false to send the prompts as plain text")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


def resolve_chat(chat: bool | str, tokenizer: Any) -> bool:
    """Whether prompts go through the chat template: ``"auto"`` = exactly when ``tokenizer`` has one.

    Raises:
        ValueError: ``chat`` is not ``"auto"``, ``True`` or ``False``.
    """
    if chat == "auto":
        return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if isinstance(chat, bool):
        return chat
    raise ValueError(f"workload.chat must be auto, true or false; got {chat!r}")


def load_prompts(path: str | Path, chat: bool | str, tokenizer: Any, limit: int | None = None) -> list[WorkloadItem]:
    """Read prompts from ``.txt`` (one per line) or ``.jsonl`` (``prompt``; optional ``priority``,
    ``max_tokens``, ``arrival_time_s``, ``request_id``, ``client_id``, ``structured_outputs``, ``lora``: an
    adapter name from ``lora.modules``).

    With ``chat`` (``True``, or ``"auto"`` on a tokenizer with a chat template) each prompt is
    rendered as a user turn by the chat template and tokenized here without adding special tokens
    again (the template already holds them); ``prompt`` keeps the rendered text and ``raw_prompt``
    the text as written.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad extension, bad JSONL line, bad ``chat``, or ``chat=True`` without a chat template.
    """
    chat = resolve_chat(chat, tokenizer)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload file not found: {path} (set workload.path=<file>)")
    records = _read_records(path)[:limit] if limit is not None else _read_records(path)
    items = []
    for i, rec in enumerate(records):
        text, token_ids = rec["prompt"], None
        if chat:
            text = render_chat(text, tokenizer)
            token_ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        items.append(WorkloadItem(request_id=str(rec.get("request_id", f"prompt-{i}")), prompt=text,
                                  raw_prompt=rec["prompt"],
                                  prompt_token_ids=token_ids, priority=int(rec.get("priority", 0)),
                                  max_tokens=rec.get("max_tokens"), arrival_time_s=rec.get("arrival_time_s"),
                                  client_id=rec.get("client_id"),
                                  structured_outputs=rec.get("structured_outputs"), lora=rec.get("lora")))
    return items


def random_workload(num_prompts: int, input_len_min: int, input_len_max: int, output_len_min: int,
                    output_len_max: int, seed: int, vocab_size: int,
                    request_rate: float | None = None) -> list[WorkloadItem]:
    """Seeded random token-id prompts with uniform lengths (vLLM ``benchmark_serving --dataset random``).

    Args:
        input_len_min, input_len_max: prompt length range, tokens, inclusive.
        output_len_min, output_len_max: per-request ``max_tokens`` range, inclusive.
        vocab_size: ids are drawn from ``[3, vocab_size)`` (no unk/bos/eos).
        request_rate: Poisson arrivals at this many requests/s; ``None`` or ``inf`` = all at start.

    Raises:
        ValueError: empty or inverted ranges, ``vocab_size <= 3``, ``request_rate <= 0``.
    """
    if num_prompts < 0 or not 1 <= input_len_min <= input_len_max or not 1 <= output_len_min <= output_len_max:
        raise ValueError("random workload needs num_prompts >= 0, 1 <= input_len_min <= input_len_max and "
                         f"1 <= output_len_min <= output_len_max; got {num_prompts}, "
                         f"[{input_len_min}, {input_len_max}], [{output_len_min}, {output_len_max}]")
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"random workload needs vocab_size > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (req/s) or null, got {request_rate}")
    rng = random.Random(seed)
    items, t = [], 0.0
    for i in range(num_prompts):
        n_in = rng.randint(input_len_min, input_len_max)
        ids = [rng.randrange(MIN_RANDOM_TOKEN_ID, vocab_size) for _ in range(n_in)]
        arrival = None
        if request_rate is not None and not math.isinf(request_rate):
            t += rng.expovariate(request_rate)
            arrival = t
        items.append(WorkloadItem(request_id=f"random-{i}", prompt_token_ids=ids,
                                  max_tokens=rng.randint(output_len_min, output_len_max), arrival_time_s=arrival))
    return items


def build_workload(cfg: Mapping[str, Any], tokenizer: Any, vocab_size: int | None = None,
                   max_model_len: int | None = None) -> list[WorkloadItem]:
    """Build the workload described by the ``workload`` config group (dispatch on ``name``), then
    set arrival times from ``request_rate``/``arrival``/``burstiness`` or ``trace``
    (``framework.workloads.synthetic.apply_arrivals``).

    Args:
        cfg: ``name: prompts`` (``path``, ``chat``: auto|true|false, ``limit``), ``random`` (the arguments of
            :func:`random_workload` except ``vocab_size``), ``shared_prefix``, ``multi_turn`` or
            ``long_tail`` (the arguments of their generators in ``framework.workloads.synthetic``).
        tokenizer: the engine's tokenizer (chat template, vocabulary size).
        vocab_size: random ids stay below it; default ``tokenizer.vocab_size``.
        max_model_len: ``long_tail`` clips prompt + output to it, tokens.

    Raises:
        ValueError: an unknown workload name (the valid ones are listed) or bad parameters.
    """
    name = cfg.get("name")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid choices: {', '.join(WORKLOADS)} "
                         "(set workload=<one of them>)")
    if vocab_size is None and name != "prompts":
        vocab_size = tokenizer.vocab_size
    seed = int(cfg.get("seed", 0))

    def args(*keys: str) -> dict[str, Any]:
        return {k: cfg[k] for k in keys}

    if name == "prompts":
        items = load_prompts(cfg["path"], chat=cfg.get("chat", "auto"), tokenizer=tokenizer,
                             limit=cfg.get("limit"))
    elif name == "random":
        items = random_workload(**args("num_prompts", "input_len_min", "input_len_max", "output_len_min",
                                       "output_len_max"), seed=seed, vocab_size=vocab_size)
    elif name == "shared_prefix":
        items = syn.shared_prefix_workload(**args("num_prefixes", "questions_per_prefix", "prefix_len",
                                                  "question_len", "output_len"), seed=seed, vocab_size=vocab_size)
    elif name == "multi_turn":
        items = syn.multi_turn_workload(**args("num_conversations", "turns", "first_len", "turn_len", "output_len",
                                               "turn_gap_s"), seed=seed, vocab_size=vocab_size)
    else:
        items = syn.long_tail_workload(int(cfg["num_prompts"]), seed=seed, vocab_size=vocab_size,
                                       max_model_len=int(cfg.get("max_model_len") or max_model_len or 2048),
                                       p50=int(cfg.get("p50", syn.LONG_TAIL_P50)),
                                       p99=int(cfg.get("p99", syn.LONG_TAIL_P99)))
    return syn.apply_arrivals(items, cfg, seed)
