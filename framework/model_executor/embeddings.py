"""The target's input embedding and LM head alone, for drafters that run on the driver (EAGLE)
while the target's ranks live in worker processes."""

from __future__ import annotations

from pathlib import Path

import torch

from framework.model_executor.model_loader import resolve_model_path


class TargetEmbeddings(torch.nn.Module):
    """``embed_tokens`` + ``lm_head`` of a causal LM with transformers' accessors.

    Args:
        embed: (vocab, hidden) input embedding weight.
        lm_head: (vocab, hidden) LM head weight; ``None`` ties it to ``embed``.
    """

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        self.lm_head.weight = self.embed_tokens.weight if lm_head is None else torch.nn.Parameter(lm_head, False)

    def get_input_embeddings(self) -> torch.nn.Module:
        """The ``(vocab, hidden)`` embedding (transformers' accessor)."""
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        """The LM head, ``hidden -> vocab`` logits (transformers' accessor)."""
        return self.lm_head


def _checkpoint_tensors(path: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint in ``path`` (safetensors, sharded or not, else
    ``pytorch_model.bin``), reading nothing else."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in names & set(f.keys())})
    if not files and (path / "pytorch_model.bin").is_file():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", mmap=True, weights_only=True)
        out = {k: state[k] for k in names & set(state)}
    return out


def load_embeddings(model: str, dtype: str = "float32", device: str = "cpu") -> TargetEmbeddings:
    """Only the input embedding and the LM head of ``model`` (tied when the checkpoint stores no
    separate LM head): ``2 x vocab x hidden`` weights at most instead of the whole model.

    Raises:
        FileNotFoundError: the checkpoint holds no input embedding (the message names the folder).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(resolve_model_path(model))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):  # parameter names only
        skeleton = AutoModelForCausalLM.from_config(config)
    names: dict[int, str] = {}  # parameter -> its first name (a tied LM head shares the embedding's)
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    in_name = names[id(skeleton.get_input_embeddings().weight)]
    out_name = names[id(skeleton.get_output_embeddings().weight)]
    tensors = _checkpoint_tensors(path, {in_name, out_name})
    if in_name not in tensors:
        raise FileNotFoundError(f"{path}: the checkpoint has no tensor {in_name!r}")
    tied = out_name == in_name or out_name not in tensors
    module = TargetEmbeddings(tensors[in_name], None if tied else tensors[out_name])
    return module.to(device=device, dtype=getattr(torch, dtype)).eval()
