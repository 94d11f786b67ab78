"""Verification of draft tokens against the target model (speculative decoding).

Drafters only propose; this module decides, once for every drafter, which drafts the target
accepts, so the output distribution is exactly the target's:

- greedy requests: accept drafts while they equal the target argmax, then emit the target's
  token (the "bonus" token when all k drafts were accepted);
- random requests: rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers
  via Speculative Decoding", Sec. 2.3; Chen et al. 2023, "Accelerating Large Language Model
  Decoding with Speculative Sampling", Alg. 2): accept draft ``d`` with probability
  ``min(1, p(d) / q(d))``; on the first rejection resample from ``norm(max(0, p - q))``; after k
  acceptances sample the bonus token from ``p``. Drafters without probabilities (n-gram) have a
  one-hot ``q``.

``p`` is the target distribution after exactly the processing normal sampling uses (min_tokens,
logit_bias, penalties, temperature, min-p, top-k, top-p: :class:`framework.sample.sampler.Sampler`), and row ``j``
of a request sees its output plus drafts ``0..j-1`` as if they had been generated.

Draft trees (``framework/core/spec_tree.py``; Medusa, Cai et al. 2024; SpecInfer, Miao et al. 2023): row 0 is the
root's, row ``i + 1`` node ``i``'s (it sees the output plus the node's root-to-node path). Greedy requests take the
longest root-to-node path whose every token equals the target argmax of its parent's row, then the target's token
after it. Random requests use SpecInfer's multi-step speculative sampling (Miao et al. 2023, Sec. 4.2, Alg. 2) with
deterministic candidates (a tree drafter's top-k guesses are functions of the context, so each child's ``q`` is
one-hot): at a node, its children are tried in order, child ``c`` accepted with probability ``p'(c) / sum(p')``
where ``p'`` is the node's target distribution with the already rejected siblings' tokens zeroed; the first accepted
child becomes the node and the walk goes on; when every child is rejected the next token is sampled from ``p'``.
Each emitted token then has exactly the target's probability, whatever the tree.

``spec_decode.params.acceptance=typical`` (:attr:`RejectionSampler.typical`) verifies random requests, chains and
trees, with Medusa's lossy typical acceptance instead (``framework/sample/typical_acceptance.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.core.request import Request
from framework.sample.sampler import Sampler, apply_logit_bias, apply_min_tokens, apply_penalties, inverse_cdf_sample
from framework.sample.typical_acceptance import TypicalAcceptance


@dataclass
class _VerifyRow:
    """One verify position of a request: the request as it would be after ``drafts[:j]``."""

    request: Request
    output_token_ids: list[int]  # output + drafts before this row

    @property
    def sampling_params(self):  # noqa: ANN201 - mirrors Request
        return self.request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class VerifyOutput:
    """Result of verifying one batch of speculating requests; index ``i`` is ``requests[i]``."""

    token_ids: list[list[int]]  # per request: accepted drafts + one target token (1..k+1 ids)
    num_accepted: list[int]  # per request: accepted drafts (0..k)
    logprobs: list[list[dict[int, float]]] | None  # per request, per emitted token; None if nobody asked
    # per request: the accepted nodes, root side first, when its drafts are a tree (None for a chain)
    accepted_nodes: list[list[int] | None] | None = None


def _row_paths(drafts: list[int], parents: list[int] | None) -> list[list[int]]:
    """Per verify row of one request, the drafts it sees as generated: ``drafts[:j]`` for row ``j`` of a chain; the
    root-to-node path's tokens for row ``i + 1`` (node ``i``) of a tree, ``[]`` for row 0."""
    if parents is None:
        return [list(drafts[:j]) for j in range(len(drafts) + 1)]
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(parents):
        paths.append(paths[parent + 1] + [drafts[node]])
    return paths


