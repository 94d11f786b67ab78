"""Reading a drafter's weights from the first of its checkpoint's file names that exists (safetensors or a torch
pickle), as the EAGLE and Medusa releases ship them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def read_first_weight_file(folder: str | Path, names: Sequence[str], what: str, hint: str = "") -> dict[str, torch.Tensor]:
    """The state dict in the first of ``names`` (``*.safetensors``, else a ``torch.save`` file, read with
    ``weights_only=True``) that exists in ``folder``; tensors on the CPU.

    Raises:
        FileNotFoundError: none of ``names`` exists; the message names ``what`` (e.g. ``"EAGLE head"``) and ends
            with ``hint`` (how to get the files).
    """
    folder = Path(folder)
    for name in names:
        file = folder / name
        if file.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{what} {str(folder)!r} has neither {' nor '.join(names)}{hint}")
