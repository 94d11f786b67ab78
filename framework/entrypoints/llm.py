"""Offline batch API shaped like vLLM's ``LLM``: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from framework.compilation.policy import output_budget
from framework.config import EngineConfig
from framework.core.faults import EngineDeadError
from framework.core.lora_request import LoRARequest
from framework.core.outputs import CompletionOutput, RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.watchdog import StepWatchdog
from framework.entrypoints.engine import build_engine
from framework.interfaces.engine import EngineClient

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}


class LLM:
    """Offline inference over a batch of prompts with continuous batching.

    Args:
        model: local HF folder, alias (``smollm2``, ``stories260K``) or cached hub id.
        dtype: ``auto`` (default: the checkpoint's ``config.json`` dtype, as vLLM; float32 when it names
            none) | ``float32`` (the transformers-parity path) | ``bfloat16`` | ``float16``.
        scheduler, kv_allocator, attention, drafter, quant, grammar: plugin names (registry keys).
        compile: ``auto`` (default: the decoder is compiled before the first ``generate`` call that
            brings the output tokens -- generated so far plus the call's ``max_tokens`` budget -- to the
            break-even, ``framework/compilation/policy.py``) | ``True`` (at construction) | ``False``.
        **kwargs: any other ``EngineConfig`` field (``max_num_seqs``, ``max_num_batched_tokens``,
            ``block_size``, ``num_blocks``, ``kv_cache_memory_bytes``, ``enable_prefix_caching``,
            ``long_prefill_token_threshold``, ``max_model_len``, ``device``, ``seed``, ``*_params``; LoRA:
            ``enable_lora``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ``lora_backend``).

    Raises:
        registry.UnknownPluginError, ValueError, TypeError: bad plugin names or knobs, before the
            model loads (see ``framework.entrypoints.engine.build_engine``).
    """

    def __init__(self, model: str, dtype: str = "auto", scheduler: str = "fcfs", kv_allocator: str = "paged",
                 attention: str = "torch_paged", compile: bool | str = "auto", **kwargs: Any) -> None:
        _show_info_logs()
        self.config = EngineConfig(model=model, dtype=dtype, scheduler=scheduler, kv_allocator=kv_allocator,
                                   attention=attention, compile=compile, **kwargs)
        self.engine: EngineClient = build_engine(self.config)
        self.config = self.engine.config  # dtype="auto" resolved
        self._ids = itertools.count()
        self._dead: BaseException | None = None  # the fault that killed the engine, if one did
        self._watchdog = StepWatchdog(float(self.config.watchdog_timeout_s), _report_hung_step)
        weakref.finalize(self, self._watchdog.close)  # its thread ends with this LLM

    def get_tokenizer(self) -> Any:
        """The model's HF tokenizer."""
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate completions for all prompts; returns one output per prompt, in input order, with
        ``n`` completions each (``SamplingParams.n``; the prompt's KV blocks are computed once and shared
        through the prefix cache, ``framework/engine/parallel_sampling.py``) and, when asked, the prompt's
        logprobs (``SamplingParams.prompt_logprobs`` -> ``RequestOutput.prompt_logprobs``).

        ``lora_request``: one LoRA adapter for every prompt, or one per prompt (``None`` entries: the base model);
        needs ``LLM(..., enable_lora=True)`` (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``: docs/lora.md).
        A prompt whose adapter cannot be served (missing or corrupt files, rank above ``max_lora_rank``, a module
        or shapes the base model does not have) is rejected like one the engine refuses.

        A prompt the engine rejects (e.g. longer than ``max_model_len``), or a request a plugin or the
        detokenizer fails on (``internal_error``), gets a finished output with ``error`` set and
        ``finish_reason="abort"``; the other prompts run normally.

        Raises:
            ValueError: invalid sampling params or mismatched list lengths — before anything
                is queued.
            EngineDeadError: the engine step itself failed (e.g. the model forward); the batch is lost,
                the engine's workers are shut down and this ``LLM`` refuses further work (build a new one).

        A step running past ``engine.watchdog_timeout_s`` (a plugin hook that never returns) is logged as
        an error with the stack of the thread running it, naming where it hangs (the call goes on waiting:
        interrupt it).
        """
        if self._dead is not None:
            raise EngineDeadError(f"this LLM's engine died earlier ({type(self._dead).__name__}: {self._dead}); "
                                  "build a new LLM") from self._dead
        self.engine.check_health()  # EngineDeadError at once when the executor lost a worker
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        for p in params:
            p.validate()
        max_len = self.engine.max_model_len
        self.engine.maybe_compile([output_budget(p.max_tokens, self._unpack(prompt)[1], max_len, self.engine.tokenize)
                                   for prompt, p in zip(prompts, params) for _ in range(p.n)])
        # only final outputs are kept here: don't build per-step outputs (vLLM's LLM does the same)
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]

        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, sp, prio, lora in zip(prompts, params, priorities, loras):
            request_id = str(next(self._ids))
            order.append(request_id)
            text, payload = self._unpack(prompt)
            try:
                self.engine.add_request(request_id, payload, sp, priority=prio, lora_request=lora)
            except Exception as exc:  # noqa: BLE001 - add_request changes nothing before it raises: reject this one
                logger.warning("request %s rejected: %s", request_id, exc, exc_info=not isinstance(exc, ValueError))
                results[request_id] = _rejected(request_id, text, exc)
        while self.engine.has_unfinished_requests():
            try:
                with self._watchdog.step():
                    outputs = self.engine.step()
            except Exception as exc:
                self._dead = exc
                self._shutdown_quietly()  # worker processes must not outlive a dead engine
                raise EngineDeadError(f"the engine step failed ({type(exc).__name__}: {exc}); its state is unknown "
                                      f"and the {len(order)} requests of this generate() call are lost; build a new "
                                      "LLM") from exc
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in order]

    def _shutdown_quietly(self) -> None:
        """Stop the workers (and grammar threads) of an engine that just died; a failure here is only logged."""
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - the original fault is what the caller must see
            logger.exception("shutting down the dead engine failed")

    @staticmethod
    def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    @staticmethod
    def _unpack(prompt: Prompt) -> tuple[str | None, str | list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return prompt["prompt"], prompt["prompt"]
        return (prompt if isinstance(prompt, str) else None), prompt


def _report_hung_step(seconds: float, stack: str) -> None:
    """``StepWatchdog`` verdict offline: say loudly where the step hangs (the caller may interrupt it)."""
    logger.error("engine step running for %.0f s (engine.watchdog_timeout_s): hung; it is at:\n%s", seconds, stack)


def _rejected(request_id: str, prompt: str | None, exc: Exception) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=[],
                         outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
                         finished=True, error=str(exc))


def _show_info_logs() -> None:
    """Show servelab's INFO lines (the compile decision and its progress, the KV cache size) in a plain
    script, as vLLM's ``LLM`` does: a stderr handler on the ``framework`` logger, only when the
    application configured no logging of its own (the root logger has no handler)."""
    framework_logger = logging.getLogger("framework")
    if logging.getLogger().handlers or framework_logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s servelab: %(message)s"))
    framework_logger.addHandler(handler)
    framework_logger.setLevel(logging.INFO)
    framework_logger.propagate = False
