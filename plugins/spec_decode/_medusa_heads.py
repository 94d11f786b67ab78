"""Medusa-1 heads and their checkpoint layout (shared by the drafter and the trainer).

Medusa (Cai et al., ICML 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
Sec. 2.1.1): K extra heads read the target's last hidden state ``h_t`` (after its final norm, the LM head's input);
head ``k`` (0-based) predicts the token ``k + 2`` positions ahead, ``x_{t+k+2}``, while the target's own LM head
predicts ``x_{t+1}``. Each head is ``medusa_num_layers`` residual blocks ``x + SiLU(W x + b)`` and then its own LM
head ``Linear(hidden, vocab, bias=False)``.

Checkpoint layout (the public Medusa one, e.g. ``FasterDecoding/medusa-vicuna-7b-v1.3``): a folder with
``config.json`` (``medusa_num_heads``, ``medusa_num_layers``; other keys such as ``base_model_name_or_path`` are
ignored) and ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` holding ``{i}.{j}.linear.weight``
``(hidden, hidden)`` and ``{i}.{j}.linear.bias`` ``(hidden,)`` for block ``j < medusa_num_layers`` and
``{i}.{medusa_num_layers}.weight`` ``(vocab, hidden)`` for head ``i``. Hidden size and vocabulary come from the
weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from plugins.spec_decode._weight_files import read_first_weight_file

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass(frozen=True)
class MedusaConfig:
    """What ``config.json`` and the weights' shapes say about a folder of Medusa heads."""

    num_heads: int  # K, heads (``medusa_num_heads``)
    num_layers: int  # residual blocks per head (``medusa_num_layers``)
    hidden_size: int  # the target's hidden size, from ``0.0.linear.weight``
    vocab_size: int  # the target's vocabulary, from ``0.{num_layers}.weight``


class ResBlock(nn.Module):
    """Medusa's residual block: ``x + SiLU(linear(x))`` (the linear zero-initialised, so a new block is identity).

    Args:
        hidden_size: channels in and out.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., hidden)`` -> ``(..., hidden)``."""
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa-1 heads; ``heads[i]`` is ``nn.Sequential(ResBlock * num_layers, Linear(hidden, vocab))``, so the
    state dict's keys are the public layout's.

    Args:
        config: head count, blocks per head, hidden size, vocabulary.
    """

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)],
                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of every head.

        Args:
            hidden: ``(..., hidden)`` the target's last hidden states.

        Returns:
            ``(num_heads, ..., vocab)`` logits; head ``k`` predicts the token ``k + 2`` positions after ``hidden``'s.
        """
        return torch.stack([head(hidden) for head in self.heads])

    def layout_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the public Medusa keys (``{i}.{j}.linear.weight``, ``{i}.{num_layers}.weight``)."""
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}


def read_medusa_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The heads' weights from ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` in ``path``.

    Raises:
        FileNotFoundError: neither file exists.
    """
    return read_first_weight_file(path, WEIGHT_FILES, "Medusa heads",
                                  "; train some with python -m experiments.quality.train_medusa")


def load_medusa_config(path: str | Path) -> MedusaConfig:
    """The :class:`MedusaConfig` of a folder (``config.json`` plus the weights' shapes).

    Raises:
        FileNotFoundError: no ``config.json`` or no weights.
        ValueError: ``config.json`` lacks ``medusa_num_heads``/``medusa_num_layers``, or a first-head weight is missing.
    """
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"Medusa heads {str(path)!r} have no config.json; give spec_decode.params.model=PATH of "
                                "a folder in the Medusa layout (e.g. models/stories260K-medusa)")
    data = json.loads(cfg_file.read_text())
    if "medusa_num_heads" not in data or "medusa_num_layers" not in data:
        raise ValueError(f"Medusa heads {str(path)!r}: config.json needs medusa_num_heads and medusa_num_layers")
    heads, layers = int(data["medusa_num_heads"]), int(data["medusa_num_layers"])
    weights = read_medusa_weights(path)
    lm_key, block_key = f"0.{layers}.weight", "0.0.linear.weight"
    if lm_key not in weights or (layers and block_key not in weights):
        raise ValueError(f"Medusa heads {str(path)!r}: weights lack {lm_key!r} or {block_key!r} for "
                         f"medusa_num_layers={layers}")
    vocab, hidden = weights[lm_key].shape
    return MedusaConfig(num_heads=heads, num_layers=layers, hidden_size=int(hidden), vocab_size=int(vocab))


def load_medusa_heads(path: str | Path, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    """Build :class:`MedusaHeads` from a folder in the Medusa layout.

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: weights missing, unexpected or of the wrong shape for ``config.json``.
    """
    heads = MedusaHeads(load_medusa_config(path))
    weights = read_medusa_weights(path)
    expected = heads.layout_state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [k for k in expected if k in weights and weights[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"Medusa heads {str(path)!r} do not match their config.json: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}, wrong shape {wrong[:4]}")
    heads.heads.load_state_dict(weights)
    return heads.to(device=device, dtype=dtype).eval()


def save_medusa_heads(heads: MedusaHeads, path: str | Path, base_model: str = "") -> None:
    """Write ``config.json`` and ``medusa_lm_head.safetensors`` (the public Medusa file names)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": heads.config.num_heads, "medusa_num_layers": heads.config.num_layers,
              "hidden_size": heads.config.hidden_size, "vocab_size": heads.config.vocab_size,
              "base_model_name_or_path": base_model}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in heads.layout_state_dict().items()},
              str(folder / WEIGHT_FILES[0]))
