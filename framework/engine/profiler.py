"""Measure a model's step times with the real engine over a grid of step shapes (``servelab profile``).

*The grid* (Vidur's profiling dimensions -- prefill tokens, decode rows, context lengths, batch -- for whole
engine steps rather than single operators): each :class:`Cell` ``(num_decode, context, prefills, shared)``
starts ``num_decode`` requests of ``context / 2`` to ``3 context / 2`` random prompt tokens, in some cells
behind a common prefix (prefix-cache hits; decode rows reading shared blocks). Their admission gives
multi-request prefill chunks, with and without cached context, capped by ``max_num_batched_tokens``; then
requests of the ``prefills`` lengths join while they decode (mixed steps); every step until all finish is
recorded. Each step's
:class:`~framework.sim.features.StepFeatures` come from its ``SchedulerOutput`` (before the step) and its
time from around ``engine.step()``, so the profile times exactly what a simulated step stands for:
scheduling, the executor's forward and sampling, the update. The structured-output bitmask is timed apart
(seconds per row), since a cost model cannot see it in the step's shape.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from framework.config import EngineConfig
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.core.structured_output_params import StructuredOutputsParams
from framework.engine.builder import build_llm_engine
from framework.engine.llm_engine import LLMEngine
from framework.model_executor.model_loader import load_model_config
from framework.sim.features import step_features
from framework.sim.predictor import LinearStepModel
from framework.sim.profile import StepProfile, measured_device, profile_key

logger = logging.getLogger(__name__)



class Cell(NamedTuple):
    """One grid cell: ``num_decode`` requests of about ``context`` prompt tokens (the first ``shared`` of
    them common to all, a cached prefix); while they decode, one new request of each ``prefills`` length
    joins every other step (mixed steps)."""

    num_decode: int
    context: int
    prefills: tuple[int, ...] = ()
    shared: float = 0.0


_PREFILLS = ((), (64, 24), (512, 40), (1536, 96), (256, 16), (3000,), (128, 48, 200), (32, 160), (1024, 72))
_ROWS = ((32, (1, 4, 16, 48, 96, 160)), (128, (1, 2, 3, 5, 8, 12, 24, 64, 128)), (384, (1, 2, 4, 6, 12, 32, 48)),
         (1024, (1, 3, 5, 8, 16)), (2048, (1, 2, 4, 6)))
GRIDS: dict[str, list[Cell]] = {
    "default": [Cell(d, c, p) for c, ds in _ROWS for d, p in zip(ds, _PREFILLS, strict=False)]
    + [Cell(d, c, p, 0.75) for d, c, p in ((2, 768, ()), (4, 512, (64,)), (6, 1024, ()), (8, 512, (128, 32)),
                                           (16, 384, ()), (32, 256, (64,)))],
    "quick": [Cell(1, 16), Cell(4, 32, (24,)), Cell(8, 8, (64, 8)), Cell(2, 64, (100,)), Cell(3, 48, (), 0.75)],
}
DECODE_STEPS = 8  # decode steps each cell's requests run after their prefill
MASK_REQUESTS = 8  # structured-output requests timed for the bitmask cost
QUIET_FOREIGN_SHARE = 0.05  # a cell measured while other processes took more of the CPUs is measured again
MAX_ATTEMPTS = 3  # per cell; the quietest attempt is kept


class ForeignCpu:
    """The share of this machine's CPU time that other processes took since :meth:`reset` (Linux ``/proc``:
    all CPUs' busy time minus this process's, over wall time x CPUs). A shared machine's neighbours slow a
    measurement by tens of percent (2-core VM: one busy neighbour stalls every OpenMP barrier), so the
    profiler re-measures cells that were not quiet. ``share`` is ``None`` where ``/proc`` is missing."""

    def __init__(self) -> None:
        import os

        self.num_cpus = os.cpu_count() or 1
        self.reset()

    @staticmethod
    def _read() -> tuple[int, int, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        return busy, int(own[11]) + int(own[12]), time.perf_counter()  # utime + stime of every thread

    def reset(self) -> None:
        """Start a new measurement window."""
        self._start = self._read()

    def share(self) -> float | None:
        """Other processes' CPU time since :meth:`reset` over the window's CPU time, in [0, 1]."""
        import os

        end = self._read()
        if self._start is None or end is None:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        wall = (end[2] - self._start[2]) * ticks * self.num_cpus
        foreign = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return min(1.0, max(0.0, foreign / wall)) if wall > 0 else 0.0


class StepRecorder:
    """Times ``engine.step()`` and records the features of each step that ran the model.

    Wraps the engine's executor ``execute_model`` (features before the forward, the executor's own time)
    and, with a grammar engine, its bitmask fill (time and rows). Restore the originals with :meth:`close`.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.samples: list[dict[str, float]] = []
        self.mask_s, self.mask_rows = 0.0, 0
        self._features: Any = None
        self._execute_s = 0.0
        self._execute = engine.executor.execute_model
        engine.executor.execute_model = self._timed_execute
        self._manager = engine.structured_output
        if self._manager is not None:
            self._fill = self._manager.grammar_bitmask
            self._manager.grammar_bitmask = self._timed_fill

    def _timed_execute(self, scheduler_output: Any) -> Any:
        self._features = step_features(scheduler_output, self.engine.config.block_size)
        t0 = time.perf_counter()
        out = self._execute(scheduler_output)
        self._execute_s = time.perf_counter() - t0
        return out

    def _timed_fill(self, scheduler_output: Any) -> Any:
        t0 = time.perf_counter()
        bitmask, rows = self._fill(scheduler_output)
        self.mask_s += time.perf_counter() - t0
        self.mask_rows += 0 if bitmask is None else bitmask.shape[0]
        return bitmask, rows

    def step(self, record: bool = True) -> list[Any]:
        """One ``engine.step()``; its sample is kept when it ran the model and ``record`` is set."""
        self._features = None
        t0 = time.perf_counter()
        outputs = self.engine.step()
        step_s = time.perf_counter() - t0
        if record and self._features is not None:
            self.samples.append({**self._features.as_dict(), "step_s": round(step_s, 7),  # 0.1 us
                                 "execute_s": round(self._execute_s, 7)})
        return outputs

    def close(self) -> None:
        """Put the engine's own methods back."""
        self.engine.executor.execute_model = self._execute
        if self._manager is not None:
            self._manager.grammar_bitmask = self._fill


