"""The experiment scripts that produce reported numbers still run end to end (tiny settings, stories260K).

These check that the scripts work and that their outputs are usable, not the numbers themselves
(speed is never asserted)."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO, STORIES

from framework import LLM, SamplingParams

sys.path.insert(0, str(REPO))


def test_train_eagle_writes_a_usable_head(tmp_path, capsys):
    from experiments import train_eagle

    out = tmp_path / "head"
    train_eagle.main(["--model", STORIES, "--out", str(out), "--num-sequences", "16", "--max-tokens", "24",
                      "--epochs", "1", "--gen-dtype", "float32", "--batch-size", "4"])
    printed = capsys.readouterr().out
    assert "held-out first-draft top-1" in printed and (out / "config.json").is_file()
    assert (out / "pytorch_model.bin").is_file()
    llm = LLM(model=STORIES, drafter="eagle", drafter_params={"model": str(out), "num_speculative_tokens": 2})
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(outs[0].outputs[0].token_ids) == 8
    assert llm.engine.metrics.summary()["spec_num_draft_tokens"] > 0


def test_roofline_reports_every_category(capsys):
    from experiments import roofline

    roofline.main(["--model", STORIES, "--dtype", "float32", "--batch-sizes", "1,4", "--prompt-len", "16",
                   "--warmup-steps", "1", "--steps", "3"])
    printed = capsys.readouterr().out
    assert "GEMM peak" in printed
    rows = [line.split()[0] for line in printed.splitlines() if line.startswith("  ") and "measured" not in line]
    for category in (*roofline.CATEGORIES, "other", "engine", "step"):
        assert rows.count(category) == 2, category  # one row per batch size


def test_bench_vs_vllm_repeats_report_medians(capsys, tmp_path):
    """servelab alone (no vLLM mode): ``--repeats`` times each generate after a prefix-cache reset and
    reports the median, with every repeat in the rows."""
    from experiments import bench_vs_vllm

    rows = bench_vs_vllm.main(["--model", STORIES, "--dtype", "float32", "--workload", "fixed", "--num-prompts", "4",
                               "--input-len", "16", "--output-len", "6", "--batch1-tokens", "4", "--repeats", "3",
                               "--vllm-modes", "", "--json-out", str(tmp_path / "out.json")])
    (row,) = rows
    assert row["system"] == "servelab" and row["output_tokens"] == 24
    assert len(row["all_tok_s"]) == len(row["all_b1_ms_per_token"]) == 3
    assert sorted(row["all_tok_s"])[1] == row["tok_s"]  # the median repeat
    assert "tok/s of each repeat" in capsys.readouterr().out and (tmp_path / "out.json").is_file()


def test_bench_vs_vllm_interleave_rotates_rounds_and_pairs_them():
    """``--interleave``: one repeat of every system per round, the order rotating each round; blocks
    otherwise. Paired ratios are per round (ours / peer throughput, peer / ours batch-1 time)."""
    from experiments import bench_vs_vllm

    calls = []

    def system(name, seconds):
        def run():
            calls.append(name)
            return {"seconds": seconds[len([c for c in calls if c == name]) - 1], "tokens": [], "b1_seconds": 1.0,
                    "b1_tokens": 10}
        return run

    systems = {"a": system("a", [1.0, 2.0, 4.0]), "b": system("b", [2.0, 2.0, 2.0]), "c": system("c", [1, 1, 1])}
    runs = bench_vs_vllm.run_rounds(systems, 3, interleave=True)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    pr = bench_vs_vllm.paired_ratios(runs, "a", "b")
    assert pr["tok_s"] == [2.0, 1.0, 0.5] and pr["tok_s_median"] == 1.0 and pr["b1"] == [1.0] * 3
    calls.clear()
    bench_vs_vllm.run_rounds(systems, 2, interleave=False)
    assert calls == ["a", "a", "b", "b", "c", "c"]


def test_bench_vs_vllm_worker_failure_is_reported(tmp_path):
    """A vLLM worker that cannot start (here: an interpreter without vllm) raises with its stderr."""
    import argparse

    from experiments import bench_vs_vllm

    args = argparse.Namespace(vllm_python=sys.executable, workdir=str(tmp_path), batch1_tokens=2, prefix_caching="on")
    with pytest.raises(RuntimeError, match=r"(?s)vllm_compiled worker ended without READY.*No module named .vllm."):
        bench_vs_vllm.start_vllm("unused", [[1, 2]], [2], args, eager=False)


def test_nano_batch_cpu_times_each_setting():
    """``nano_batch_cpu``: the whole forward, the split forwards one after the other and in two Python
    threads (in this process, tiny and eager), and two engines pinned one per core, started together
    per round (their own processes), are each timed."""
    import argparse

    import torch

    from experiments import nano_batch_cpu
    from experiments.bench_offline import add_model_workload_args

    p = argparse.ArgumentParser()
    add_model_workload_args(p)
    args = p.parse_args(["--model", STORIES, "--dtype", "float32", "--num-prompts", "4", "--output-len", "3",
                         "--input-len", "16"])
    args.eager, args.rows, args.steps, args.rounds = True, 2, 1, 1
    threads = torch.get_num_threads()
    try:
        out = {**nano_batch_cpu.child_threads("whole", args), **nano_batch_cpu.child_threads("split", args)}
    finally:
        torch.set_num_threads(threads)
    assert sorted(out) == ["sequential", "two_threads", "whole"] and min(out.values()) > 0
    (tok_s,) = nano_batch_cpu.run_dp(args, shards=2, threads=1)
    assert tok_s > 0


def test_bench_prefill_attention_times_every_tile(capsys):
    """The prefill-attention benchmark captures real prefill steps and times each tile size per round."""
    from experiments import bench_prefill_attention

    times = bench_prefill_attention.main(["--model", STORIES, "--workload", "mixed", "--num-prompts", "6",
                                          "--input-len", "40", "--tiles", "0,8", "--rounds", "2"])
    assert sorted(times) == [0, 8] and all(len(v) == 2 and min(v) > 0 for v in times.values())
    assert "prefill_tile=   8" in capsys.readouterr().out


def test_profile_engine_whole_run_split_names_and_sums_its_categories():
    """``profile_engine.py --whole-run``: each profiler event lands in one category (the in-place
    kernel by its softmax ``amax``), and the reported shares cover the whole profiled time."""
    from experiments import profile_engine

    cat = profile_engine.time_category
    assert cat("mkldnn::_linear_pointwise") == "oneDNN GEMMs"
    assert cat("graph_3_cpp_fused__to_copy_add_amax_arange_as_strided_exp") == "in-place attention kernel"
    assert cat("aten::_scaled_dot_product_flash_attention_for_cpu") == "prefill SDPA"
    assert cat("graph_3_cpp_fused__to_copy_add_mean_mul_pow_rsqrt") == "other generated kernels"
    assert cat("## Call CompiledFxGraph abc ##") == "compiled graph wrapper"
    assert cat("aten::argmax") == "other"

    llm = LLM(model=STORIES)
    lines = profile_engine.whole_run_split(llm, [[1, 2, 3, 4], [5, 6, 7]], [5, 3])
    assert lines[0].startswith("whole run:")
    shares = [float(line.split()[-1].rstrip("%")) for line in lines[1:]]
    names = {cat for cat, _ in profile_engine.CATEGORIES} | {"other"}
    assert all(any(line.strip().startswith(n) for n in names) for line in lines[1:])
    assert abs(sum(shares) - 100) < 0.5


def test_prefill_score_precision_variants_match_float64_in_float32(capsys):
    """``prefill_score_precision.py``: on captured real q/k/v, the bf16-GEMM attention variants (plain and
    max-shifted) equal the float64 causal reference when run in float32 (GQA packing, causal mask and
    shift are exact there), and carry a small nonzero error in bfloat16."""
    from experiments import prefill_score_precision

    common = ["--model", STORIES, "--workload", "mixed", "--num-prompts", "6", "--input-len", "40", "--requests", "3",
              "--layers", "0,1", "--rounds", "1", "--no-compile"]
    exact = prefill_score_precision.main(common + ["--dtype", "float32"])
    assert sorted(exact) == ["bf16", "bf16_shift", "sdpa"]
    assert all(r["rel_max"] < 1e-5 and r["seconds"] > 0 for r in exact.values())
    rounded = prefill_score_precision.main(common + ["--dtype", "bfloat16"])
    assert all(0 < r["rel_max"] < 0.05 for r in rounded.values())
    assert "bf16_shift" in capsys.readouterr().out


def test_microbench_cpu_times_the_kernel_and_the_gemms():
    """``microbench_cpu.py``: the in-place kernel per block placement, oneDNN GF/s per M (DRAM and L3 settings of each)."""
    from experiments import microbench_cpu

    kernel = microbench_cpu.main(["kernel", "--tokens", "4", "--context", "40", "--layers", "2", "--rounds", "2"])
    assert sorted(kernel) == ["consecutive", "random"] and all(v["dram"] > 0 and v["l3"] > 0 for v in kernel.values())
    gemm = microbench_cpu.main(["gemm", "--rows", "2,8", "--gemms", "o,down", "--rounds", "1", "--huge-pages"])
    assert sorted(gemm) == [2, 8] and all(sorted(r) == ["down", "o"] for r in gemm.values())
    assert all(v["dram"] > 0 and v["l3"] > 0 for r in gemm.values() for v in r.values())


def test_microbench_cpu_splits_prefill_sdpa():
    """``microbench_cpu.py sdpa``: the bucket's ``bmm`` attention equals SDPA (exactly in float32, within bf16
    rounding in bf16), every part is timed, and where torch has MKL the GEMMs SDPA hands it are counted."""
    import torch
    import torch.nn.functional as F

    from experiments import microbench_cpu

    with pytest.raises(ValueError, match="at least --tile"):
        microbench_cpu.prefill_bucket(2, 64, 32)
    q, k, v, mask = microbench_cpu.prefill_bucket(2, 8, 32)
    assert mask.shape == (2, 1, 24, 32) and mask.any(-1).all()  # every query row sees at least one key
    f32 = [x.float() for x in (q, k, v)]
    torch.testing.assert_close(microbench_cpu.bmm_attention(*f32, mask),
                               F.scaled_dot_product_attention(*f32, attn_mask=mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(microbench_cpu.bmm_attention(q, k, v, mask).float(),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float(), rtol=0.05, atol=0.05)
    r = microbench_cpu.main(["sdpa", "--tiles", "2", "--tile", "8", "--keys", "32", "--rounds", "1"])
    assert all(r[key] > 0 for key in ("sdpa", "qk_bmm", "pv_bmm", "softmax", "bmm_attention", "bmm_gflops"))
    if torch.backends.mkl.is_available():
        assert r["mkl_calls"] > 0 and r["mkl_gflop"] > 0 and r["mkl_gflops_floor"] > 0


def test_bench_parallel_reports_throughput_itl_and_the_overhead_split(tmp_path):
    """``bench_parallel`` on the tiny random model, two ``mp`` ranks: every column is there."""
    from experiments import bench_parallel

    report = bench_parallel.main(["--tiny", "--model-dir", str(tmp_path), "--systems", "mp2", "--batches", "1", "2",
                                  "--prompt-len", "8", "--output-len", "4", "--window", "2",
                                  "--attention", "torch", "--num-blocks", "64", "--json-out", str(tmp_path / "out.json")])
    (row,) = report["results"]
    assert row["tensor_parallel_size"] == 2 and row["threads_per_rank"] >= 1
    for batch in ("b1", "b2"):
        assert row[batch]["output_tok_s"] > 0 and row[batch]["itl_p50_ms"] > 0
        assert 0 < row[batch]["broadcast_share"] < 1 and row[batch]["collective_ms"] > 0
        assert row[batch]["collectives_per_step"] == 1 + 2 * 2 + 1  # embedding, 2 layers x (o_proj, down_proj), logits
    assert (tmp_path / "out.json").is_file()
