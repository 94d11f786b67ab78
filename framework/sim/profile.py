"""Profile files: measured (or analytic) step times of one model on one device, and where they are kept.

A profile is a JSON file (``FORMAT`` 1):

* ``source``: ``measured`` (``servelab profile`` timed the real engine) or ``analytic`` (a roofline);
* ``key``: what the step times depend on (:func:`profile_key`): the model's shapes, the device, dtype,
  KV cache dtype, attention backend, quant method, compile, tensor-parallel size, threads;
* ``samples``: one row per measured step, its :class:`~framework.sim.features.StepFeatures` plus ``step_s``
  (the whole ``engine.step()``) and ``execute_s`` (the executor's ``execute_model``), seconds;
* ``predictor``: the regression fit on the samples (``framework.sim.predictor``), so loading one needs no
  fitting; ``grammar_mask_s_per_row``: the measured cost of one structured-output bitmask row.

``executor.params.profile=auto`` looks for a file whose ``key`` equals the run's, first among the profiles
shipped with servelab (:data:`SHIPPED_DIR`), then in the cache (:func:`cache_dir`), where a profile measured
on first use is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.config import EngineConfig
from framework.model_executor.model_loader import servelab_cache_dir
from framework.platform import cpu_name

FORMAT = 1
SOURCES = ("measured", "analytic")
SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"
#: config.json fields a step's cost depends on (the model's shapes), hashed into the profile key
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "sliding_window",
                "layer_types", "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass
class StepProfile:
    """One profile file in memory (see the module docstring for the fields)."""

    source: str  # measured | analytic
    key: dict[str, Any]  # profile_key(): model shapes hash, device, dtype, engine settings
    samples: list[dict[str, float]] = field(default_factory=list)  # StepFeatures fields + step_s + execute_s
    predictor: dict[str, Any] = field(default_factory=dict)  # framework.sim.predictor.LinearStepModel.as_dict()
    grammar_mask_s_per_row: float | None = None  # seconds per constrained sampled row (bitmask fill)
    meta: dict[str, Any] = field(default_factory=dict)  # model/device names, grid, date, commit (informative)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (creating folders); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        head = {"format": FORMAT, "source": self.source, "key": self.key, "meta": self.meta,
                "grammar_mask_s_per_row": self.grammar_mask_s_per_row, "predictor": self.predictor}
        rows = ",\n  ".join(json.dumps(sample, separators=(",", ":")) for sample in self.samples)
        text = json.dumps(head, indent=1)[:-2] + f',\n "samples": [\n  {rows}\n ]\n}}\n'  # one sample per line
        path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        """Read a profile file.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a servelab profile of this format (names what is wrong).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile file {path} not found; write one with `servelab profile model=...` "
                                    "or use executor.params.profile=auto|analytic:<device>")
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile file {path} is not JSON ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("source") not in SOURCES:
            raise ValueError(f"{path} is not a servelab profile (format {FORMAT}, source measured|analytic); "
                             "write one with `servelab profile model=...`")
        return cls(source=body["source"], key=body.get("key", {}), samples=body.get("samples", []),
                   predictor=body.get("predictor", {}), grammar_mask_s_per_row=body.get("grammar_mask_s_per_row"),
                   meta=body.get("meta", {}))

    @property
    def label(self) -> str:
        """How records name this profile: ``measured:<model>@<device>`` or ``analytic:<device>``."""
        return f"{self.source}:{self.meta.get('model', '?')}@{self.key.get('device', '?')}"


def model_shape_hash(hf_config: Any) -> str:
    """12 hex digits identifying the model's shapes (:data:`SHAPE_FIELDS` of its config), so a renamed folder
    of the same model finds its profile and a different model never does."""
    shape = {name: getattr(hf_config, name, None) for name in SHAPE_FIELDS}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:12]


def measured_device(config: EngineConfig, num_threads: int) -> str:
    """The device a measured profile belongs to: ``cpu:<model name> x<threads>`` or ``cuda:<GPU name>``."""
    if config.device.startswith("cuda"):
        import torch

        return f"cuda:{torch.cuda.get_device_name(torch.device(config.device))}"
    return f"cpu:{cpu_name()} x{num_threads}"


def profile_key(config: EngineConfig, hf_config: Any, device: str) -> dict[str, Any]:
    """What a measured step time depends on; ``profile=auto`` uses a profile only when its key is equal.

    Args:
        config: the run's engine config (``dtype`` resolved).
        device: :func:`measured_device` of the machine, or an analytic device name.
    """
    return {"model": model_shape_hash(hf_config), "device": device, "dtype": config.dtype,
            "kv_cache_dtype": config.kv_cache_dtype, "attention": config.attention, "quant": config.quant,
            "compile": str(config.compile) == "true", "prepack_linears": config.prepack_linears,
            "tensor_parallel_size": config.tensor_parallel_size}


def cache_dir() -> Path:
    """Where profiles measured on first use go: ``profiles/`` under servelab's cache (``$SERVELAB_CACHE``, else
    ``~/.cache/servelab``: the same root as the compile calibration and converted models)."""
    return servelab_cache_dir() / "profiles"


def file_name(model_name: str, key: dict[str, Any]) -> str:
    """``<model>--<device>--<hash of the key>.json``, filesystem-safe."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{model_name}--{key['device']}").strip("-")
    return f"{slug}--{digest}.json"


def cache_path(profile: StepProfile) -> Path:
    """Where a measured profile is cached for ``profile=auto``: :func:`cache_dir` / :func:`file_name`."""
    return cache_dir() / file_name(profile.meta.get("model", "model"), profile.key)


def find_profile(key: dict[str, Any], search: tuple[Path, ...] | None = None) -> Path | None:
    """The first profile file whose key equals ``key`` in the shipped profiles, then the cache (or in
    ``search``); ``None`` when there is none."""
    for folder in search or (SHIPPED_DIR, cache_dir()):
        for path in sorted(Path(folder).glob("*.json")):
            try:
                body = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(body, dict) and body.get("format") == FORMAT and body.get("key") == key:
                return path
    return None
