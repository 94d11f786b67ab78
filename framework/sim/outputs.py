"""What a simulated model samples: synthetic tokens, output lengths, grammar-valid tokens, accepted drafts.

Output lengths come from the workload: a request runs to its ``max_tokens`` (a trace's output lengths,
or ``max_tokens`` with ``ignore_eos``) unless an ``eos_probability`` is given, in which case each token
after ``min_tokens`` is the request's EOS with that probability (geometric lengths, mean ``1 / p``), as
long as the request does not ignore EOS. Tokens are uniform over the vocabulary (ids below
``low_id``, where Llama-style vocabularies keep unk/bos/eos, and the EOS ids excluded), so detokenizing
and stop checks cost what they cost. A row with a grammar bitmask samples uniformly among the ids the
grammar allows, so structured requests advance their real matchers and finish when the grammar ends.

Speculative decoding: :class:`AcceptanceModel` decides how many of a request's scheduled drafts the
target accepts (position ``i`` with a conditional probability ``rates[i]``, given that the positions
before it were accepted; the last rate repeats), the sampled tokens being the accepted drafts plus one
token of the target, as with rejection sampling (Leviathan et al., ICML'23, Sec. 2.3).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from framework.core.request import Request

LOW_TOKEN_ID = 3  # ids below are unk/bos/eos in Llama-style vocabularies: never sampled synthetically
FAKE_LOGPROB = -1.0  # logprob reported for synthetic tokens (they come from no distribution)


class AcceptanceModel:
    """Per-position conditional acceptance of draft tokens.

    Args:
        rates: ``rates[i]`` = P(draft ``i`` accepted | drafts ``< i`` accepted), each in [0, 1]; positions past
            the list use its last rate.

    Raises:
        ValueError: an empty list or a rate outside [0, 1].
    """

    def __init__(self, rates: Sequence[float]) -> None:
        rates = [float(r) for r in rates]
        if not rates or not all(0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"acceptance rates must be a non-empty list of probabilities in [0, 1], got {rates}")
        self.rates = rates

    def rate(self, position: int) -> float:
        """Conditional acceptance of draft ``position`` (0-based)."""
        return self.rates[min(position, len(self.rates) - 1)]

    def num_accepted(self, num_drafts: int, rng: random.Random) -> int:
        """Drafts accepted out of ``num_drafts``: the first rejection ends the run of accepted ones."""
        accepted = 0
        while accepted < num_drafts and rng.random() < self.rate(accepted):
            accepted += 1
        return accepted

    def expected_rate(self, num_drafts: int) -> float:
        """Expected accepted / drafted when every step verifies ``num_drafts`` drafts (what ``metrics.json``
        reports as ``spec_acceptance_rate``)."""
        reach, total = 1.0, 0.0
        for i in range(num_drafts):
            reach *= self.rate(i)
            total += reach
        return total / num_drafts

    @classmethod
    def from_overall_rate(cls, rate: float, num_drafts: int) -> AcceptanceModel:
        """The constant conditional rate whose :meth:`expected_rate` at ``num_drafts`` equals ``rate`` (the
        accepted / drafted ratio a run reports), by bisection.

        Raises:
            ValueError: ``rate`` outside [0, 1].
        """
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"an acceptance rate is in [0, 1], got {rate}")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cls([mid]).expected_rate(num_drafts) < rate else (lo, mid)
        return cls([(lo + hi) / 2])

    @classmethod
    def from_param(cls, value: Any, drafter: str, num_drafts: int) -> AcceptanceModel:
        """``executor.params.acceptance``: a rate (accepted / drafted, as runs report it), a list of
        per-position conditional rates, a mapping drafter name -> either of those, or a file: a real run's
        ``metrics.json`` (its ``spec_acceptance_by_position``) or a JSON list of per-position rates.

        Raises:
            ValueError: no value (spec decode needs one), no entry for ``drafter``, a bad rate or file.
            FileNotFoundError: a missing file.
        """
        if value is None:
            raise ValueError(f"executor=sim with spec_decode={drafter} needs executor.params.acceptance: a rate "
                             "(e.g. 0.6), per-position rates, {drafter: rate}, or a real run's metrics.json")
        if isinstance(value, Mapping):
            if drafter not in value:
                raise ValueError(f"executor.params.acceptance has no entry for drafter {drafter!r} (has "
                                 f"{', '.join(map(str, value))})")
            return cls.from_param(value[drafter], drafter, num_drafts)
        if isinstance(value, (int, float)):
            return cls.from_overall_rate(float(value), num_drafts)
        if isinstance(value, str):
            return cls(_rates_from_file(Path(value)))
        return cls(list(value))


def _rates_from_file(path: Path) -> list[float]:
    if not path.is_file():
        raise FileNotFoundError(f"acceptance file {path} not found (a metrics.json of a spec-decode run, or a JSON "
                                "list of per-position rates)")
    body = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(body, dict):
        rates = body.get("spec_acceptance_by_position")
        if not rates:
            raise ValueError(f"{path} has no spec_acceptance_by_position (a run without speculative decoding?)")
        return list(rates)
    return list(body)


class SyntheticSampler:
    """Samples synthetic tokens for a simulated model (see the module docstring).

    Args:
        vocab_size: logits columns of the simulated model.
        seed: RNG seed (the engine's): a run is reproducible.
        eos_probability: chance that a token is EOS (``None``: requests run to ``max_tokens``).

    Raises:
        ValueError: ``eos_probability`` outside [0, 1] or a vocabulary with no sampleable id.
    """

    def __init__(self, vocab_size: int, seed: int = 0, eos_probability: float | None = None) -> None:
        if eos_probability is not None and not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"executor.params.eos_probability must be in [0, 1] (or null), got {eos_probability}")
        if vocab_size <= LOW_TOKEN_ID + 1:
            raise ValueError(f"a vocabulary of {vocab_size} ids leaves nothing to sample synthetically")
        self.vocab_size = vocab_size
        self.eos_probability = eos_probability
        self.rng = random.Random(seed)

    def token(self, request: Request, num_output: int) -> int:
        """One unconstrained token for ``request`` whose output holds ``num_output`` tokens so far."""
        params = request.sampling_params
        eos = request.eos_token_ids
        if (self.eos_probability and eos and not params.ignore_eos and num_output >= params.min_tokens
                and self.rng.random() < self.eos_probability):
            return min(eos)
        return self.token_without_eos(request)

    def allowed_token(self, bitmask_row: Any) -> int:
        """A token the grammar allows: uniform over the set bits of one ``(ceil(vocab / 32),)`` int32 bitmask
        row (a CPU tensor or array; bit ``t % 32`` of word ``t // 32`` is token ``t``; the grammar manager
        already refused rows that allow nothing).

        Raises:
            ValueError: the row allows no token of the vocabulary.
        """
        import numpy as np

        words = np.ascontiguousarray(np.asarray(bitmask_row), dtype=np.int32)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size]
        allowed = np.flatnonzero(bits)
        if allowed.size == 0:
            raise ValueError("the grammar bitmask allows no token")
        return int(allowed[self.rng.randrange(allowed.size)])

    def draft(self, request: Request, num_drafts: int) -> list[int]:
        """``num_drafts`` stand-in draft tokens (never EOS: drafts are verified, not emitted as such)."""
        return [self.token_without_eos(request) for _ in range(num_drafts)]

    def token_without_eos(self, request: Request) -> int:
        """A uniform non-EOS token."""
        while True:
            token = self.rng.randrange(LOW_TOKEN_ID, self.vocab_size)
            if token not in request.eos_token_ids:
                return token

    @staticmethod
    def logprobs(token: int, num_logprobs: int | None) -> dict[int, float] | None:
        """Synthetic logprobs of a sampled token (``{token: FAKE_LOGPROB}``; ``None`` when none were asked):
        a simulated model has no distribution, so only the sampled token is reported."""
        return None if num_logprobs is None else {token: FAKE_LOGPROB}
