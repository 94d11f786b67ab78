"""Hypothesis strategies for what users send (issue 34): sampling parameters, stop strings, logit biases and
structured-output specs (valid, invalid, unsatisfiable, huge). Shared by the offline (``LLM``) and the server fuzz
tests; values stray outside every accepted range on purpose, so rejections are exercised as much as runs."""

from __future__ import annotations

import json

from hypothesis import strategies as st

VOCAB = 512  # stories260K; ids up to VOCAB + 88 are generated so out-of-vocabulary ones occur

WILD_FLOATS = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.text(st.characters(codec="utf-8"), max_size=6)

SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.just(0.0), st.floats(0, 3), WILD_FLOATS),
    "top_p": st.one_of(st.floats(-0.5, 1.5), WILD_FLOATS),
    "top_k": st.integers(-3, VOCAB + 88),
    "min_p": st.floats(-0.2, 1.2),
    "repetition_penalty": st.one_of(st.floats(-1, 3), WILD_FLOATS),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "seed": st.one_of(st.integers(-2**64, 2**65), st.integers(0, 10)),
    "stop": st.lists(TEXT, max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 88), max_size=3),
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 88), st.one_of(st.floats(-150, 150), WILD_FLOATS), max_size=4),
    "min_tokens": st.integers(-1, 12),
    "max_tokens": st.integers(-1, 12),
    "logprobs": st.one_of(st.none(), st.integers(-1, 6), st.just(VOCAB + 5)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 6)),  # offline only (the server's is echo + logprobs)
    "n": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
})

_VALID_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
     "required": ["name"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "string", "enum": ["a", "bb", "ccc"]},
    {"type": "integer", "minimum": 5, "maximum": 1},  # unsatisfiable
    {"type": "string", "pattern": "[0-9]{3}"},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(150)}},  # huge
    {"type": "nonsense"}, {"$ref": "#/definitions/missing"}, {"type": "object", "required": ["x"],
                                                               "additionalProperties": False},  # unsatisfiable
]
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=8)
_SCHEMA_LIKE = st.fixed_dictionaries(
    {"type": st.sampled_from(["object", "string", "integer", "number", "array", "boolean", "null", "bogus"])},
    optional={"properties": st.dictionaries(TEXT, st.sampled_from([{"type": "string"}, {"type": "integer"}, {}]),
                                            max_size=3),
              "minLength": st.integers(-1, 4), "maxLength": st.integers(-1, 4), "minimum": st.integers(-3, 3),
              "maximum": st.integers(-3, 3), "enum": st.lists(_JSON, max_size=3), "items": _JSON,
              "required": st.lists(TEXT, max_size=2), "pattern": TEXT})
_REGEXES = ["[a-z]{1,4}", "(yes|no)", r"\d+\.\d{2}", "a{0}", "[]", "(", "x**", "a{1000000}", "[^\\x00-\\x{10FFFF}]",
            ".{0,3}" * 40]
_GRAMMARS = ['root ::= "yes" | "no"', 'root ::= [a-z]+ "!"', "root ::= root", 'root ::= "a" root? ', "root ::=",
             'start ::= "x"', 'root ::= ("ab" | "c")* "."']

STRUCTURED = st.one_of(
    st.builds(lambda c: {"choice": c}, st.one_of(st.lists(TEXT, max_size=4), st.lists(TEXT, min_size=200, max_size=300))),
    st.builds(lambda r: {"regex": r}, st.one_of(st.sampled_from(_REGEXES), TEXT)),
    st.builds(lambda s: {"json": s}, st.one_of(st.sampled_from(_VALID_SCHEMAS), _SCHEMA_LIKE, _JSON)),
    st.builds(lambda s: {"json": s}, st.one_of(TEXT, st.just("{not json"))),  # JSON text, mostly invalid
    st.builds(lambda g: {"grammar": g}, st.one_of(st.sampled_from(_GRAMMARS), TEXT)),
    st.sampled_from([{"json_object": True}, {"json_object": False}, {}, {"regex": "a", "choice": ["a"]}]),
)


def as_json_text(value: object) -> str:
    """``json.dumps`` that allows NaN/inf (Python's JSON; what a sloppy client sends)."""
    return json.dumps(value, allow_nan=True)
