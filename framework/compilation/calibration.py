"""``engine.compile=auto``'s numbers for this machine and model, measured and kept between runs.

:class:`CompilePlanner` owns them for one engine: before a decision it loads the record of this
machine and model (a JSON file under ``$SERVELAB_CACHE/compile/``, default ``~/.cache/servelab``),
measures eager decode steps at :data:`~framework.compilation.policy.CALIBRATION_BATCH_SIZES` when the
record has none (a few dummy steps: well under a second for SmolLM2), and after a compile it records
the warm-up (cold, or from inductor's on-disk cache) and the compiled decode steps. The engine also reports
every real all-decode step it runs (:meth:`CompilePlanner.observe_decode_step`): their mean time by batch size,
eager and compiled, is kept in the record too, and scales the dummy steps' times to what this engine's real steps
take (:meth:`CompilePlanner.costs`): a dummy step (one short context, no scheduler or sampler state) read
75.8 / 53.7 ms eager / compiled at batch 64 where the W workload's real steps took 96-119 / 65-84 ms, so the
dummy steps alone priced compiling's saving ~30% low on the 2-core EPYC. The record's key
is the machine (CPU model name and cores, or the GPU; torch's version and threads) and the model (its
folder and config, dtype, attention backend, quant method, KV cache dtype, TP degree), so a number
measured for one never decides for another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from framework.compilation import policy as compile_policy
from framework.compilation.policy import CALIBRATION_BATCH_SIZES, CompileCosts, CompileDecision, decide_compile
from framework.config import EngineConfig
from framework.interfaces import Executor
from framework.model_executor.model_loader import load_model_config
from framework.platform import cpu_name

logger = logging.getLogger(__name__)


#: A batch size's real decode steps count once the engine has run this many of them (all runs together).
MIN_OBSERVED_STEPS = 3
#: Weight cap of a batch size's kept mean, steps: newer runs move it (a machine's speed drifts).
MAX_OBSERVED_WEIGHT = 200
#: Real-over-dummy step time factors outside these bounds are clamped (a step that shared the cores with another
#: process must not make compiling look free or worthless).
OBSERVED_FACTOR_BOUNDS = (0.5, 3.0)
#: Real decode steps gathered in memory before an idle engine writes them to the record.
FLUSH_EVERY_STEPS = 32


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

            model_config_json = load_model_config(config.model).to_json_string()
        except Exception:  # noqa: BLE001 - a model whose config cannot be read here: keyed by its name alone
            model_config_json = ""
        self.config = config
        self.executor = executor
        self.machine = machine_description(config.device)
        model = "|".join(str(x) for x in (config.model, config.dtype, config.attention, sorted(config.attention_params.items()),
                                          config.quant, config.kv_cache_dtype, config.tensor_parallel_size,
                                          config.compile_freezing, config.block_size)
                          + ((config.compile_backend,) if config.compile_backend != "inductor" else ()))
        digest = hashlib.sha256(f"{self.machine}|{model}|{model_config_json}".encode()).hexdigest()[:20]
        self.path = calibration_dir() / f"{digest}.json"
        self.model_description = model
        # real all-decode steps not yet in the record: "eager"/"compiled" -> batch size -> [total ms, steps]
        self._observed: dict[str, dict[int, list[float]]] = {"eager": {}, "compiled": {}}
        self._num_observed = 0

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
            tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # replicas may save at once
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as err:
            logger.warning("engine.compile: could not save the compile calibration to %s (%s)", self.path, err)

    def observe_decode_step(self, batch: int, execute_s: float, compiled: bool) -> None:
        """Note one real step of the engine in which every scheduled request decoded one token (no prefill
        chunk, draft or swap): ``batch`` requests, ``execute_s`` seconds in the executor (model step and
        sampling); kept in memory until :meth:`flush_observed`."""
        cell = self._observed["compiled" if compiled else "eager"].setdefault(int(batch), [0.0, 0])
        cell[0] += execute_s * 1e3
        cell[1] += 1
        self._num_observed += 1

    def flush_observed(self, force: bool = True) -> None:
        """Merge the real steps observed since the last flush into the record's ``observed_step_ms``
        (``mode -> batch size -> [mean ms, steps]``, each mean weighted by its steps, the kept weight capped at
        :data:`MAX_OBSERVED_WEIGHT`); without ``force`` only once :data:`FLUSH_EVERY_STEPS` are pending (an
        idle server writes the file at most that often)."""
        if not self._num_observed or (not force and self._num_observed < FLUSH_EVERY_STEPS):
            return
        record = self.load()
        observed = record.setdefault("observed_step_ms", {})
        for mode, cells in self._observed.items():
            table = observed.setdefault(mode, {})
            for batch, (total_ms, steps) in cells.items():
                old_ms, old_steps = table.get(str(batch), (0.0, 0))
                mean = (old_ms * old_steps + total_ms) / (old_steps + steps)
                table[str(batch)] = [round(mean, 3), int(min(old_steps + steps, MAX_OBSERVED_WEIGHT))]
        self._observed = {"eager": {}, "compiled": {}}
        self._num_observed = 0
        self.save(record)

    @staticmethod
    def observed_factor(record: dict[str, Any], mode: str, dummy: dict[int, float]) -> tuple[float, int] | None:
        """How much longer this engine's real all-decode steps took than the dummy steps measured at the same
        batch sizes (interpolated) in ``mode`` (``"eager"``/``"compiled"``): the step-weighted geometric mean of
        real / dummy over the batch sizes with at least :data:`MIN_OBSERVED_STEPS` steps, clamped to
        :data:`OBSERVED_FACTOR_BOUNDS`, and the steps behind it; ``None`` without such steps or dummy steps."""
        if not dummy:
            return None
        table = record.get("observed_step_ms", {}).get(mode, {})
        cells = [(ms / base, n) for b, (ms, n) in table.items()
                 if n >= MIN_OBSERVED_STEPS and ms > 0 and (base := compile_policy.interpolate(dummy, int(b))) > 0]
        if not cells:
            return None
        steps = sum(n for _, n in cells)
        log_factor = sum(n * math.log(ratio) for ratio, n in cells) / steps
        lo, hi = OBSERVED_FACTOR_BOUNDS
        return min(max(math.exp(log_factor), lo), hi), steps

    def costs(self, record: dict[str, Any]) -> CompileCosts:
        """:class:`CompileCosts` from a record: the warm-up measured from inductor's cache when the cache
        the record was measured with is still there, else the cold one, else the priors; the dummy decode
        steps' times scaled by :meth:`observed_factor` (eager by the eager steps', compiled by the compiled
        steps' or, until a compiled engine ran real steps here, by the eager one)."""
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
        eager_factor = self.observed_factor(record, "eager", eager)
        compiled_factor = self.observed_factor(record, "compiled", compiled) or eager_factor
        if eager_factor:
            eager = {b: ms * eager_factor[0] for b, ms in eager.items()}
            steps += f", x{eager_factor[0]:.2f} as {eager_factor[1]:,} real eager decode steps ran"
        if compiled and compiled_factor:
            compiled = {b: ms * compiled_factor[0] for b, ms in compiled.items()}
            if compiled_factor is not eager_factor:
                steps += f", compiled x{compiled_factor[0]:.2f} as {compiled_factor[1]:,} real compiled ones ran"
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
