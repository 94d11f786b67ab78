"""What a step costs depends on: the features of one engine step, read from its ``SchedulerOutput``.

The same function describes a real step (``servelab profile`` records it next to the measured time) and
a simulated one (``executor=sim`` predicts its time), so a predictor sees identical inputs in both. The
split follows what the kernels do (Vidur, Agrawal et al., MLSys'24, Sec. 4: token-level operators scale
with the batch's tokens, attention with its context, decode and prefill apart):

* linear layers and norms: every scheduled token (``num_tokens``);
* decode attention: keys read by one-token queries (``decode_context``);
* prefill attention (chunks, verify rows of speculative decoding): keys gathered per chunk
  (``prefill_context``) and causal query-key pairs (``prefill_pairs``);
* LM head, sampler, detokenizer: sampled rows (``num_sampled``);
* per-request work (input preparation, block tables, scheduler bookkeeping): ``num_reqs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from framework.core.outputs import SchedulerOutput

FEATURE_NAMES = ("num_tokens", "num_reqs", "num_decode_reqs", "num_prefill_reqs", "num_sampled", "decode_context",
                 "max_decode_context", "decode_unique_context", "prefill_context", "prefill_pairs", "num_swap_blocks", "num_constrained_rows")


@dataclass(frozen=True)
class StepFeatures:
    """One engine step as a cost model sees it (counts over the step's scheduled requests)."""

    num_tokens: int  # scheduled tokens: prefill chunks + decodes + draft tokens
    num_reqs: int  # scheduled requests
    num_decode_reqs: int  # of which compute one token (query length 1)
    num_prefill_reqs: int  # of which compute more (prefill chunks, verify rows with drafts)
    num_sampled: int  # rows the LM head and sampler run on: 1 per request reaching its end, + its drafts
    decode_context: int  # keys read by the decode rows: sum of (context + 1), tokens
    max_decode_context: int  # the longest decode row's keys, tokens (a padded decode batch reads rows x this)
    decode_unique_context: int  # distinct cached tokens the decode rows read (shared prefix blocks once), tokens
    prefill_context: int  # keys read by the other rows: sum of (context + query length), tokens
    prefill_pairs: int  # causal query-key pairs of the other rows: sum of q * context + q * (q + 1) / 2
    num_swap_blocks: int = 0  # KV blocks copied by swap preemption before the forward (out + in)
    num_constrained_rows: int = 0  # sampled rows with a grammar bitmask (structured output)

    def as_dict(self) -> dict[str, int]:
        """Plain dict (profile files)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> StepFeatures:
        """Inverse of :meth:`as_dict`; the optional counts (swaps, constrained rows) default to 0.

        Raises:
            KeyError: a required feature is missing (a profile file of another format).
        """
        optional = ("num_swap_blocks", "num_constrained_rows")
        return cls(**{name: int(values[name]) for name in FEATURE_NAMES if name not in optional},
                   **{name: int(values.get(name, 0)) for name in optional})


def step_features(scheduler_output: SchedulerOutput, block_size: int,
                  loaded: Mapping[str, int] | None = None) -> StepFeatures:
    """The features of a scheduled step, read before the step's results are applied (each request's
    ``num_computed_tokens`` is still its context before the step).

    A request samples when its scheduled tokens reach the end of its real tokens (a prefill chunk that
    does not is not sampled); a request verifying ``k`` drafts samples ``k + 1`` rows. Distinct decode
    context counts the distinct KV blocks (``block_size`` tokens) of the decode rows' first block tables:
    requests sharing a cached prefix read its blocks from the same memory.

    ``loaded`` maps a request id to the leading tokens whose K/V arrived from elsewhere (a P/D decode replica's
    prompt, transferred from its prefill replica: vLLM's ``do_remote_prefill``): the scheduler still schedules
    them (the blocks are allocated), but only the tokens past them are computed, with the loaded ones as context.
    """
    n = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    num_decode = num_sampled = decode_context = max_decode_context = prefill_context = prefill_pairs = 0
    decode_blocks: set[int] = set()
    num_tokens = scheduler_output.total_num_scheduled_tokens
    computed = list(scheduler_output.scheduled_requests)
    for request in scheduler_output.scheduled_requests:
        q = n[request.request_id]
        context = request.num_computed_tokens
        if loaded and request.request_id in loaded:
            skip = min(q, max(0, loaded[request.request_id] - context))  # tokens whose K/V arrived
            num_tokens -= skip
            context, q = context + skip, q - skip
            if q == 0:
                computed.remove(request)
                continue
        if q == 1:
            num_decode += 1
            decode_context += context + 1
            max_decode_context = max(max_decode_context, context + 1)
            decode_blocks.update(scheduler_output.block_ids[request.request_id][0])
        else:
            prefill_context += context + q
            prefill_pairs += q * context + q * (q + 1) // 2
        if context + q >= request.num_tokens:
            num_sampled += 1 + len(spec.get(request.request_id, ()))
    num_reqs = len(computed)
    constrained = scheduler_output.grammar_bitmask
    return StepFeatures(
        num_tokens=num_tokens, num_reqs=num_reqs, num_decode_reqs=num_decode,
        num_prefill_reqs=num_reqs - num_decode, num_sampled=num_sampled, decode_context=decode_context,
        max_decode_context=max_decode_context,
        decode_unique_context=min(decode_context, len(decode_blocks) * block_size), prefill_context=prefill_context, prefill_pairs=prefill_pairs,
        num_swap_blocks=sum(len(b) for b, _ in scheduler_output.swap_out) + sum(len(b) for b, _ in scheduler_output.swap_in),
        num_constrained_rows=0 if constrained is None else int(constrained.shape[0]))
