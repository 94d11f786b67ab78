"""Smoke runs of the simulated at-scale studies (``experiments/sim/sim_disagg.py``, ``sim_parallel_choice.py``) at
tiny settings: every arm runs, the JSON and plots are written, the numbers are the kind the docs quote."""

from __future__ import annotations

import json


def test_sim_disagg_compares_colocated_and_pd_and_plots(tmp_path):
    from experiments.sim import sim_disagg

    out, png = tmp_path / "disagg.json", tmp_path / "disagg.png"
    rows = sim_disagg.main(["--replicas", "2", "--prefill", "0,1", "--rates", "4", "--num-requests", "6",
                            "--input-len", "64", "--output-len", "8", "--json-out", str(out), "--plot", str(png)])
    assert [r["arm"] for r in rows] == ["colocated", "1P1D"] and all(r["num_requests"] == 6 for r in rows)
    assert rows[0]["mean_transfer_ms"] == 0.0 and rows[1]["mean_transfer_ms"] > 1.0  # the 1 ms latency + bytes
    assert all(0.0 <= r["attainment"] <= 1.0 for r in rows)
    body = json.loads(out.read_text())
    assert set(body["capacity"]) == {"colocated", "1P1D"} and png.is_file()


def test_sim_parallel_choice_prices_bubbles_and_plots(tmp_path):
    from experiments.sim import sim_parallel_choice

    out, png = tmp_path / "parallel.json", tmp_path / "parallel.png"
    rows = sim_parallel_choice.main(["--gpus", "8", "--num-requests", "4", "--input-len", "64", "--output-len", "4",
                                     "--json-out", str(out), "--plot", str(png)])
    layouts = {(r["model"], r["tp"], r["pp"], r["ep"]): r for r in rows}
    assert ("mixtral-8x22b", 8, 1, True) in layouts and ("llama-3-70b", 2, 4, False) in layouts
    assert all(r["bubble_fraction"] == 0.0 for r in rows if r["pp"] == 1)
    # PP=2 with 2 microbatches: GPipe's 1/3, up to 1/2 in steps with one request left
    pp2 = layouts[("llama-3-70b", 4, 2, False)]["bubble_fraction"]
    assert 1 / 3 - 1e-9 <= pp2 <= 1 / 2 + 1e-9
    assert all(r["output_throughput"] > 0 for r in rows)
    assert len(json.loads(out.read_text())["rows"]) == len(rows) and png.is_file()