class RejectionSampler:
    """Verifies drafts; shares processing and the engine RNG with ``sampler``.

    Args:
        sampler: the engine's sampler (its ``processed_probs``, vocab size and generator).

    Attributes:
        typical: Medusa's typical acceptance for random requests (lossy), set by the worker from
            ``spec_decode.params.acceptance=typical``; ``None`` (default): exact rejection sampling.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.typical: TypicalAcceptance | None = None

    def __call__(self, logits: torch.Tensor, requests: list[Request], draft_token_ids: list[list[int]],
                 draft_probs: list[torch.Tensor | None] | None = None,
                 draft_parents: list[list[int] | None] | None = None) -> VerifyOutput:
        """Verify ``draft_token_ids[i]`` of ``requests[i]``.

        Args:
            logits: (sum_i (k_i + 1), >= vocab) target logits; request ``i`` owns ``k_i + 1``
                consecutive rows, row ``j`` predicting the token after draft ``j - 1``.
            requests: the speculating requests (each ``k_i >= 1``).
            draft_token_ids: per request, its k_i drafts.
            draft_probs: per request, (k_i, vocab) float32 draft probabilities, or None for a
                drafter without probabilities (one-hot q).
            draft_parents: per request, its drafts' parent indices when they are a tree (None: a chain).

        Returns:
            :class:`VerifyOutput`.

        Raises:
            ValueError: the row count does not match the drafts.
        """
        num_rows = sum(len(d) + 1 for d in draft_token_ids)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits must have {num_rows} rows (k+1 per request), got {tuple(logits.shape)}")
        vocab = self.sampler.vocab_size
        parents = draft_parents or [None] * len(requests)
        rows = [_VerifyRow(r, list(r.output_token_ids) + path)
                for r, d, p in zip(requests, draft_token_ids, parents, strict=True) for path in _row_paths(d, p)]
        logits = logits[:, :vocab].to(torch.float32, copy=True)
        want_logprobs = any(r.sampling_params.logprobs is not None for r in requests)
        raw_logprobs = logits.log_softmax(dim=1) if want_logprobs else None
        apply_min_tokens(logits, rows)  # type: ignore[arg-type]
        apply_logit_bias(logits, rows)  # type: ignore[arg-type]
        params = [r.sampling_params for r in rows]
        if any(p.needs_penalties for p in params):
            logits = apply_penalties(
                logits, [r.prompt_token_ids if r.sampling_params.needs_penalties else [] for r in rows],
                [r.output_token_ids if r.sampling_params.needs_penalties else [] for r in rows],
                *(Sampler._param(params, n, logits.device)
                  for n in ("repetition_penalty", "presence_penalty", "frequency_penalty")))
        argmax = logits.argmax(dim=1).tolist()
        probs = None
        if not all(p.greedy for p in params):
            probs = self.sampler.processed_probs(logits, rows)  # type: ignore[arg-type]
        out_tokens, num_accepted, emitted_rows, accepted_nodes = [], [], [], []
        start = 0
        for i, (request, drafts) in enumerate(zip(requests, draft_token_ids, strict=True)):
            k = len(drafts)
            accepted_nodes.append(None)
            typical = self.typical is not None and not request.sampling_params.greedy
            if parents[i] is not None or typical:
                tree = parents[i] if parents[i] is not None else list(range(-1, k - 1))  # a chain: one branch
                if request.sampling_params.greedy:
                    nodes = self._verify_tree_greedy(drafts, tree, argmax[start:start + k + 1])
                    last = argmax[start + (nodes[-1] + 1 if nodes else 0)]
                elif typical:
                    gen = request.generator if request.generator is not None else self.sampler.generator
                    nodes, last = self.typical.verify(drafts, tree, probs[start:start + k + 1], gen)
                else:
                    nodes, last = self._verify_tree_random(request, drafts, tree, probs[start:start + k + 1])
                accepted_nodes[i] = nodes if parents[i] is not None else None
                out_tokens.append([drafts[n] for n in nodes] + [last])
                num_accepted.append(len(nodes))
                emitted_rows.append([start] + [start + n + 1 for n in nodes])
                start += k + 1
                continue
            if request.sampling_params.greedy:
                tokens = self._verify_greedy(drafts, argmax[start:start + k + 1])
            else:
                q = draft_probs[i] if draft_probs is not None else None
                tokens = self._verify_random(request, drafts, probs[start:start + k + 1], q)
            out_tokens.append(tokens)
            num_accepted.append(len(tokens) - 1)
            emitted_rows.append(list(range(start, start + len(tokens))))
            start += k + 1
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._logprobs(raw_logprobs, requests, out_tokens, emitted_rows)
        return VerifyOutput(out_tokens, num_accepted, logprobs, accepted_nodes)

    @staticmethod
    def _verify_tree_greedy(drafts: list[int], parents: list[int], target: list[int]) -> list[int]:
        """The longest root-to-node path whose tokens each equal the target argmax of their parent's row.

        Args:
            drafts, parents: the tree's ``k`` tokens and parent indices (``-1``: the root).
            target: ``(k + 1,)`` argmax of row 0 (the root's) and of each node's row.

        Returns:
            The accepted node indices, root side first (empty: none accepted).
        """
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        best: list[int] = []
        stack: list[tuple[int, list[int]]] = [(-1, [])]
        while stack:
            at, path = stack.pop()
            if len(path) > len(best):
                best = path
            want = target[at + 1]
            stack += [(c, path + [c]) for c in children.get(at, ()) if drafts[c] == want]
        return best

    def _verify_tree_random(self, request: Request, drafts: list[int], parents: list[int],
                            p: torch.Tensor) -> tuple[list[int], int]:
        """SpecInfer's multi-step speculative sampling (Miao et al. 2023, Sec. 4.2) over one request's tree, with
        deterministic (one-hot) candidates; see the module docstring.

        Args:
            drafts, parents: the tree's ``k`` tokens and parent indices (``-1``: the root).
            p: ``(k + 1, vocab)`` float32 target probabilities of row 0 (the root's) and of each node's row.

        Returns:
            ``(accepted node indices root side first, the next token)``. Randomness: one uniform per tried child,
            then one float64 uniform for the final draw, from the request's generator when seeded, else the
            engine's.
        """
        gen = request.generator if request.generator is not None else self.sampler.generator
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        p_cpu = p.cpu()
        at, nodes = -1, []
        while True:
            dist = p_cpu[at + 1].clone()
            accepted = None
            for child in children.get(at, ()):
                token = drafts[child]
                # accept with probability p'(token) / sum(p'); rejected siblings' tokens are already zeroed
                if float(torch.rand(1, generator=gen)) * float(dist.sum()) < float(dist[token]):
                    accepted = child
                    break
                dist[token] = 0.0
            if accepted is None:
                u = torch.rand(1, dtype=torch.float64, generator=gen)
                return nodes, int(inverse_cdf_sample(dist.unsqueeze(0), u)[0])
            nodes.append(accepted)
            at = accepted

    @staticmethod
    def _verify_greedy(drafts: list[int], target: list[int]) -> list[int]:
        """Accepted drafts (equal to the target argmax) followed by the target's next token."""
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return target[:a + 1]

    def _verify_random(self, request: Request, drafts: list[int], p: torch.Tensor,
                       q: torch.Tensor | None) -> list[int]:
        """Rejection sampling (Leviathan et al. 2023, Sec. 2.3) for one request.

        Args:
            p: (k+1, vocab) float32 target probabilities.
            q: (k, vocab) float32 draft probabilities, or None (one-hot on the drafts).

        Randomness comes from the request's generator when seeded (k uniforms, then one
        inverse-CDF draw), else from the engine generator, so seeded runs are reproducible.
        """
        k = len(drafts)
        gen = request.generator if request.generator is not None else self.sampler.generator
        u = torch.rand(k, generator=gen)
        d = torch.tensor(drafts, dtype=torch.long)
        p_cpu = p.cpu()
        p_d = p_cpu[torch.arange(k), d]
        q_d = torch.ones(k) if q is None else q.cpu()[torch.arange(k), d]
        accept = u < torch.clamp(p_d / q_d.clamp_min(torch.finfo(torch.float32).tiny), max=1.0)
        rejected = torch.nonzero(~accept)
        a = int(rejected[0]) if rejected.numel() else k
        if a < k:
            if q is None:
                residual = p_cpu[a].clone()
                residual[drafts[a]] = 0.0
            else:
                residual = torch.clamp(p_cpu[a] - q.cpu()[a], min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q exactly: any draw from p is correct
                residual = p_cpu[a]
            dist = residual
        else:
            dist = p_cpu[k]
        token = int(inverse_cdf_sample(dist.unsqueeze(0), torch.rand(1, dtype=torch.float64, generator=gen))[0])
        return drafts[:a] + [token]

    @staticmethod
    def _logprobs(raw_logprobs: torch.Tensor, requests: list[Request], out_tokens: list[list[int]],
                  emitted_rows: list[list[int]]) -> list[list[dict[int, float]]]:
        """Per request, per emitted token: top-N raw logprobs of its row plus the emitted id."""
        flat_rows = [r for rows in emitted_rows for r in rows]
        flat_tokens = [t for toks in out_tokens for t in toks]
        flat_reqs = [req for req, toks in zip(requests, out_tokens, strict=True) for _ in toks]
        flat = Sampler._gather_logprobs(raw_logprobs[flat_rows], torch.tensor(flat_tokens, device=raw_logprobs.device),
                                        flat_tokens, flat_reqs)
        out, i = [], 0
        for toks in out_tokens:
            out.append(flat[i:i + len(toks)])
            i += len(toks)
        return out
