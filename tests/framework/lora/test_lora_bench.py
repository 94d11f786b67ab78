"""``experiments/offline/bench_lora.py`` on stories260K, in this process (no timing is checked: a smoke test): the
configuration matrix and ``--quick``'s goal rows, adapters made once and reused, a LoRA row and a merged-weights row
run, and the goal ratios computed from the rows present."""

from __future__ import annotations

import pytest
from helpers import STORIES

from experiments.offline import bench_lora

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_the_matrix_and_the_quick_rows():
    full = {c["name"] for c in bench_lora.configurations(bench_lora.parse_args([]))}
    assert {"base", "bgmv_n64_r64", "sgmv_n1_r8", "loop_n16_r8", "merged_r8", "merged_r64", "fcfs_n64_slots8",
            "lora_affinity_n64_slots8"} <= full and len(full) == 1 + 3 * 4 * 2 + 2 + 2
    quick = [c["name"] for c in bench_lora.configurations(bench_lora.parse_args(["--quick"]))]
    assert quick == ["base", "bgmv_n4_r8", "bgmv_n16_r8", "loop_n16_r8", "bgmv_torch_n16_r8"]
    rows = {"base": {"output_tok_s": 100.0}, "bgmv_n4_r8": {"output_tok_s": 80.0},
            "bgmv_n16_r8": {"output_tok_s": 60.0}, "loop_n16_r8": {"output_tok_s": 20.0}}
    assert bench_lora.goal_ratios(rows) == {"bgmv_n4_r8_vs_base": 0.8, "bgmv_n16_r8_vs_loop": 3.0}


def test_a_lora_row_and_a_merged_row_run(tmp_path):
    args = bench_lora.parse_args(["--model", STORIES, "--dtype", "float32", "--num-prompts", "4", "--input-len", "8",
                                  "--output-len", "3", "--adapter-dir", str(tmp_path)])
    lora = bench_lora.run_one(args, {"name": "sgmv_n2_r4", "kind": "lora", "backend": "sgmv", "adapters": 2,
                                     "rank": 4, "slots": 2, "scheduler": "lora_affinity"})
    assert lora["num_output_tokens"] == 4 * 3 and lora["output_tok_s"] > 0 and lora["ttft_p50_ms"] > 0
    folders = sorted(p.name for p in (tmp_path / "r4_n2").iterdir())
    assert folders == ["adapter_0", "adapter_1"]
    stamp = (tmp_path / "r4_n2" / "adapter_0" / "adapter_model.safetensors").stat().st_mtime_ns
    bench_lora.make_adapters(STORIES, tmp_path / "r4_n2", 2, 4, ["q_proj"], 0)  # reused, not rewritten
    assert (tmp_path / "r4_n2" / "adapter_0" / "adapter_model.safetensors").stat().st_mtime_ns == stamp
    merged = bench_lora.run_one(args, {"name": "merged_r4", "kind": "merged", "rank": 4})
    assert merged["num_output_tokens"] == 4 * 3 and (tmp_path / "merged_r4" / "config.json").is_file()
