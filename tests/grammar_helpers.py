"""Constraints and checkers shared by the structured-output tests (imported as ``grammar_helpers``)."""

from __future__ import annotations

import json
import re

import jsonschema
import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 2},
        "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 6},
                                                  "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                 "required": ["town", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "pet", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{1,3}"
CHOICES = ["red", "green", "blue"]
EBNF = 'root ::= "The " animal " is " mood "."\nanimal ::= "cat" | "dog"\nmood ::= "happy" | "sad"'
EBNF_RE = re.compile(r"The (cat|dog) is (happy|sad)\.")
PROMPTS = ["Once upon a time", "Tom had a big red ball", "The sun"]


def check_output(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert EBNF_RE.fullmatch(text), text
    else:
        assert isinstance(json.loads(text), dict)


SPECS = {"json": SCHEMA, "regex": REGEX, "choice": CHOICES, "grammar": EBNF, "json_object": True}


class MaskProcessor:
    """transformers ``LogitsProcessor`` driving a matcher from the same compiled grammar."""

    def __init__(self, grammar, compiled, prompt_len: int, vocab: int):
        from framework.core.structured_output import apply_token_bitmask

        self.matcher, self.prompt_len, self.apply = grammar.matcher(compiled), prompt_len, apply_token_bitmask
        self.bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.bitmask.fill_(-1)
        self.matcher.fill_bitmask(self.bitmask, 0)
        self.apply(scores, self.bitmask, [0])
        return scores


