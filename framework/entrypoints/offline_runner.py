"""Offline run loop: feed a workload to an engine, step it to completion, collect records and a summary."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from framework.compilation.policy import output_budget
from framework.core.lora_request import named_lora_request
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.core.structured_output_params import StructuredOutputsParams
from framework.interfaces.engine import EngineClient
from framework.workloads.item import WorkloadItem

logger = logging.getLogger(__name__)


def _record(item: WorkloadItem, output: RequestOutput | None, error: str | None = None,
            labels: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``outputs.jsonl`` line: request_id, prompt (as the user wrote it), rendered_prompt (the text sent,
    chat template applied; ``None`` for token-id prompts), lora (the item's adapter name or ``None``), text,
    token_ids, finish_reason, error, metrics, then the run's ``labels`` (``simulated``, ``sim_profile``: a simulated run's text and token ids are synthetic)."""
    completion = output.outputs[0] if output is not None and output.outputs else None
    return {
        "request_id": item.request_id,
        "prompt": item.raw_prompt if item.raw_prompt is not None else item.prompt,
        "rendered_prompt": item.prompt,
        "lora": item.lora,
        "text": completion.text if completion else "",
        "token_ids": list(completion.token_ids) if completion else [],
        "finish_reason": completion.finish_reason if completion else "abort",
        "error": error if output is None else output.error,
        "metrics": output.metrics.as_dict() if output is not None and output.metrics is not None else None,
        **(labels or {}),
    }


@contextlib.contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """Yield ``advance()``; a rich progress bar of finished requests when ``enabled``."""
    if not enabled:
        yield lambda: None
        return
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("requests", total=total)
        yield lambda: bar.advance(task)


def run_workload(engine: EngineClient, items: list[WorkloadItem], default_sampling: SamplingParams,
                 progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``items`` through ``engine`` until every request finished.

    Before the run, ``engine.maybe_compile`` sees each request's output-token budget (``engine.compile=auto``
    compiles here when it passes the break-even; the warm-up is reported as ``compile_s``, outside
    ``duration_s``). Items arrive at ``run start + arrival_time_s`` (``None`` = at start; the loop sleeps while the
    engine is idle and the next arrival lies ahead). Time is the engine's clock (``engine.clock``): wall time,
    or a simulator's virtual time, whose idle waits cost nothing. Each request samples with
    ``default_sampling``, its ``max_tokens`` replaced by the item's when set. A request the
    engine rejects (``ValueError`` from ``add_request``, e.g. a prompt longer than
    ``max_model_len``) is recorded with ``finish_reason="abort"`` and its ``error``; the others run.

    Returns:
        ``(records, summary)``: one record per item in input order (see ``_record``), and
        ``engine.metrics.summary()`` over the run's wall time plus ``num_rejected``.
    """
    pending = sorted(items, key=lambda it: it.arrival_time_s or 0.0)  # stable: ties keep input order
    by_id = {item.request_id: item for item in items}
    if len(by_id) != len(items):
        raise ValueError("workload request ids must be unique")
    records: dict[str, dict[str, Any]] = {}
    labels = engine.metrics.run_labels  # simulated, sim_profile: on every record
    num_rejected = 0
    max_len = engine.max_model_len
    engine.maybe_compile([output_budget(default_sampling.max_tokens if item.max_tokens is None else item.max_tokens,
                                        item.prompt_token_ids if item.prompt_token_ids is not None else item.prompt,
                                        max_len, engine.tokenize)
                          for item in items for _ in range(default_sampling.n)])
    clock = engine.clock  # wall time, or a simulator's virtual time (idle waits jump over)
    t0 = clock.now()
    with _progress(progress, len(items)) as advance:
        while pending or engine.has_unfinished_requests():
            now = clock.now()
            while pending and (pending[0].arrival_time_s or 0.0) <= now - t0:
                item = pending.pop(0)
                error = _submit(engine, item, default_sampling, arrival_time=t0 + (item.arrival_time_s or 0.0))
                if error is not None:
                    num_rejected += 1
                    records[item.request_id] = _record(item, None, error, labels)
                    advance()
            if not engine.has_unfinished_requests():
                if pending:  # idle until the next arrival
                    clock.sleep_until(t0 + (pending[0].arrival_time_s or 0.0))
                continue
            for output in engine.step():
                if output.finished and output.request_id in by_id:
                    records[output.request_id] = _record(by_id[output.request_id], output, labels=labels)
                    advance()
    duration_s = clock.now() - t0
    summary = engine.metrics.summary(duration_s=duration_s)
    summary["num_rejected"] = num_rejected
    missing = [item.request_id for item in items if item.request_id not in records]
    if missing:
        raise RuntimeError(f"engine stopped with {len(missing)} requests unreported, e.g. {missing[:3]}")
    return [records[item.request_id] for item in items], summary


def _submit(engine: EngineClient, item: WorkloadItem, default_sampling: SamplingParams, arrival_time: float) -> str | None:
    """Add one item to the engine; returns the rejection message, or ``None`` when queued."""
    prompt = item.prompt_token_ids if item.prompt_token_ids is not None else item.prompt
    try:
        # only final outputs are recorded: no per-step copies of growing outputs (as LLM.generate)
        overrides: dict = {"output_kind": RequestOutputKind.FINAL_ONLY}
        if item.max_tokens is not None:
            overrides["max_tokens"] = int(item.max_tokens)
        if item.structured_outputs is not None:
            overrides["structured_outputs"] = StructuredOutputsParams.from_dict(item.structured_outputs)
        params = dataclasses.replace(default_sampling, **overrides)  # a fresh copy per request
        lora = None if item.lora is None else named_lora_request(item.lora, engine.config.lora_modules)
        engine.add_request(item.request_id, prompt, params, priority=item.priority, arrival_time=arrival_time,
                           client_id=item.client_id, lora_request=lora)
    except ValueError as e:
        logger.warning("request %s rejected: %s", item.request_id, e)
        return str(e)
    return None
