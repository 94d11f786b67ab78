"""Smoke run of the simulated many-adapter study (``experiments/sim/sim_lora.py``) at tiny settings: the base
model and both schedulers run, JSON and plot are written, and the numbers are the kind the docs quote."""

from __future__ import annotations

import json

import pytest


def test_sim_lora_sweeps_adapters_and_schedulers_and_plots(tmp_path):
    from experiments.sim import sim_lora

    out, png = tmp_path / "lora.json", tmp_path / "lora.png"
    rows = sim_lora.main(["--adapters", "2,16", "--ranks", "8", "--num-requests", "24", "--rate", "50",
                          "--input-len", "64", "--output-len", "8", "--max-loras", "4",
                          "--json-out", str(out), "--plot", str(png)])
    assert [(r["scheduler"], r["adapters"]) for r in rows] == [
        ("base", 0), ("fcfs", 2), ("fcfs", 16), ("lora_affinity", 2), ("lora_affinity", 16)]
    assert all(r["errors"] == 0 and r["output_throughput"] > 0 for r in rows)
    by = {(r["scheduler"], r["adapters"]): r for r in rows}
    assert rows[0]["adapter_loads"] == 0 and by[("fcfs", 2)]["adapter_loads"] == 2  # two adapters, four slots
    assert by[("fcfs", 16)]["adapter_loads"] > 4  # more adapters than slots: loads past the first fill
    report = json.loads(out.read_text())
    assert len(report["rows"]) == len(rows) and report["code"]["commit"] and png.is_file()


def test_popularity_draws():
    from experiments.sim.sim_lora import popularity

    assert popularity("uniform", 3) == [1.0, 1.0, 1.0]
    assert popularity("zipf:1", 3) == [1.0, 0.5, 1 / 3]
    with pytest.raises(ValueError, match="uniform or zipf"):
        popularity("pareto", 3)
