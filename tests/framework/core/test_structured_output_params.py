"""StructuredOutputsParams validation, the OpenAI response_format mapping, the bitmask op and the
workload JSONL field (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from framework import SamplingParams, StructuredOutputsParams
from framework.core.structured_output import apply_token_bitmask
from framework.core.structured_output_params import structured_outputs_from_openai
from framework.workloads.workload import load_prompts


def test_kind_and_spec_canonical():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert StructuredOutputsParams(json=schema).kind_and_spec() == ("json", json.dumps(schema))
    assert StructuredOutputsParams(json=json.dumps(schema)).kind_and_spec() == ("json", json.dumps(schema))
    assert StructuredOutputsParams(choice=["x", "y"]).kind_and_spec() == ("choice", '["x", "y"]')
    assert StructuredOutputsParams(json_object=True).kind_and_spec() == ("json_object", "")
    assert StructuredOutputsParams(regex="a+").kind_and_spec() == ("regex", "a+")


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "JSON schema object"), ({"choice": []}, "non-empty list"), ({"choice": ["a", 3]}, "non-empty list"),
    ({"regex": ""}, "non-empty string"), ({"grammar": 5}, "non-empty string"),
])
def test_bad_params_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_accepts_dict_and_rejects_other_types():
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="a+")


def test_openai_mapping():
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert structured_outputs_from_openai(rf).json == schema
    assert structured_outputs_from_openai({"type": "json_object"}).json_object is True
    assert structured_outputs_from_openai({"type": "text"}) is None
    assert structured_outputs_from_openai(None, {"choice": ["a", "b"]}).choice == ["a", "b"]
    assert structured_outputs_from_openai() is None
    with pytest.raises(ValueError, match="json_schema.schema"):
        structured_outputs_from_openai({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="response_format.type"):
        structured_outputs_from_openai({"type": "yaml"})
    with pytest.raises(ValueError, match="not both"):
        structured_outputs_from_openai({"type": "json_object"}, {"regex": "a"})


def test_apply_token_bitmask_masks_rows_and_padded_columns():
    logits = torch.zeros(3, 40)  # vocab 33 -> 2 words; columns 64.. do not exist, 33..39 are padding
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[0] = torch.tensor([0b101, 0], dtype=torch.int32)  # tokens 0 and 2
    bitmask[2] = torch.tensor([0, 1], dtype=torch.int32)  # token 32
    apply_token_bitmask(logits, bitmask, [0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()  # row not masked
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [32]
    wide = torch.zeros(1, 80)  # logits wider than the bitmask: extra columns disallowed
    apply_token_bitmask(wide, torch.full((1, 2), -1, dtype=torch.int32), [0])
    assert torch.isfinite(wide[0]).nonzero().flatten().tolist() == list(range(64))


def test_workload_jsonl_carries_structured_outputs(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "structured_outputs": {"choice": ["a", "b"]}}) + "\n"
                    + json.dumps({"prompt": "yo"}) + "\n")
    items = load_prompts(path, chat=False, tokenizer=None)
    assert items[0].structured_outputs == {"choice": ["a", "b"]} and items[1].structured_outputs is None
