"""``dtype="auto"`` (the default): the checkpoint's ``config.json`` dtype, as vLLM; float32 when it names none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import STORIES

from framework import EngineConfig
from framework.engine.builder import resolve_dtype
from framework.worker.model_loader import checkpoint_dtype


def _copy_with_dtype(tmp_path, **fields):
    """stories260K's config.json (no weights: only the config is read) with its dtype fields replaced."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((Path(STORIES) / "config.json").read_text())
    del config["dtype"], config["torch_dtype"]
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return str(folder)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # the name older config files use
    ({}, "float32"),  # names none
    ({"dtype": "float64"}, "float32"),  # outside the engine's dtypes
])
def test_auto_takes_the_checkpoint_dtype(tmp_path, fields, expected):
    config = resolve_dtype(EngineConfig(model=_copy_with_dtype(tmp_path, **fields)))
    assert config.dtype == expected


def test_explicit_dtype_is_kept_and_shipped_models_resolve():
    explicit = EngineConfig(model="/nonexistent/model", dtype="bfloat16")
    assert resolve_dtype(explicit) is explicit  # nothing read from disk
    assert EngineConfig(model=STORIES).dtype == "auto"
    assert resolve_dtype(EngineConfig(model=STORIES)).dtype == "float32"


def test_checkpoint_dtype_reads_torch_dtypes():
    import torch
    from transformers import LlamaConfig

    assert checkpoint_dtype(LlamaConfig(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(LlamaConfig()) == "float32"


def test_llm_keeps_the_resolved_config(make_llm):
    llm = make_llm()
    assert llm.config.dtype == llm.engine.config.dtype == "float32"


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16 or float16"):
        EngineConfig(model=STORIES, dtype="fp64")
