"""The benchmarks users run still run end to end (tiny settings, stories260K); the studies under
``experiments/studies/`` import and parse their arguments; ``experiments/README.md`` lists every script.

These check that the scripts work and that their outputs are usable, not the numbers themselves
(speed is never asserted)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from helpers import EAGER_KERNEL, REPO, STORIES

from framework import LLM, SamplingParams

sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module", autouse=True)
def eager_paged_kernel():
    """In-process engines here run the torch_paged kernel eager (``EAGER_KERNEL``'s in-process twin): no script test
    is about that kernel, whose cold compile at engine start-up cost ~25 s of CPU per process and dtype/block size
    (its tests: ``tests/plugins/attention/test_torch_paged.py``). The compile tests here still compile what they
    test: the decoder graphs, their traced attention and the one-row head (``engine.compile=true``)."""
    from plugins.attention import torch_paged

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_paged, "_compiled_kernel", lambda: torch_paged.paged_attention)
        yield


def test_train_eagle_writes_a_usable_head(tmp_path, capsys):
    from experiments.quality import train_eagle

    out = tmp_path / "head"
    train_eagle.main(["--model", STORIES, "--out", str(out), "--num-sequences", "8", "--max-tokens", "16",
                      "--epochs", "1", "--gen-dtype", "float32", "--batch-size", "4"])
    printed = capsys.readouterr().out
    assert "held-out first-draft top-1" in printed and (out / "config.json").is_file()
    assert (out / "pytorch_model.bin").is_file()
    llm = LLM(model=STORIES, drafter="eagle", drafter_params={"model": str(out), "num_speculative_tokens": 2})
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(outs[0].outputs[0].token_ids) == 8
    assert llm.engine.metrics.summary()["spec_num_draft_tokens"] > 0


def test_bench_lm_head_pairs_the_compiled_and_the_eager_head(tmp_path):
    """A compile test by nature (the compiled one-row head against the eager one): both modes run in each
    round, tokens equal, the JSON carries the paired ratios."""
    from experiments.engine import bench_lm_head

    out = tmp_path / "lm_head.json"
    result = bench_lm_head.main(["--model", STORIES, "--dtype", "float32", "--prompt-len", "8", "--output-len", "4",
                                 "--rounds", "2", "--min-head-bytes", "0", "--json-out", str(out)])
    assert [r["mode"] for r in result["rounds"]] == ["compiled", "eager", "eager", "compiled"]
    assert result["summary"]["same_tokens"] and len(result["summary"]["forward_ms"]["paired_eager_over_compiled"]) == 2
    assert json.loads(out.read_text())["cpu"]
    from framework.compilation import decoder as compile_module

    assert compile_module.COMPILED_HEAD_MIN_BYTES == 16 << 20  # the override held for the script's engine only


def test_bench_layer_stack_pairs_stacked_and_per_layer_steps(tmp_path):
    """A compile test by nature (the stacked layer loop against per-layer graph calls): both modes run in
    each round, tokens equal, the JSON carries the paired ratios and each step key's stack decision."""
    from experiments.engine import bench_layer_stack

    out = tmp_path / "layer_stack.json"
    result = bench_layer_stack.main(["--model", STORIES, "--dtype", "float32", "--prompt-len", "8",
                                     "--output-len", "4", "--rounds", "2", "--json-out", str(out)])
    assert [r["mode"] for r in result["rounds"]] == ["stacked", "per_layer", "per_layer", "stacked"]
    assert result["summary"]["same_tokens"] and len(result["summary"]["forward_ms"]["paired_per_layer_over_stacked"]) == 2
    assert result["layer_stack"]["1-token traced-attention"] == "stacked" and json.loads(out.read_text())["cpu"]


def test_bench_prepack_layout_times_every_hint_at_every_row_count(tmp_path):
    """Every (dtype, rows) cell has each hint's time and its ratio to the first hint (1.0 for the first); a dtype
    oneDNN cannot pack on this CPU (bf16 on AVX2 only) is skipped with the reason."""
    import torch

    from experiments.engine import bench_prepack_layout
    from framework.model_executor.prepack import onednn_has_kernels

    out = tmp_path / "layout.json"
    result = bench_prepack_layout.main(["--model", STORIES, "--rows", "1,3", "--rounds", "2", "--inner", "1",
                                        "--json-out", str(out)])
    bf16 = onednn_has_kernels(torch.bfloat16)
    assert [(c["dtype"], c["rows"]) for c in result["cells"]] == [
        ("bfloat16", 1), ("bfloat16", 3)] * bf16 + [("float32", 1), ("float32", 3)]
    assert ("bfloat16" in result["skipped"]) == (not bf16)
    assert all(c["ratio_to_first"][1] == 1.0 and c["ms"][64] > 0 for c in result["cells"])
    assert set(result["shapes"]) == {"qkv", "o", "gate", "up", "down"} and json.loads(out.read_text())["cpu"]


def test_bench_families_reports_each_family_against_llama_and_transformers(tmp_path):
    """Tiny Llama- and Gemma-3-shaped random models (saved once in ``--model-dir``): both systems run,
    every output has its length, ours carries its ratios to the Llama row and to transformers."""
    from experiments.offline import bench_families

    result = bench_families.main(["--tiny", "--families", "llama,gemma3", "--batch-sizes", "2", "--input-len", "8",
                                  "--output-len", "3", "--model-dir", str(tmp_path / "models"),
                                  "--attention-params", '{"compile": false}',  # eager kernel: not a compile test
                                  "--json-out", str(tmp_path / "out.json")])
    rows = {(r["family"], r["system"]): r for r in result["rows"]}
    assert set(rows) == {(f, s) for f in ("llama", "gemma3") for s in ("ours", "hf")}
    assert all(r["short_outputs"] == 0 and r["tok_s"] > 0 for r in rows.values())
    assert rows[("gemma3", "ours")]["vs_llama"].endswith("x") and rows[("gemma3", "ours")]["vs_hf"].endswith("x")
    assert (tmp_path / "out.json").is_file()


def test_kv_memory_sliding_reports_both_shapes_from_the_engine_metrics(capsys):
    """A 12-layer Gemma-3 pattern (two global layers: two layers per block), window 8, one 96-token request: the sliding model's
    sliding groups hold only their window's blocks, so it holds less KV than its full-attention twin."""
    from experiments.engine import kv_memory_sliding

    results = kv_memory_sliding.main(["--context-len", "96", "--output-len", "4", "--window", "8", "--layers", "12",
                                      "--head-dim", "8", "--block-size", "4", "--chunk", "32",
                                      "--kv-cache-memory-bytes", str(1 << 22)])
    sliding, full = results.values()
    assert full["kv_blocks"] == [24] and sliding["kv_blocks"][0] == 24  # ceil(95 / 4): the whole context
    assert all(n <= 3 for n in sliding["kv_blocks"][1:]), sliding  # ceil((8 - 1) / 4) + the last token's
    assert 0 < sliding["kv_bytes"] < full["kv_bytes"] and "ratio gemma3 / full attention" in capsys.readouterr().out


def test_roofline_reports_every_category(capsys):
    from experiments.engine import roofline

    roofline.main(["--model", STORIES, "--dtype", "float32", "--batch-sizes", "1,4", "--prompt-len", "16",
                   "--warmup-steps", "1", "--steps", "3"])
    printed = capsys.readouterr().out
    assert "GEMM peak" in printed
    rows = [line.split()[0] for line in printed.splitlines() if line.startswith("  ") and "measured" not in line]
    for category in (*roofline.CATEGORIES, "other", "engine", "step"):
        assert rows.count(category) == 2, category  # one row per batch size


def test_bench_vs_vllm_repeats_report_medians(capsys, tmp_path):
    """servelab alone (no vLLM mode), forced eager and as a user gets it (``default``: dtype and compile
    auto, told the run's budget): ``--repeats`` times each generate after a prefix-cache reset and
    reports the median, with every repeat in the rows."""
    from experiments.offline import bench_vs_vllm

    rows = bench_vs_vllm.main(["--model", STORIES, "--dtype", "float32", "--workload", "fixed", "--num-prompts", "4",
                               "--input-len", "16", "--output-len", "6", "--batch1-tokens", "4", "--repeats", "3",
                               "--servelab-modes", "eager,default", "--vllm-modes", "",
                               "--json-out", str(tmp_path / "out.json")])
    assert [row["system"] for row in rows] == ["servelab", "servelab_default"]
    for row in rows:
        assert row["output_tokens"] == 24 and len(row["all_tok_s"]) == len(row["all_b1_ms_per_token"]) == 3
        assert sorted(row["all_tok_s"])[1] == row["tok_s"]  # the median repeat
    out = capsys.readouterr().out
    assert "tok/s of each repeat" in out and "servelab_default: dtype=float32; engine.compile=auto: eager" in out
    assert (tmp_path / "out.json").is_file()


def test_bench_vs_vllm_interleave_rotates_rounds_and_pairs_them():
    """``--interleave``: one repeat of every system per round, the order rotating each round; blocks
    otherwise. Paired ratios are per round (ours / peer throughput, peer / ours batch-1 time)."""
    from experiments.offline import bench_vs_vllm

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

    from experiments.offline import bench_vs_vllm

    args = argparse.Namespace(vllm_python=sys.executable, workdir=str(tmp_path), batch1_tokens=2, prefix_caching="on",
                              dtype="float32")
    with pytest.raises(RuntimeError, match=r"(?s)vllm_compiled worker ended without READY.*No module named .vllm."):
        bench_vs_vllm.start_vllm("unused", [[1, 2]], [2], args, eager=False)


def test_profile_engine_whole_run_split_names_and_sums_its_categories():
    """``profile_engine.py --whole-run``: each profiler event lands in one category (the in-place
    kernel by its softmax ``amax``), and the reported shares cover the whole profiled time."""
    from experiments.engine import profile_engine

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


def test_compile_break_even_divides_the_warm_up_by_the_saving():
    """``compile_break_even.py``'s table (its two compiling child processes are too slow for the suite;
    a tiny run is in its docstring): break-even tokens = warm-up seconds / seconds saved per token,
    ``None`` where compiling saves nothing."""
    from experiments.engine import compile_break_even

    cold, cached = {"warm_up_s": 60.0}, {"warm_up_s": 12.0, "per_batch": {
        "1": {"eager": 0.032, "compiled": 0.016}, "64": {"eager": 0.0025, "compiled": 0.0019},
        "8": {"eager": 0.010, "compiled": 0.011}}}
    table = compile_break_even.break_even(cold, cached)
    assert round(table[1]["break_even_tokens_cold"]) == 3750 and round(table[1]["break_even_tokens_cached"]) == 750
    assert round(table[64]["break_even_tokens_cold"]) == 100_000 and abs(table[64]["saved_ms_per_token"] - 0.6) < 1e-9
    assert table[8]["break_even_tokens_cold"] is None



def test_compile_break_even_shards_the_engine_with_tensor_parallel_size(monkeypatch):
    """``--tensor-parallel-size 3`` builds ``executor=mp`` over three ranks (its children get the flag);
    1 keeps the in-process engine."""
    import argparse

    import framework
    from experiments.engine import compile_break_even

    built = []
    monkeypatch.setattr(framework, "LLM", lambda **kwargs: built.append(kwargs))
    for tp in (3, 1):
        compile_break_even.build_llm(argparse.Namespace(model="m", dtype="auto", tensor_parallel_size=tp), compile=True)
    assert built[0]["executor"] == "mp" and built[0]["tensor_parallel_size"] == 3 and built[0]["compile"] is True
    assert "executor" not in built[1] and "tensor_parallel_size" not in built[1]

EXPERIMENTS = REPO / "experiments"
SCRIPTS = sorted(p.relative_to(EXPERIMENTS).as_posix() for p in EXPERIMENTS.rglob("*.py")
                 if not p.name.startswith("_") and p.name != "common.py")  # _name.py, common.py: what scripts import


def test_eval_parity_compares_both_backends(tmp_path, capsys):
    """Tiny tasks on stories260K: both backends score every task, per-document loglikelihoods agree."""
    pytest.importorskip("lm_eval")
    from experiments.quality import eval_parity

    record = eval_parity.main(["--model", STORIES, "--num-mc", "2", "--num-ppl", "1", "--num-gen", "1",
                               "--out", str(tmp_path), "--", EAGER_KERNEL])  # eager kernel: not a compile test
    assert record["num_docs"] == {"servelab_mc_large": 2, "servelab_ppl_large": 1, "servelab_gen_large": 1}
    # a rolling document's loglikelihood sums hundreds of float32 log-probs, reduced in another order by each
    # backend and each CPU's kernels: 1.2e-4 apart under AVX2 (ATEN_CPU_CAPABILITY=avx2), 4e-6 with AVX-512;
    # a wrong engine is off by whole nats
    assert record["servelab_mc_large_max_abs_ll_diff"] < 5e-4 and record["servelab_ppl_large_max_abs_ll_diff"] < 5e-4
    assert record["gen_strings_differing"] == 0 and record["servelab_wall_s"] > 0 and record["hf_wall_s"] > 0
    assert (tmp_path / "eval_parity.json").is_file()


def test_bench_attention_times_each_cpu_backend(tmp_path):
    """On CPU: the CPU backends' kernel-only prefill/decode times and end-to-end tok/s at two batch sizes,
    CUDA graphs off (no CUDA); a backend this machine cannot run (triton: CUDA) is reported, not fatal."""
    from experiments.engine import bench_attention

    out = tmp_path / "bench.json"
    result = bench_attention.main(["--model", STORIES, "--dtype", "float32", "--batch-sizes", "1,4", "--input-len", "16",
                                   "--output-len", "4", "--repeats", "2", "--backends", "torch,torch_paged,triton",
                                   "--backend-params", '{"torch_paged": {"compile": false}}', "--json-out", str(out)])
    kernel = {(r["backend"], r["batch"]): r for r in result["kernel"]}
    assert set(kernel) == {(b, n) for b in ("torch", "torch_paged") for n in (1, 4)}
    assert all(r["prefill_ms"] > 0 and r["decode_ms"] > 0 for r in kernel.values())
    e2e = {(r["backend"], r["batch"], r["cuda_graphs"]): r for r in result["e2e"]}
    assert set(e2e) == {(b, n, False) for b in ("torch", "torch_paged") for n in (1, 4)}
    assert all(r["output_tok_s"] > 0 for r in e2e.values())
    assert "triton" in result["skipped"] and json.loads(out.read_text())["shape"]["head_size"] == 8


def test_bench_kv_offload_smoke(tmp_path):
    """Three tiny conversations at a thrashing KV budget: offload hits its tier, tokens equal recompute's."""
    from experiments.offline import bench_kv_offload

    out = tmp_path / "kv_offload.json"
    result = bench_kv_offload.main(["--model", STORIES, "--dtype", "float32", "--num-conversations", "3", "--turns",
                                    "3", "--first-len", "12", "--turn-len", "4", "--output-len", "4", "--block-size",
                                    "4", "--num-blocks", "12", "--attention-params", '{"compile": false}',  # not a compile test
                                    "--json-out", str(out)])
    systems = {r["system"]: r for r in result["systems"]}
    assert result["same_tokens"] and systems["offload"]["offload_hit_rate"] > 0
    assert systems["recompute"]["offload_hit_rate"] == 0 and json.loads(out.read_text())["machine"]["cpu"]


def test_readme_lists_every_script_with_its_command():
    readme = (EXPERIMENTS / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    for script in SCRIPTS:
        row = next((r for r in rows if r.startswith(f"| `{script}` |")), None)
        assert row is not None, f"experiments/README.md has no row for {script}"
        module = "experiments." + script.removesuffix(".py").replace("/", ".")
        assert f"python -m {module}" in row, f"the row of {script} gives no command running it"
    assert len(rows) == len(SCRIPTS), "experiments/README.md lists a script that does not exist"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.startswith("studies/")])
