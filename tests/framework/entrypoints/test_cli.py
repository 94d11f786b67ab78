"""The servelab command: subcommand dispatch, ``servelab plugins``, ``servelab models``, ``servelab rerun`` argv."""

from __future__ import annotations

import pytest

from framework.entrypoints import cli
from framework.entrypoints.model_info import family_rows, markdown_table
from framework.entrypoints.plugin_info import chosen_plugin_sources, list_plugins
from framework.model_executor.model_families import FAMILIES

REPO = __import__("pathlib").Path(__file__).resolve().parents[3]


def test_plugins_lists_every_builtin_with_package_and_capabilities(capsys):
    infos = {(p.kind, p.name): p for p in list_plugins()}
    assert {("scheduler", "fcfs"), ("scheduler", "priority"), ("kv_allocator", "paged"),
            ("attention", "torch")} <= set(infos)
    torch_attn = infos[("attention", "torch")]
    assert torch_attn.package == "servelab" and torch_attn.version and "float32" in torch_attn.dtypes
    assert "cpu" in torch_attn.devices
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "fcfs" in out and "servelab" in out and "float32" in out


def test_models_lists_each_family_with_needs_backends_and_test(capsys):
    rows = {r.family: r for r in family_rows()}
    assert len(rows) == len(FAMILIES)
    assert "attention sinks" in rows["gpt-oss"].needs and "MoE" in rows["gpt-oss"].needs
    assert rows["gpt-oss"].backends.split(", ") == ["hybrid", "torch", "torch_paged", "triton (CUDA)"]  # sinks
    assert "flash_attn (CUDA)" in rows["Gemma 2"].backends and "xformers" not in rows["Gemma 2"].backends
    assert "xformers (CUDA)" in rows["Llama"].backends
    assert rows["GPT-2"].test.endswith("test_family_parity[gpt2]")
    assert cli.main(["models"]) == 0
    assert "Gemma 2" in capsys.readouterr().out


def test_models_doc_table_is_servelab_models():
    """docs/models.md's family table is ``servelab models --markdown`` (regenerate it when a family changes)."""
    assert markdown_table() in (REPO / "docs" / "models.md").read_text()


def test_chosen_plugin_sources_names_package_and_version():
    record = chosen_plugin_sources({"scheduler": "fcfs", "drafter": "none", "attention": "torch"})
    assert set(record) == {"scheduler", "attention"}
    assert record["scheduler"]["package"] == "servelab" and record["scheduler"]["class"].endswith("FCFSPolicy")


def test_serve_and_eval_inject_mode_override_and_bare_args_go_to_hydra(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_run_hydra", lambda argv: seen.append(argv))
    cli.main(["serve", "model=stories260K"])
    cli.main(["scheduler=priority"])
    cli.main(["eval", "-m", "quant=none,int8_wo"])  # the mode goes last: Hydra takes no override before -m
    assert seen == [["model=stories260K", "mode=serve"], ["scheduler=priority"], ["-m", "quant=none,int8_wo", "mode=eval"]]


def test_rerun_argv_points_hydra_at_the_saved_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="finished run"):
        cli.rerun_argv(tmp_path, [])
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("mode: offline\n")
    argv = cli.rerun_argv(tmp_path, ["tracker.name=none"])
    assert argv[:4] == ["--config-path", str(tmp_path / ".hydra"), "--config-name", "config"]
    assert argv[4] == f"hydra.run.dir={tmp_path / 'rerun-0'}" and argv[5] == "tracker.name=none"
