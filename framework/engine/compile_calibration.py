"""``engine.compile=auto``'s numbers for this machine and model, measured and kept between runs.

:class:`CompilePlanner` owns them for one engine: before a decision it loads the record of this
machine and model (a JSON file under ``$SERVELAB_CACHE/compile/``, default ``~/.cache/servelab``),
measures eager decode steps at :data:`~framework.engine.compile_policy.CALIBRATION_BATCH_SIZES` when the
record has none (a few dummy steps: well under a second for SmolLM2), and after a compile it records
the warm-up (cold, or from inductor's on-disk cache) and the compiled decode steps. The record's key
is the machine (CPU model name and cores, or the GPU; torch's version and threads) and the model (its
folder and config, dtype, attention backend, quant method, KV cache dtype, TP degree), so a number
measured for one never decides for another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from framework.config import EngineConfig
from framework.engine import compile_policy
from framework.engine.compile_policy import CALIBRATION_BATCH_SIZES, CompileCosts, CompileDecision, decide_compile
from framework.interfaces import Executor
from framework.sim.profile import cpu_name

logger = logging.getLogger(__name__)


def machine_description(device: str) -> str:
    """The machine in one line: the GPU's name for CUDA, else the CPU's model name and cores; torch
    version and intra-op threads."""
    if device.startswith("cuda") and torch.cuda.is_available():
        what = torch.cuda.get_device_name(torch.device(device))
    else:
        what = cpu_name()
        what = f"{what}, {os.cpu_count()} cores"
    return f"{what}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def calibration_dir() -> Path:
    """``$SERVELAB_COMPILE_RECORDS`` when set (the test suite points it at a temporary folder, so its runs
    on a loaded machine never become a user's numbers), else ``$SERVELAB_CACHE/compile``
    (``~/.cache/servelab/compile`` by default)."""
    if os.environ.get("SERVELAB_COMPILE_RECORDS"):
        return Path(os.environ["SERVELAB_COMPILE_RECORDS"]).expanduser()
    return Path(os.environ.get("SERVELAB_CACHE") or Path.home() / ".cache" / "servelab").expanduser() / "compile"


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


class CompilePlanner:
    """``engine.compile=auto``'s decisions for one engine, from this machine's measured numbers.

    Args:
        config: the engine's config (model, dtype, backend, quant, TP: the record's key, with the
            model's ``config.json``).
        executor: the engine's executor: ``time_decode_steps`` runs on every rank.
    """

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        try:
            from framework.worker.model_loader import load_model_config

            model_config_json = load_model_config(config.model).to_json_string()
        except Exception:  # noqa: BLE001 - a model whose config cannot be read here: keyed by its name alone
            model_config_json = ""
        self.config = config
        self.executor = executor
        self.machine = machine_description(config.device)
        model = "|".join(str(x) for x in (config.model, config.dtype, config.attention, sorted(config.attention_params.items()),
                                          config.quant, config.kv_cache_dtype, config.tensor_parallel_size,
                                          config.compile_freezing, config.block_size))
        digest = hashlib.sha256(f"{self.machine}|{model}|{model_config_json}".encode()).hexdigest()[:20]
        self.path = calibration_dir() / f"{digest}.json"
        self.model_description = model

    def load(self) -> dict[str, Any]:
        """The record (empty if there is none or it cannot be read)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def save(self, record: dict[str, Any]) -> None:
        """Write the record atomically; a read-only cache only loses the measurement (logged)."""
        record.update(machine=self.machine, model=self.model_description, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as err:
            logger.warning("engine.compile: could not save the compile calibration to %s (%s)", self.path, err)

    def costs(self, record: dict[str, Any]) -> CompileCosts:
        """:class:`CompileCosts` from a record: the warm-up measured from inductor's cache when the cache
        the record was measured with is still there, else the cold one, else the priors."""
        warm = record.get("warm_up_s", {})
        cache_there = record.get("inductor_cache_dir") == _inductor_cache_dir() and Path(_inductor_cache_dir()).is_dir()
        if cache_there and "cached" in warm:
            warm_up, source = warm["cached"], "measured here, from inductor's cache"
        elif cache_there and "cold" in warm:
            warm_up, source = compile_policy.PRIOR_WARM_UP_S["cached"] / compile_policy.PRIOR_WARM_UP_S["cold"] * warm["cold"], \
                "cached estimate from the cold one measured here"
        elif "cold" in warm:
            warm_up, source = warm["cold"], "measured here, cold"
        else:
            warm_up, source = compile_policy.PRIOR_WARM_UP_S["cold"], "prior, cold"
        eager = {int(b): ms for b, ms in record.get("eager_step_ms", {}).items()}
        compiled = {int(b): ms for b, ms in record.get("compiled_step_ms", {}).items()}
        steps = "eager and compiled measured here" if compiled else "eager measured here, compiled prior"
        return CompileCosts(warm_up, source, eager, compiled, steps)

    def decide(self, planned_budgets: Sequence[int] | None, past_steps: Mapping[int, int],
               make_idle: Callable[[], bool], repeats: int = 1) -> CompileDecision:
        """The ``auto`` decision for the work about to start (``decide_compile``: ``planned_budgets`` are its
        requests' output-token budgets, ``None`` for a server, run ``repeats`` times; ``past_steps`` batch
        size -> decode steps run eagerly so far), measuring eager decode steps first when the record has none and
        ``make_idle()`` succeeds (it drops the prefix cache and says whether no request holds a KV
        block: the dummy steps write K/V into blocks 0, 1, ...)."""
        if planned_budgets is None:
            return decide_compile("auto", None)
        record = self.load()
        if not record.get("eager_step_ms") and make_idle():
            record["eager_step_ms"] = self.measure_steps()
            self.save(record)
        return decide_compile("auto", planned_budgets, self.costs(record), self.config.max_num_seqs, past_steps,
                              repeats)

    def measure_steps(self, max_tries: int = 3) -> dict[str, float]:
        """Decode step times at the calibration batch sizes on every rank (rank 0's), ms. A step of more rows
        never runs faster than one of fewer on the same machine, so a set where it did (another process
        took the cores during a step: a batch-1 step once read 505 ms against 92 ms at batch 64 on the
        2-core EPYC) is measured again, up to ``max_tries`` sets in all, keeping each batch size's fastest;
        ``auto`` weighs every decode step of a batch's tail at these numbers."""
        best: dict[int, float] = {}
        for _ in range(max_tries):
            times = self.executor.collective_rpc("time_decode_steps", args=(list(CALIBRATION_BATCH_SIZES),),
                                                 unique_reply_rank=0)[0]
            best = {int(b): min(ms, best.get(int(b), ms)) for b, ms in times.items()}
            ordered = [best[b] for b in sorted(best)]
            if all(a <= b for a, b in zip(ordered, ordered[1:])):
                break
        else:
            logger.info("engine.compile: decode steps measured at batch sizes %s did not grow with the batch "
                        "(%s ms, the fastest of %d tries); kept as measured", sorted(best), ordered, max_tries)
        return {str(b): round(ms, 3) for b, ms in best.items()}

    def record_compile(self, stats: Any) -> None:
        """After a compile (``stats``: rank 0's ``CompileStats``): keep its warm-up, cold or from the
        cache (every graph an inductor cache hit), and the compiled decode steps (measured now)."""
        if not stats.active:
            return
        record = self.load()
        record.setdefault("warm_up_s", {})["cached" if stats.num_cache_misses == 0 else "cold"] = round(stats.compile_s, 2)
        record["inductor_cache_dir"] = _inductor_cache_dir()
        record["compiled_step_ms"] = self.measure_steps()
        self.save(record)