def test_studies_import_and_parse_their_arguments(script, capsys):
    """A study is not run (its finding is recorded); it must still import and parse ``--help``."""
    module = importlib.import_module("experiments." + script.removesuffix(".py").replace("/", "."))
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_soak_serving_smoke(tmp_path, capsys):
    """A few seconds of the soak under faults (stories260K): every check passes and the table and JSON are written."""
    pytest.importorskip("fastapi")
    from experiments.serving import soak_serving

    out = tmp_path / "soak.json"
    result = soak_serving.main(["--model", "stories260K", "--duration-s", "2", "--concurrency", "4",
                                "--burst-every-s", "1", "--burst-size", "8", "--max-tokens", "12",
                                "--json-out", str(out), "--", "engine.compile=false", EAGER_KERNEL])  # eager: not a compile test
    assert result["ok"], result
    assert result["num_requests"] > 0 and result["outcomes"]["unexpected"] == 0 and out.is_file()
    assert "rss_growth_mib_per_1k_requests" in json.loads(out.read_text())
    assert "check no_kv_leak" in capsys.readouterr().out


def test_bench_pipeline_reports_throughput_and_token_parity(tmp_path):
    """``bench_pipeline`` on stories260K, one rank and two pipeline stages: both rows, tokens equal."""
    from experiments.offline import bench_pipeline

    report = bench_pipeline.main(["--systems", "pp1", "pp2", "--batches", "2", "--prompt-len", "6",
                                  "--output-len", "3", "--json-out", str(tmp_path / "out.json")])
    assert set(report["systems"]) == {"pp1", "pp2"}
    for rows in report["systems"].values():
        assert rows[2]["output_tok_s"] > 0 and rows[2]["mean_step_ms"] > 0 and rows[2]["tokens_equal_first_system"]
    assert (tmp_path / "out.json").is_file()


