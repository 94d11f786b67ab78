"""``servelab models``: the decoder families servelab runs, what each needs and which backends run it.

The rows are :data:`framework.model_executor.model_families.FAMILIES`; the backends column asks every
registered attention backend whether it has the features the family's checkpoints use (sliding
window, softcap, sinks, MLA's latent cache: ``supports_*``). Head sizes are checked per checkpoint when an engine is
built (``validate_model``); MLA families need the value head size padded to the key head size. For
families with sliding windows, the KV-saving column lists the registered KV allocators that release
out-of-window blocks (``KVAllocator.supports_kv_cache_groups``); the others keep every block. A last line
names the pre-quantized checkpoint formats that load (:func:`checkpoint_formats`).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework import registry
from framework.interfaces.attention import CAPABILITY_OF, FEATURE_NAMES
from framework.model_executor.model_families import FAMILIES, TP_VERIFIED, ModelFamily


@dataclass(frozen=True)
class FamilyRow:
    """One printed row of ``servelab models``."""

    family: str  # family name
    architecture: str  # transformers class
    model_types: str  # config.model_type values, comma-separated
    needs: str  # attention features, then model traits
    backends: str  # registered attention backends with every feature it needs ("(CUDA)": GPU-only)
    kv_saving: str  # KV allocators releasing its out-of-window blocks ("-": no sliding window)
    test: str  # pytest node id of its tiny random-weight parity test
    tp: str  # tensor parallelism: "verified at TP=2" (equals transformers) or "refused: <reason>"


def backends_for(family: ModelFamily) -> list[str]:
    """Registered attention backends declaring every feature ``family`` uses (``"(CUDA)"`` marks GPU-only)."""
    names = []
    for name, cls in sorted(registry.available("attention").items(), key=lambda item: (item[1].requires_cuda, item[0])):
        if all(getattr(cls, CAPABILITY_OF[feature]) for feature in family.features):
            names.append(f"{name} (CUDA)" if cls.requires_cuda else name)
    return names


def kv_saving_allocators(family: ModelFamily) -> str:
    """Registered KV allocators that release the family's out-of-window KV blocks (sliding-window KV memory),
    comma-separated; ``"-"`` for a family without sliding windows (nothing to release)."""
    if "sliding_window" not in family.features:
        return "-"
    return ", ".join(sorted(name for name, cls in registry.available("kv_allocator").items()
                            if cls.supports_kv_cache_groups))


def family_rows() -> list[FamilyRow]:
    """One :class:`FamilyRow` per family of :data:`FAMILIES`, in table order."""
    return [FamilyRow(f.name, f.architecture, ", ".join(f.model_types),
                      ", ".join([FEATURE_NAMES[x] for x in f.features] + list(f.traits)) or "-",
                      ", ".join(backends_for(f)), kv_saving_allocators(f), f.test,
                      "verified at TP=2" if f.tp == TP_VERIFIED else f"refused: {f.tp}") for f in FAMILIES]


def checkpoint_formats() -> str:
    """The pre-quantized checkpoint formats registered quant methods load (``QuantMethod.checkpoint_format``),
    as ``"<format> (quant=<method>), ..."``; ``"none"`` when no method loads one."""
    from framework.model_executor.quantized_checkpoint import checkpoint_methods

    return ", ".join(f"{fmt} (quant={name})" for fmt, name in sorted(checkpoint_methods().items())) or "none"


def markdown_table() -> str:
    """The README's table of :func:`family_rows` (GitHub Markdown)."""
    lines = ["| family | architecture | needs | attention backends | sliding-window KV released by | test | "
             "tensor parallel |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.family} | `{r.architecture}` | {r.needs} | {r.backends} | {r.kv_saving} | "
              f"`{r.test.split('::')[1]}` | {r.tp} |" for r in family_rows()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``servelab models [--markdown]``: print the table (rich, or Markdown for the README)."""
    if argv and "--markdown" in argv:
        print(markdown_table())
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="servelab models (tests in tests/framework/model_executor/test_families.py; refused before loading: "
                        "encoder-decoder, non-causal, attention outside transformers' interface such as Falcon, "
                        "chunked/linear/state-space layers)", header_style="bold")
    for column in ("family", "architecture", "model_type", "needs", "attention backends",
                   "sliding-window KV released by", "test", "tensor parallel"):
        table.add_column(column)
    for r in family_rows():
        table.add_row(r.family, r.architecture, r.model_types, r.needs, r.backends, r.kv_saving, r.test.split("::")[1],
                      r.tp)
    console = Console(width=240)
    console.print(table)
    console.print(f"pre-quantized checkpoints (config.json quantization_config, detected): {checkpoint_formats()}; "
                  "docs/quantization.md")
    return 0
