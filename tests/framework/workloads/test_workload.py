"""Workload loading (.txt / .jsonl, chat rendering), random workloads and the dispatcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.workloads.workload import WorkloadItem, build_workload, load_prompts, random_workload

REPO = Path(__file__).resolve().parents[3]


class FakeChatTokenizer:
    """Just enough of an HF tokenizer: a chat template and character-level ids."""

    chat_template = "{{ fake }}"
    vocab_size = 100

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize and messages[0]["role"] == "user"
        return f"<user>{messages[0]['content']}</user><assistant>"

    def __call__(self, text, add_special_tokens=True):
        assert not add_special_tokens  # the template already holds the special tokens

        class Encoded:
            input_ids = [ord(c) % 100 for c in text]

        return Encoded()


class NoTemplateTokenizer:
    chat_template = None
    vocab_size = 512


def test_txt_one_prompt_per_line_skips_blank(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Hello there\n\n  Tell me a story  \n")
    items = load_prompts(path, chat=False, tokenizer=None)
    assert [i.prompt for i in items] == ["Hello there", "Tell me a story"]
    assert [i.request_id for i in items] == ["prompt-0", "prompt-1"]
    assert all(i.prompt_token_ids is None and i.priority == 0 and i.max_tokens is None for i in items)
    assert len(load_prompts(path, chat=False, tokenizer=None, limit=1)) == 1


def test_jsonl_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a", "priority": 2, "max_tokens": 5}, {"prompt": "b", "arrival_time_s": 0.5}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    a, b = load_prompts(path, chat=False, tokenizer=None)
    assert (a.prompt, a.priority, a.max_tokens, a.arrival_time_s) == ("a", 2, 5, None)
    assert (b.prompt, b.priority, b.max_tokens, b.arrival_time_s) == ("b", 0, None, 0.5)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        load_prompts(path, chat=False, tokenizer=None)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: invalid JSON"):
        load_prompts(path, chat=False, tokenizer=None)


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="workload.path"):
        load_prompts(tmp_path / "nope.txt", chat=False, tokenizer=None)
    (tmp_path / "p.csv").write_text("x\n")
    with pytest.raises(ValueError, match=".txt"):
        load_prompts(tmp_path / "p.csv", chat=False, tokenizer=None)


def test_chat_renders_user_turn_and_tokenizes(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Hi\n")
    (item,) = load_prompts(path, chat=True, tokenizer=FakeChatTokenizer())
    assert item.prompt == "<user>Hi</user><assistant>"
    assert item.prompt_token_ids == [ord(c) % 100 for c in item.prompt]


def test_chat_without_template_names_the_fix(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Hi\n")
    with pytest.raises(ValueError, match="workload.chat=false"):
        load_prompts(path, chat=True, tokenizer=NoTemplateTokenizer())


def test_random_workload_is_seeded_and_in_range():
    kwargs = dict(num_prompts=20, input_len_min=4, input_len_max=9, output_len_min=2, output_len_max=5, seed=7,
                  vocab_size=50)
    items = random_workload(**kwargs)
    assert items == random_workload(**kwargs)
    assert items != random_workload(**{**kwargs, "seed": 8})
    assert len({i.request_id for i in items}) == 20
    for item in items:
        assert item.prompt is None and 4 <= len(item.prompt_token_ids) <= 9
        assert all(3 <= t < 50 for t in item.prompt_token_ids)
        assert 2 <= item.max_tokens <= 5 and item.arrival_time_s is None


def test_random_workload_poisson_arrivals_increase():
    items = random_workload(10, 1, 2, 1, 2, seed=0, vocab_size=10, request_rate=100.0)
    times = [i.arrival_time_s for i in items]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 1.0


@pytest.mark.parametrize("bad", [dict(input_len_min=5, input_len_max=4), dict(output_len_min=0),
                                 dict(vocab_size=3), dict(request_rate=0.0)])
def test_random_workload_rejects_bad_ranges(bad):
    kwargs = dict(num_prompts=2, input_len_min=1, input_len_max=4, output_len_min=1, output_len_max=2, seed=0,
                  vocab_size=50)
    with pytest.raises(ValueError):
        random_workload(**{**kwargs, **bad})


def test_build_workload_dispatch(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\n")
    items = build_workload({"name": "prompts", "path": str(path), "chat": False, "limit": 2}, tokenizer=None)
    assert [i.prompt for i in items] == ["a", "b"]
    cfg = {"name": "random", "num_prompts": 3, "input_len_min": 2, "input_len_max": 3, "output_len_min": 1,
           "output_len_max": 2, "seed": 0}
    items = build_workload(cfg, tokenizer=NoTemplateTokenizer())
    assert len(items) == 3 and all(max(i.prompt_token_ids) < 512 for i in items)
    with pytest.raises(ValueError, match="prompts, random"):
        build_workload({"name": "sharegpt"}, tokenizer=None)


def test_item_needs_a_prompt():
    with pytest.raises(ValueError, match="prompt"):
        WorkloadItem(request_id="x")


def test_shipped_prompts_file():
    lines = (REPO / "data" / "prompts.txt").read_text().splitlines()
    assert len(lines) >= 64 and all(line.strip() for line in lines)
    assert len(set(lines)) == len(lines)
    # a long shared prefix (several KV blocks) so prefix caching gets hits
    prefix = lines[0][:200]
    assert sum(line.startswith(prefix) for line in lines) >= 8
    assert min(map(len, lines)) < 40 < 400 < max(map(len, lines))


def test_chat_auto_uses_the_template_when_there_is_one(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Hi\n")
    (item,) = load_prompts(path, chat="auto", tokenizer=FakeChatTokenizer())
    assert item.prompt == "<user>Hi</user><assistant>" and item.raw_prompt == "Hi"
    (plain,) = load_prompts(path, chat="auto", tokenizer=NoTemplateTokenizer())
    assert plain.prompt == "Hi" and plain.prompt_token_ids is None
    (none_tok,) = build_workload({"name": "prompts", "path": str(path)}, tokenizer=None)  # chat defaults to auto
    assert none_tok.prompt == "Hi"


def test_chat_rejects_other_values(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Hi\n")
    with pytest.raises(ValueError, match="auto, true or false"):
        load_prompts(path, chat="yes", tokenizer=FakeChatTokenizer())