def test_bench_parallel_reports_throughput_itl_and_the_overhead_split(tmp_path):
    """``bench_parallel`` on the tiny random model, two ``mp`` ranks: every column is there."""
    from experiments.offline import bench_parallel

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


def test_sim_fidelity_run_compares_a_real_and_a_simulated_run(tmp_path, capsys):
    """One workload on stories260K: the real run, the simulated one with a constant profile, the table."""
    from sim_helpers import linear_profile

    from experiments.sim import sim_fidelity

    rows = sim_fidelity.main(["run", "--model", "stories260K", "--workloads", "random_burst",
                              "--profile", linear_profile(tmp_path / "p.json", 0.01)])
    (row,) = rows
    assert set(row["errors"]) == set(sim_fidelity.GATES) and row["sim"]["sim_profile"] == "measured:constant@?"
    assert row["real"]["num_steps"] > 0 and "| random_burst |" in capsys.readouterr().out


def test_sim_routers_runs_every_router_over_simulated_replicas(tmp_path):
    from experiments.sim import sim_routers

    rows = sim_routers.main(["--replicas", "2", "--requests-per-replica", "2", "--workloads", "shared_prefix,multi_turn",
                             "--prefix-len", "64", "--turn-len", "16", "--output-len", "4", "--json-out",
                             str(tmp_path / "routers.json"),  # stories260K's shapes: a 0.2 s engine per cell, not 2 s
                             "--model", "stories260K", "--tp", "1", "--max-model-len", "256", "--", "engine.num_blocks=256"])
    assert len(rows) == 2 * len(sim_routers.ROUTERS.split(","))
    for row in rows:
        summary = row["summary"]
        assert summary["num_requests"] == row["num_requests"] and summary["data_parallel_size"] == 2
        assert sum(r["num_routed"] for r in summary["replicas"]) == row["num_requests"]
    assert (tmp_path / "routers.json").is_file()


