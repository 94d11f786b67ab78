"""Medusa's typical acceptance (Cai et al., ICML 2024, "Medusa", Sec. 2.3.1): a lossy verification rule.

``spec_decode.params.acceptance=typical`` replaces exact rejection sampling for random (temperature > 0) requests:
a draft node is accepted when its parent is and its token's target probability at the parent's row exceeds
``min(epsilon, delta * exp(-H(p)))``, ``H`` the entropy of that row's target distribution (after temperature, top-k,
top-p: the processed probabilities normal sampling draws from). The longest accepted root-to-node path wins (ties go
to the node listed first), and the next token is sampled from the target at the path's last node. A chain is the
one-branch tree. The output is *not* the target distribution (it favours likely tokens, like a lower temperature);
runs say so in ``metrics.json`` (``spec_acceptance: typical``) and in a log line. Greedy requests are unchanged.

Defaults follow Medusa's code: ``epsilon`` is its ``posterior_threshold`` (0.09), ``delta`` its ``posterior_alpha``
(0.3, about ``sqrt(epsilon)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from framework.sample.sampler import inverse_cdf_sample

ACCEPTANCE_RULES = ("exact", "typical")


@dataclass(frozen=True)
class TypicalAcceptance:
    """Thresholds of the typical acceptance rule (Medusa Sec. 2.3.1).

    Raises:
        ValueError: from ``__post_init__`` when ``epsilon`` is not in (0, 1] or ``delta`` is not positive.
    """

    epsilon: float = 0.09  # hard posterior threshold (Medusa's posterior_threshold)
    delta: float = 0.3  # entropy-scaled threshold factor (Medusa's posterior_alpha)

    def __post_init__(self) -> None:
        if not 0.0 < self.epsilon <= 1.0:
            raise ValueError(f"spec_decode.params.epsilon must be in (0, 1], got {self.epsilon}")
        if self.delta <= 0.0:
            raise ValueError(f"spec_decode.params.delta must be > 0, got {self.delta}")

    def thresholds(self, p: torch.Tensor) -> torch.Tensor:
        """``(rows,)`` float32 acceptance thresholds ``min(epsilon, delta * exp(-H))`` of ``(rows, vocab)`` float32
        probabilities ``p`` (entropy in nats; zero-probability tokens contribute nothing)."""
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(dim=1)
        return torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)

    def verify(self, drafts: list[int], parents: list[int], p: torch.Tensor,
               generator: torch.Generator) -> tuple[list[int], int]:
        """Typical acceptance over one request's draft tree.

        Args:
            drafts, parents: the tree's ``k`` tokens and parent indices (``-1``: the root); a chain is
                ``parents = [-1, 0, ..., k - 2]``.
            p: ``(k + 1, vocab)`` float32 target probabilities of row 0 (the root's) and of each node's row.
            generator: where the one float64 uniform of the final draw comes from.

        Returns:
            ``(accepted node indices root side first, the next token sampled from p at the last accepted node)``.
        """
        p_cpu = p.detach().to("cpu", torch.float32)
        limit = self.thresholds(p_cpu).tolist()
        accepted = [False] * len(drafts)
        depth = [0] * len(drafts)
        best = -1
        for node, parent in enumerate(parents):
            if parent >= 0 and not accepted[parent]:
                continue
            accepted[node] = float(p_cpu[parent + 1, drafts[node]]) > limit[parent + 1]
            if accepted[node]:
                depth[node] = (depth[parent] if parent >= 0 else 0) + 1
                if best < 0 or depth[node] > depth[best]:
                    best = node
        path = []
        at = best
        while at >= 0:
            path.append(at)
            at = parents[at]
        path.reverse()
        u = torch.rand(1, dtype=torch.float64, generator=generator)
        return path, int(inverse_cdf_sample(p_cpu[best + 1].unsqueeze(0), u)[0])


def acceptance_from_params(params: dict[str, Any]) -> TypicalAcceptance | None:
    """The typical rule ``spec_decode.params`` asks for (``acceptance=typical``), else ``None`` (exact).

    Args:
        params: ``spec_decode.params`` (``acceptance``, ``epsilon``, ``delta``; ``delta`` defaults to
            ``sqrt(epsilon)`` when only ``epsilon`` is set, else 0.3).

    Raises:
        ValueError: ``acceptance`` is not ``exact``/``typical``, or the thresholds are out of range.
    """
    rule = params.get("acceptance") or "exact"
    if rule not in ACCEPTANCE_RULES:
        raise ValueError(f"spec_decode.params.acceptance={rule!r} is not one of {list(ACCEPTANCE_RULES)}")
    if rule == "exact":
        return None
    epsilon = params.get("epsilon")
    delta = params.get("delta")
    if epsilon is None:
        return TypicalAcceptance(delta=float(delta) if delta is not None else 0.3)
    return TypicalAcceptance(float(epsilon), float(delta) if delta is not None else math.sqrt(float(epsilon)))
