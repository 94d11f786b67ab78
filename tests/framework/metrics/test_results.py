"""framework.metrics.results: a fake Hydra multirun dir -> table (CSV + Markdown), PNGs, self-contained HTML."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from framework.metrics.results import collect, flatten, write_report


def make_sweep(root, grid):
    for i, (sched, seqs, extra) in enumerate(grid):
        job = root / str(i)
        (job / ".hydra").mkdir(parents=True)
        cfg = {"scheduler": {"name": sched}, "engine": {"max_num_seqs": seqs, "block_size": 16}, "stop": ["a"]}
        (job / "resolved_config.yaml").write_text(yaml.safe_dump(cfg))
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"scheduler={sched}",
                                                                       f"engine.max_num_seqs={seqs}"]))
        metrics = {"output_throughput": 10.0 * (i + 1), "median_ttft_ms": 1.0 + i, "p99_ttft_ms": 2.0 + i,
                   "median_tpot_ms": 0.5, "p99_tpot_ms": 0.7, "series": [1, 2], "kv": {"usage": 0.1 * i}, **extra}
        (job / "metrics.json").write_text(json.dumps(metrics))


GRID = [("fcfs", 2, {}), ("fcfs", 8, {}), ("priority", 2, {}), ("priority", 8, {"prefix_cache_hit_rate": 0.5})]


def test_flatten_dots_nested_keys_and_keeps_lists_comparable():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None}) == {"a.b": 1, "a.c": "[1, 2]", "d": None}


def test_collect_finds_varied_keys_and_every_scalar_metric(tmp_path):
    make_sweep(tmp_path, GRID)
    results = collect(tmp_path)
    assert results.varied == ["scheduler.name", "engine.max_num_seqs"]  # block_size is constant
    assert "kv.usage" in results.metric_keys and "prefix_cache_hit_rate" in results.metric_keys
    assert "series" not in results.metric_keys  # lists are not table cells
    rows = results.rows()
    assert [r["scheduler.name"] for r in rows] == ["fcfs", "fcfs", "priority", "priority"]
    assert rows[0]["prefix_cache_hit_rate"] is None and rows[3]["prefix_cache_hit_rate"] == 0.5


def test_write_report_writes_table_pngs_and_self_contained_html(tmp_path):
    make_sweep(tmp_path / "sweep", GRID)
    results = write_report(tmp_path / "sweep", extra_plots=["prefix_cache_hit_rate", "absent_metric"])
    out = tmp_path / "sweep" / "results"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and rows[2]["scheduler.name"] == "priority" and float(rows[1]["output_throughput"]) == 20
    md = (out / "results.md").read_text().splitlines()
    assert md[0].startswith("| job | scheduler.name | engine.max_num_seqs |") and len(md) == 6
    for stem in ("throughput", "ttft", "tpot", "prefix_cache_hit_rate"):
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "absent_metric.png").exists()  # no job reported it
    page = (out / "results.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "<table>" in page and "priority" in page
    assert "src=\"http" not in page and results.files["html"] == out / "results.html"


def test_single_run_dir_uses_its_overrides_and_empty_dir_is_a_clear_error(tmp_path):
    make_sweep(tmp_path / "one", GRID[:1])
    assert collect(tmp_path / "one" / "0").varied == ["scheduler.name", "engine.max_num_seqs"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.json"):
        collect(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not found"):
        collect(tmp_path / "missing")


def test_without_matplotlib_the_tables_are_written_and_the_warning_names_the_extra(tmp_path, monkeypatch, caplog):
    import sys

    from framework.metrics import results as results_module

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(results_module, "_WARNED_NO_MATPLOTLIB", [])
    make_sweep(tmp_path / "sweep", GRID)
    with caplog.at_level("WARNING", logger="framework.metrics.results"):
        results = write_report(tmp_path / "sweep")
    out = tmp_path / "sweep" / "results"
    assert (out / "results.csv").exists() and (out / "results.md").exists() and not list(out.glob("*.png"))
    assert results.files["html"].exists()
    assert [r.message for r in caplog.records if "servelab[plots]" in r.message] != []
    assert sum("matplotlib" in r.message for r in caplog.records) == 1  # once, not once per plot