def test_sim_scale_runs_the_ablation_and_plots(tmp_path):
    from experiments.sim import sim_scale

    rows = sim_scale.main(["--num-requests", "24", "--num-prefixes", "4", "--prefix-len", "256", "--output-len", "8",
                           "--schedulers", "fcfs,lpm", "--allocators", "paged,contiguous", "--json-out",
                           str(tmp_path / "scale.json"), "--plot-dir", str(tmp_path)])
    assert len(rows) == 4 and all(r["summary"]["num_requests"] == 24 for r in rows)
    assert all(r["summary"]["sim_profile"] == "analytic:h100" for r in rows)
    assert (tmp_path / "sim_scale_ablation.png").is_file() and (tmp_path / "sim_scale_kv_usage.png").is_file()


def test_bench_spec_decode_trees_puts_medusa_on_stories_without_heads(capsys):
    """``--trees`` on a target without Medusa/EAGLE heads: both drafters' rows run on stories260K, and it says so."""
    import argparse

    from experiments.offline import bench_spec_decode as bench

    args = argparse.Namespace(model="smollm2", medusa_model=None, eagle_model=None, static_tree=bench.MEDUSA_TREE,
                              eagle_static_tree=bench.EAGLE_TREE, tree_depth=3, topk=4, num_draft_tokens=16)
    systems = bench.tree_systems(args, "/nowhere/SmolLM2-135M-Instruct")
    assert [(d, s) for _, d, s, _ in systems] == [("medusa", "chain"), ("medusa", "static_tree"), ("eagle", "chain"),
                                                  ("eagle", "static_tree"), ("eagle", "dynamic_tree")]
    assert {target for target, _, _, _ in systems} == {STORIES}
    assert "medusa runs on stories260K only" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_spec_decode_trees_smoke(tmp_path, capsys):
    """The whole ``--trees`` comparison at tiny settings on stories260K: every system's row, and the CPU line."""
    from experiments.offline import bench_spec_decode as bench

    rows = bench.main(["--trees", "--model", STORIES, "--dtype", "float32", "--batch-sizes", "1", "--num-prompts", "1",
                       "--output-len", "4", "--workloads", "chat", "--json-out", str(tmp_path / "trees.json")])
    assert [r["system"] for r in rows] == ["nospec", "chain", "static_tree", "chain", "static_tree", "dynamic_tree"]
    assert all(r["mean_accepted_len"] >= 1.0 for r in rows[1:]) and "ISA:" in capsys.readouterr().out
    assert json.loads((tmp_path / "trees.json").read_text())["machine"]["cpu"]


def test_bench_quant_checkpoint_writes_the_checkpoint_and_reports_the_bars(tmp_path, capsys):
    """The GPTQ checkpoint is written once into --workdir, each system reports its timings, the issue's two bars
    are printed against bf16, and vLLM is skipped with its reason when its interpreter is missing."""
    from experiments.offline import bench_quant_checkpoint

    out = tmp_path / "quant.json"
    report = bench_quant_checkpoint.main([
        "--model", STORIES, "--group-size", "32", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
        "--batch1-tokens", "4", "--systems", "bf16,gptq_fast,vllm", "--workdir", str(tmp_path),
        "--vllm-python", str(tmp_path / "no-python"), "--attention-params", '{"compile": false}',  # not a compile test
        "--json-out", str(out)])
    printed = capsys.readouterr().out
    assert set(report["results"]) == {"bf16", "gptq_fast"} and "vllm: skipped, no interpreter" in printed
    assert "batch 1: gptq_fast is" in printed and "batch N: bf16 is" in printed
    assert (tmp_path / "stories260K-gptq-w4-g32" / "config.json").is_file() and json.loads(out.read_text())["machine"]