def run_cell(recorder: StepRecorder, cell: Cell, rng: random.Random, tag: str, record: bool = True,
             low_id: int = 3) -> None:
    """Run one grid cell to completion (see the module docstring), recording its steps."""
    engine = recorder.engine
    num_decode, context, prefills, shared = cell
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    prefix = [rng.randrange(low_id, vocab) for _ in range(int(shared * context))]
    ids = [f"{tag}-d{i}" for i in range(num_decode)]
    for rid in ids:  # lengths spread over [context / 2, 3 context / 2]: batches of unequal rows, as in real traffic
        length = min(rng.randint(max(1, context // 2), 3 * context // 2), engine.max_model_len - DECODE_STEPS - 2)
        own = max(1, length - len(prefix))
        engine.add_request(rid, prefix + [rng.randrange(low_id, vocab) for _ in range(own)], params)
    started: set[str] = set()
    pending, decode_steps = list(prefills), 0
    while engine.has_unfinished_requests():
        if pending and started >= set(ids):  # every request decodes: every other step a prefill joins them
            if decode_steps % 2 == 0:
                prompt_len = min(pending.pop(0), engine.max_model_len - 2)
                engine.add_request(f"{tag}-p{len(pending)}", [rng.randrange(low_id, vocab) for _ in range(prompt_len)],
                                   dataclasses.replace(params, max_tokens=2))
            decode_steps += 1
        started |= {o.request_id for o in recorder.step(record) if o.outputs and o.outputs[0].token_ids}


def run_quiet_cell(recorder: StepRecorder, cell: Cell, rng: random.Random, tag: str) -> float | None:
    """Run a cell until one attempt was quiet (:class:`ForeignCpu` share at most :data:`QUIET_FOREIGN_SHARE`;
    at most :data:`MAX_ATTEMPTS`), keeping only the quietest attempt's samples; returns its share."""
    meter = ForeignCpu()
    kept: tuple[float, list[dict[str, float]]] | None = None
    first = len(recorder.samples)
    for attempt in range(MAX_ATTEMPTS):
        meter.reset()
        run_cell(recorder, cell, rng, f"{tag}-a{attempt}")
        share = meter.share()
        samples = recorder.samples[first:]
        del recorder.samples[first:]
        if kept is None or (share is not None and share < kept[0]):
            kept = (share if share is not None else 0.0, samples)
        if share is None or share <= QUIET_FOREIGN_SHARE:
            break
        logger.info("profile cell %s: other processes took %.0f%% of the CPUs; measuring it again (attempt %d of %d)",
                    cell, 100 * share, attempt + 2, MAX_ATTEMPTS)
    recorder.samples.extend(kept[1])
    return kept[0]


def measure_mask_cost(recorder: StepRecorder, rng: random.Random) -> float | None:
    """Seconds per structured-output bitmask row (``json_object`` requests on the engine's grammar), or
    ``None`` without a grammar engine."""
    engine = recorder.engine
    if engine.structured_output is None:
        return None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    for i in range(MASK_REQUESTS):
        engine.add_request(f"mask-{i}", [rng.randrange(3, engine.vocab_size) for _ in range(16)], params)
    while engine.has_unfinished_requests():
        recorder.step(record=False)
    return recorder.mask_s / recorder.mask_rows if recorder.mask_rows else None


class Progress:
    """A ``progress`` callback for :func:`measure_profile` that prints each cell done with the elapsed time
    and an estimate of the time left (cells so far at their mean time), so a long profiling run on a slow
    machine says where it is.

    Args:
        label: the line's prefix (e.g. ``"  profile"``).
        emit: where lines go (default ``print`` with flush).
    """

    def __init__(self, label: str = "  profile", emit: Callable[[str], None] | None = None) -> None:
        self.label = label
        self.emit = emit or (lambda line: print(line, flush=True))
        self._start: float | None = None

    def __call__(self, done: int, total: int) -> None:
        """Print ``done`` of ``total`` cells, elapsed seconds and the estimated seconds left."""
        now = time.monotonic()
        if self._start is None or done == 0:
            self._start = now
            self.emit(f"{self.label}: engine built and warmed up; measuring {total} cells")
            return
        elapsed = now - self._start
        left = elapsed / done * (total - done)
        self.emit(f"{self.label} cell {done}/{total}: {elapsed:.0f} s so far, ~{left:.0f} s left")


def measure_profile(config: EngineConfig, grid: str = "default", seed: int = 0,
                    progress: Callable[[int, int], None] | None = None, passes: int = 1) -> StepProfile:
    """Build the real engine for ``config`` (its executor replaced by the real one), run the grid ``passes``
    times (every other pass in reverse, so a slow spell of the machine does not fall on one kind of cell),
    fit the predictor and return the profile (not saved).

    Args:
        progress: called ``(cells done, cells)`` once the engine is built and warmed up (0 done), then after
            each cell (see :class:`Progress`).

    Raises:
        ValueError: an unknown grid, or what ``build_llm_engine`` raises for ``config``.
    """
    import torch

    if grid not in GRIDS:
        raise ValueError(f"unknown profile grid {grid!r}; valid: {', '.join(GRIDS)}")
    config = dataclasses.replace(config, executor="auto", executor_params={})  # the real engine, never sim
    engine = build_llm_engine(config)
    config = engine.config
    recorder = StepRecorder(engine)
    rng = random.Random(seed)
    cells = GRIDS[grid]
    order = [cell for k in range(passes) for cell in (cells if k % 2 == 0 else cells[::-1])]
    shares: list[float | None] = []
    try:
        run_cell(recorder, Cell(4, 64, (64,)), rng, "warmup", record=False)  # first steps pay allocations, page faults
        if progress is not None:
            progress(0, len(order))
        for i, cell in enumerate(order):
            shares.append(run_quiet_cell(recorder, cell, rng, f"cell{i}"))
            if progress is not None:
                progress(i + 1, len(order))
        mask_s = measure_mask_cost(recorder, rng)
    finally:
        recorder.close()
        engine.shutdown()
    hf_config = load_model_config(config.model)
    device = measured_device(config, torch.get_num_threads())
    model = LinearStepModel.fit(recorder.samples)
    meta = {"model": Path(config.model).name, "grid": grid, "passes": passes, "cells": [list(c) for c in cells],
            "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": config.block_size,
            "date": datetime.date.today().isoformat(), "num_samples": len(recorder.samples),
            "foreign_cpu_share_per_cell": shares}
    return StepProfile(source="measured", key=profile_key(config, hf_config, device), samples=recorder.samples,
                       predictor=model.as_dict(), grammar_mask_s_per_row=mask_s, meta=meta)


def merge_profiles(profiles: list[StepProfile]) -> StepProfile:
    """One profile from several measured with the same key (e.g. passes at different times of a shared
    machine): their samples pooled and refit, the mask cost averaged.

    Raises:
        ValueError: no profiles, an analytic one, or keys that differ (other model, device or settings).
    """
    if not profiles or any(p.source != "measured" for p in profiles):
        raise ValueError("merge measured profiles (servelab profile), at least one")
    if any(p.key != profiles[0].key for p in profiles):
        raise ValueError("profiles measured with different models, devices or engine settings cannot be merged")
    samples = [s for p in profiles for s in p.samples]
    masks = [p.grammar_mask_s_per_row for p in profiles if p.grammar_mask_s_per_row is not None]
    meta = dict(profiles[0].meta, num_samples=len(samples), merged_from=[p.meta.get("date") for p in profiles],
                foreign_cpu_share_per_cell=[x for p in profiles for x in p.meta.get("foreign_cpu_share_per_cell", [])])
    return StepProfile(source="measured", key=profiles[0].key, samples=samples,
                       predictor=LinearStepModel.fit(samples).as_dict(),
                       grammar_mask_s_per_row=sum(masks) / len(masks) if masks else None, meta=meta)
