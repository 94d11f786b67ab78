"""``experiments/quality/eval_quant_paths.py``'s verdict: a fast path's lm-eval scores against the reference path's
within the stated tolerances, and out of them when accuracy or bits per byte move too far (its runs are
``servelab eval`` runs, tested in ``test_experiment_scripts.py::test_eval_parity_compares_both_backends``)."""

from __future__ import annotations

from experiments.quality.eval_quant_paths import against_reference

REF = {"servelab_mc_large": {"acc": 0.30, "acc_norm": 0.32}, "servelab_ppl_large": {"bits_per_byte": 2.0}}
SAMPLES = {("servelab_mc_large", 0): [[-1.5, False]], ("servelab_ppl_large", 0): [-900.0],
           ("servelab_gen_large", 0): ["12"]}


def _scores(acc: float, bpb: float) -> dict:
    return {"servelab_mc_large": {"acc": acc, "acc_norm": 0.32}, "servelab_ppl_large": {"bits_per_byte": bpb}}


def test_within_and_out_of_tolerance() -> None:
    near = {("servelab_mc_large", 0): [[-1.25, False]], ("servelab_ppl_large", 0): [-901.0],
            ("servelab_gen_large", 0): ["13"]}
    got = against_reference(_scores(0.31, 2.01), REF, near, SAMPLES, acc_tol=0.02, bpb_rel_tol=0.01)
    assert got["within_tolerance"] and got["gen_strings_differing"] == 1
    assert abs(got["servelab_mc_large_acc_diff"] - 0.01) < 1e-12 and got["servelab_mc_large_max_abs_ll_diff"] == 0.25
    assert abs(got["servelab_ppl_large_bits_per_byte_rel_diff"] - 0.005) < 1e-12
    assert not against_reference(_scores(0.33, 2.0), REF, SAMPLES, SAMPLES, 0.02, 0.01)["within_tolerance"]
    assert not against_reference(_scores(0.30, 2.03), REF, SAMPLES, SAMPLES, 0.02, 0.01)["within_tolerance"]
