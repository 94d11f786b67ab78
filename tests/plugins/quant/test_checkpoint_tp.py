"""Pre-quantized checkpoints under tensor parallelism: packed layers shard along their groups
(``plugins/quant/_checkpoint_tp.py``).

Unit level (no engine): a rank's slice of an unpacked layer dequantizes to the same slice of the whole layer's
weight, for column and row shards, in-order groups, act-order and one group per row, at TP=2 and TP=3; the int4
kernel runs a shard; a row shard splitting a group is refused before weights load. Engine level (executor=mp,
stories260K, float32 greedy): TP=2 with ``kernel=reference`` equals transformers on the dequantized weights (which
TP=1 equals, ``test_checkpoints.py``) for GPTQ act-order, AWQ and compressed-tensors; the fast kernel at TP=2
picks the oracle's argmax up to near ties.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import REPO, STORIES

from framework.config import EngineConfig
from framework.core.sampling_params import SamplingParams
from framework.model_executor.parallel_layers import PackedShard, Shard, even_range
from plugins.quant._checkpoint_linears import Int4CheckpointLinear, IntWeights, fast_linear
from plugins.quant._checkpoint_tp import shard_weights
from plugins.quant.gptq import GPTQ

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

_spec = importlib.util.spec_from_file_location("quantize_checkpoint", REPO / "scripts" / "quantize_checkpoint.py")
qc_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qc_script)

#: name -> (format, quantizer options): stories260K's attention projections are packed (4-bit: its MLP's 172
#: features are not a multiple of 8); at TP=2 o_proj holds 32 input features per rank, one group of 32
CHECKPOINTS = {"gptq_w4_g32_desc_act_asym": ("gptq", {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}),
               "awq_w4_g32": ("awq", {"bits": 4, "group_size": 32, "sym": False}),
               "ct_w4a16_g32_asym": ("compressed-tensors", {"bits": 4, "group_size": 32, "sym": False})}
PROMPTS = ["Once upon a time", "Lily and Ben went to the park and"]
MAX_NEW = 16
FAST_REL_TOL = 1e-3  # as test_checkpoints.py: the int4 kernel sums in another order than the float oracle


def _weights(out_f: int, in_f: int, group: int, act_order: bool, seed: int = 0) -> IntWeights:
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group == -1 else in_f // group
    g_idx = torch.arange(in_f) * groups // in_f
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, generator=gen)]
    return IntWeights(codes=torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.int32),
                      zeros=torch.randint(1, 15, (out_f, groups), generator=gen, dtype=torch.int32),
                      scales=torch.rand(out_f, groups, generator=gen) + 0.1, g_idx=g_idx, bits=4,
                      bias=torch.randn(out_f, generator=gen))


@pytest.mark.parametrize("tp_size", [2, 3])
@pytest.mark.parametrize("group, act_order", [(32, False), (32, True), (-1, False)])
def test_shards_dequantize_to_slices_of_the_layer(tp_size: int, group: int, act_order: bool) -> None:
    w = _weights(96, 192, group, act_order)
    full = w.dequantize()
    for rank in range(tp_size):
        start, stop = even_range(96, rank, tp_size)
        col = shard_weights(w, Shard(0, start, stop, stop - start), "layer", tp_size)
        assert torch.equal(col.dequantize(), full[start:stop]) and torch.equal(col.bias, w.bias[start:stop])
        start, stop = even_range(192, rank, tp_size)
        row = shard_weights(w, Shard(1, start, stop, stop - start), "layer", tp_size)
        assert torch.equal(row.dequantize(), full[:, start:stop]) and row.bias is None  # bias added once
        if group != -1 and not act_order:  # in-order groups: each rank keeps only its groups' scales
            assert row.scales.shape[1] == (stop - start) // group


def test_packed_column_shard_takes_each_section() -> None:
    w = _weights(64, 64, 32, False)
    shard = PackedShard((Shard(0, 0, 16, 16), Shard(0, 32, 48, 16)))
    assert torch.equal(shard_weights(w, shard, "gate_up", 2).dequantize(),
                       torch.cat([w.dequantize()[0:16], w.dequantize()[32:48]]))


def test_row_shard_splitting_a_group_is_refused() -> None:
    w = _weights(32, 192, 64, False)
    with pytest.raises(ValueError, match=r"o_proj: tensor_parallel_size=2 .* splits a group of group_size=64"):
        shard_weights(w, Shard(1, 96, 192, 96), "o_proj", 2)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_kernel_runs_a_column_shard(act_order: bool) -> None:
    w = _weights(64, 128, 32, act_order)
    shard = shard_weights(w, Shard(0, 32, 64, 32), "q_proj", 2)
    module, why = fast_linear(shard, torch.float32)
    assert type(module) is Int4CheckpointLinear, why
    x = torch.randn(5, 128)
    ref = x @ w.dequantize()[32:64].t() + w.bias[32:64]
    assert (module(x) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_group_splitting_tp_size_refused_before_weights_load(tmp_path) -> None:
    folder = tmp_path / "gptq_g64"
    qc_script.quantize_checkpoint(STORIES, folder, "gptq", bits=4, group_size=64, sym=True)
    problems = GPTQ.validate_tp(EngineConfig(model=str(folder)), 2)
    assert any("layers.*.self_attn.o_proj (row-parallel) holds in_features=32 per rank, which splits its "
               "groups of group_size=64" in p for p in problems), problems
    assert GPTQ.validate_tp(EngineConfig(model=str(folder)), 1) == []
    from framework import LLM

    with pytest.raises(ValueError, match=r"quant=gptq with tensor_parallel_size=2: .*o_proj .*group_size=64"):
        LLM(model=str(folder), tensor_parallel_size=2, executor="mp")  # refused before any worker starts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """name -> (folder, layer -> dequantized float32 weight)."""
    root = tmp_path_factory.mktemp("quantized_tp")
    return {name: (str(root / name), qc_script.quantize_checkpoint(STORIES, root / name, fmt, **opts))
            for name, (fmt, opts) in CHECKPOINTS.items()}


def _oracle(dequantized: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' stories260K with the quantized layers' weights replaced by their dequantized values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    assert not model.load_state_dict({f"{k}.weight": v for k, v in dequantized.items()}, strict=False).unexpected_keys
    return model


def _tp_greedy(make_llm, folder: str, kernel: str) -> tuple[list[list[int]], list[list[int]]]:
    llm = make_llm(model=folder, dtype="float32", quant_params={"kernel": kernel}, num_blocks=64,
                   tensor_parallel_size=2, executor="mp")
    tok = llm.engine.tokenizer
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    return prompt_ids, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_tp2_reference_kernel_matches_transformers_on_dequantized_weights(make_llm, checkpoints, name: str) -> None:
    folder, dequantized = checkpoints[name]
    prompt_ids, outputs = _tp_greedy(make_llm, folder, "reference")
    oracle = _oracle(dequantized)
    for ids, out in zip(prompt_ids, outputs):
        with torch.inference_mode():
            seq = oracle.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out == seq[0, len(ids):].tolist()


def test_tp2_fast_kernel_agrees_with_the_oracle(make_llm, checkpoints) -> None:
    """GPTQ act-order at TP=2: q/k/v shards run the int4 kernel (with their input permutation), o_proj's
    act-order row shard the reference; each token's logit within FAST_REL_TOL of the oracle's maximum."""
    folder, dequantized = checkpoints["gptq_w4_g32_desc_act_asym"]
    prompt_ids, outputs = _tp_greedy(make_llm, folder, "auto")
    oracle = _oracle(dequantized)
    for ids, out in zip(prompt_ids, outputs):
        with torch.inference_mode():
            logits = oracle(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
        gap = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert bool((gap <= FAST_REL_TOL * logits.abs().max(-1).values).all()), gap.max()
