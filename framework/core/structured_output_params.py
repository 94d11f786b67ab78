"""``StructuredOutputsParams`` (vLLM's names) and the OpenAI ``response_format`` mapping."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class StructuredOutputsParams:
    """One request's output constraint; exactly one field is set (vLLM's ``StructuredOutputsParams``).

    Fields:
        json: a JSON schema, as a dict or JSON text.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (XGrammar/GBNF style, ``root ::= ...``).
        json_object: any JSON object.

    Raises:
        ValueError: from ``__post_init__`` when none or several fields are set, a field has the
            wrong type, or ``json`` is not valid JSON; the message names the fix.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.kind_and_spec()

    def kind_and_spec(self) -> tuple[str, str]:
        """``(kind, spec)``: the set field's name and a canonical text (the compile-cache key).

        Raises:
            ValueError: see the class docstring.
        """
        set_fields = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                      if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_fields or 'none'}")
        kind = set_fields[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(value).__name__}")
            return kind, json.dumps(value)  # key order kept: it is the output property order
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
            return kind, json.dumps(list(value))
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be True, got {value!r}")
            return kind, ""
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        return kind, value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """Build from a plain dict (workload JSONL, vLLM's ``structured_outputs`` extra body).

        Raises:
            ValueError: unknown keys (named) or an invalid constraint.
        """
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {"json", "regex", "choice", "grammar", "json_object"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown keys {unknown}; use one of {sorted(known)}")
        return cls(**data)


def structured_outputs_from_openai(response_format: dict[str, Any] | None = None,
                                   structured_outputs: dict[str, Any] | None = None
                                   ) -> StructuredOutputsParams | None:
    """Map an OpenAI request's ``response_format`` and vLLM's ``structured_outputs`` extra body
    onto :class:`StructuredOutputsParams` (for the OpenAI server).

    ``response_format``: ``{"type": "text"}`` -> None; ``{"type": "json_object"}`` -> any JSON
    object; ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` -> that schema.

    Returns:
        The params, or None when neither asks for structured output.

    Raises:
        ValueError: both given, an unknown ``type``, a missing ``json_schema.schema``, or an invalid
            constraint (the server should answer HTTP 400 with the message).
    """
    if structured_outputs is not None and response_format not in (None, {"type": "text"}):
        raise ValueError("give either response_format or structured_outputs, not both")
    if structured_outputs is not None:
        return StructuredOutputsParams.from_dict(structured_outputs)
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError("response_format json_schema needs json_schema.schema (a JSON schema object)")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
