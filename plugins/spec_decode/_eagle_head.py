"""The EAGLE-1 draft head and its checkpoint layout (shared by the drafter and the trainer).

EAGLE (Li et al., ICML 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", Sec. 3) drafts at the *feature* level: the target's last hidden state f_i (after its
final norm, the input of its LM head) at position i and the embedding of the token x_{i+1} sampled
from it are fused by ``fc`` into one vector, one decoder layer (attending over earlier positions)
predicts the next feature f_{i+1}, and the target's own LM head turns that into a draft token.
Repeating with the predicted feature drafts k tokens.

Checkpoint layout (the published EAGLE-1 one, e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``): a folder
with ``config.json`` (a Llama config; ``num_hidden_layers`` is the head's layer count, usually 1)
and ``pytorch_model.bin`` or ``model.safetensors`` holding ``fc.weight`` ((hidden, 2*hidden);
``fc.bias`` optional) and ``layers.<i>.*`` in transformers' Llama decoder-layer names. Layer 0 has
no input norm (EAGLE-1 feeds ``fc``'s output straight in) and there is no final norm. A stored
``embed_tokens.weight`` is ignored: the head shares the target's embedding and LM head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plugins.spec_decode._weight_files import read_first_weight_file

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
IGNORED_KEYS = ("embed_tokens.weight", "layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight")


def load_head_config(path: str | Path) -> Any:
    """The head's ``LlamaConfig`` from ``path/config.json``.

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
    """
    from transformers import LlamaConfig

    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"EAGLE head {str(path)!r} has no config.json; give spec_decode.params.model=PATH of "
                                "a folder in the EAGLE layout (train one with python -m experiments.quality.train_eagle)")
    data = json.loads(cfg_file.read_text())
    data.pop("architectures", None)
    data["model_type"] = "llama"
    return LlamaConfig(**{k: v for k, v in data.items() if k != "model_type"})


class EagleHead(nn.Module):
    """EAGLE-1 head: ``fc([embed(x_{i+1}) ‖ f_i])`` then ``num_hidden_layers`` Llama decoder layers.

    Args:
        config: the head's Llama config (``hidden_size`` must equal the target's).
        embed_tokens: the target's input embedding, shared (never trained or stored here).
        bias: whether ``fc`` has a bias (EAGLE-1 Vicuna heads do, LLaMA-3 heads do not).

    The attention implementation is ``config._attn_implementation``: ``"servelab"`` (paged, through
    the forward context) when drafting, ``"sdpa"`` (causal, padded batches) when training.
    """

    def __init__(self, config: Any, embed_tokens: nn.Module, bias: bool = True) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: fc's output enters layer 0 un-normed
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._embed = [embed_tokens]  # a list, so the shared embedding is not a submodule (not saved)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predict the next feature at every position.

        Args:
            input_ids: ``(batch, seq) int64``: x_{i+1}, the token sampled from feature f_i.
            position_ids: ``(batch, seq) int64``.
            features: ``(batch, seq, hidden)``, the target's (or the head's own predicted) f_i.

        Returns:
            ``(batch, seq, hidden)``: predicted f_{i+1}, for the target's LM head.
        """
        emb = self._embed[0](input_ids).to(features.dtype)
        hidden = self.fc(torch.cat([emb, features], dim=-1))
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in the EAGLE checkpoint layout (no embedding, no rotary buffers)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(("fc.", "layers."))}


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The head's weights from ``model.safetensors`` or ``pytorch_model.bin`` in ``path``.

    Raises:
        FileNotFoundError: neither file exists.
    """
    return read_first_weight_file(path, WEIGHT_FILES, "EAGLE head")


def load_head(path: str | Path, embed_tokens: nn.Module, dtype: torch.dtype, device: torch.device,
              attn_implementation: str) -> EagleHead:
    """Build an :class:`EagleHead` from a folder in the EAGLE layout.

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: weights missing or of the wrong shape for the config.
    """
    config = load_head_config(path)
    config._attn_implementation = attn_implementation
    weights = {k: v for k, v in read_weights(path).items() if k not in IGNORED_KEYS}
    head = EagleHead(config, embed_tokens, bias="fc.bias" in weights)
    expected = head.head_state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [k for k in expected if k in weights and weights[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"EAGLE head {str(path)!r} does not match its config.json: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}, wrong shape {wrong[:4]}")
    head.load_state_dict(weights, strict=False)
    return head.to(device=device, dtype=dtype).eval()


def save_head(head: EagleHead, path: str | Path) -> None:
    """Write ``config.json`` and ``pytorch_model.bin`` (the published EAGLE-1 file names)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config.pop("_attn_implementation", None)
    config.update(architectures=["LlamaForCausalLM"], bias=head.fc.bias is not None, torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    torch.save({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in head.head_state_dict().items()},
               folder / "pytorch_model.bin")
