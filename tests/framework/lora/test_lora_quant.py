"""Multi-LoRA over a quantized base on stories260K (float32, greedy): ``quant=int8_wo``, ``int4_wo`` and GPTQ, AWQ and
compressed-tensors W4A16 checkpoints (GPTQ also ``kernel=reference``); a W8A8 checkpoint refused. vLLM's rule: the base layer is quantized, the LoRA term is added to its output in
the compute dtype. The oracle is PEFT's ``PeftModel`` over transformers' stories260K whose quantized linears are
replaced by their dequantized weights (read back from the quantized layer itself: ``W^T = layer(I)``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import REPO, STORIES
from lora_peft import NUM_TOKENS, PROMPTS, base_model, peft

from framework import LLM, SamplingParams, registry
from framework.model_executor.lora_layers import PLAIN_LINEARS, LoRALinear

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

#: stories260K's MLP (172 wide) has no int4 layout: int4_wo quantizes attention only, as its own tests do
QUANT = {"int8_wo": {}, "int4_wo": {"group_size": 32, "skip": ["gate_proj", "up_proj", "down_proj"]}}
NAMES = ["attn", None, "mlp", "all", "attn"]


def _dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every quantized linear replaced by an ``nn.Linear`` holding its dequantized weight."""
    for name, module in list(model.named_modules()):
        if hasattr(module, "in_features") and not isinstance(module, torch.nn.Linear) and not list(module.children()):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            with torch.no_grad():
                linear.weight.copy_(module(torch.eye(module.in_features)).T)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
    return model


def _peft_greedy(model: torch.nn.Module, adapter: str | None, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    ids = AutoTokenizer.from_pretrained(STORIES)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NUM_TOKENS, do_sample=False, max_length=None)
    return out[0, ids.shape[1]:].tolist()


def _check_mixed_batch(llm: LLM, adapters, make_oracle_model, quantized_layers: bool = True) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(NAMES))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                        lora_request=[adapters[n] if n else None for n in NAMES])
    for prompt, name, out in zip(prompts, NAMES, outs):
        assert out.error is None, out.error
        expected = _peft_greedy(make_oracle_model(), adapters[name].lora_path if name else None, prompt)
        assert out.outputs[0].token_ids == expected, (prompt, name)
    wrapped = llm.engine.executor.worker.lora.layers.values()
    assert any(type(layer.base) not in PLAIN_LINEARS for layer in wrapped) == quantized_layers  # prepacked: float


@pytest.mark.parametrize("quant", sorted(QUANT))
def test_a_mixed_batch_over_a_weight_only_quantized_base_equals_peft(quant, adapters):
    llm = LLM(STORIES, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, num_blocks=128,
              quant=quant, quant_params=QUANT[quant])

    def oracle_model():
        return _dequantized(registry.create("quant", quant, **QUANT[quant]).apply(base_model()))
    _check_mixed_batch(llm, adapters, oracle_model)


def _quantize_checkpoint():
    spec = importlib.util.spec_from_file_location("quantize_checkpoint", REPO / "scripts" / "quantize_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.quantize_checkpoint


@pytest.mark.parametrize("fmt, kernel, extra", [("gptq", "reference", {"sym": True}), ("gptq", "auto", {"sym": True}),
                                                 ("awq", "auto", {}), ("compressed-tensors", "auto", {"sym": False})])
def test_a_mixed_batch_over_a_checkpoint_equals_peft(fmt, kernel, extra, adapters, tmp_path):
    """GPTQ, AWQ and compressed-tensors (W4A16) checkpoints. ``reference``: dequantized ``nn.Linear`` layers;
    ``auto``: the int4 CPU kernel's layers, LoRA-wrapped."""
    dequantized = _quantize_checkpoint()(STORIES, tmp_path / fmt, fmt, bits=4, group_size=32, **extra)
    llm = LLM(str(tmp_path / fmt), dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2,
              num_blocks=128, quant_params={"kernel": kernel})
    assert llm.engine.config.quant == fmt.replace("-", "_")

    def oracle_model():
        model = base_model()
        model.load_state_dict({f"{k}.weight": v for k, v in dequantized.items()}, strict=False)
        return model
    _check_mixed_batch(llm, adapters, oracle_model, quantized_layers=kernel == "auto")


def test_a_checkpoint_with_quantized_activations_is_refused_under_lora(tmp_path):
    """compressed-tensors W8A8 quantizes each layer's inputs: LoRA over it is refused before weights load, naming
    the weight-only formats that work."""
    _quantize_checkpoint()(STORIES, tmp_path / "w8a8", "compressed-tensors", bits=8, group_size=-1,
                           ct_format="int-quantized")
    with pytest.raises(ValueError, match="quantized input activations .* use a pack-quantized"):
        LLM(str(tmp_path / "w8a8"), dtype="float32", enable_lora=True, max_lora_rank=8, num_blocks=128)


def test_a_quantized_linear_gets_slots_in_the_compute_dtype():
    quant = registry.create("quant", "int8_wo")
    layer = quant.apply(base_model()).model.layers[0].self_attn.q_proj
    wrapped = LoRALinear(layer, max_loras=2, max_lora_rank=4, dtype=torch.float32)
    assert wrapped.lora_a.shape == (2, 4, layer.in_features) and wrapped.lora_a.dtype == torch.float32
    with pytest.raises(ValueError, match="compute dtype"):
        LoRALinear(layer, max_loras=2, max_lora_rank=4)
