"""Seeded sampling that does not depend on the tree: torch references.

The token at absolute position t is drawn from the target's processed distribution there with
one uniform number u(seed, t) from a counter-based generator, by inverse CDF over the vocabulary
in id order. Nothing else enters the draw, so the token at t depends only on the seed, t and the
target's distribution at t -- not on the budget, the tree's shape, or other requests in a batch.
That is what makes a seeded speculative run emit exactly the tokens of plain seeded sampling:
every tree node is offered the draw its position would get without speculation.
"""

from __future__ import annotations

import secrets
from typing import Protocol

import torch

_MASK64 = (1 << 64) - 1


class SamplingLike(Protocol):
    temperature: float  # 0 = greedy
    top_k: int  # 0 or -1 = off
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    seed: int | None  # None = a random seed (draw_seed)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position): SplitMix64 of the
    position, keyed by SplitMix64 of the seed, top 53 bits."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * 2.0**-53


def is_greedy(params: SamplingLike) -> bool:
    """The one rule for "this request draws nothing": temperature 0, or top-k 1."""
    return params.temperature == 0 or params.top_k == 1


def draw_seed(params: SamplingLike) -> int | None:
    """The seed a request's draws use: None when greedy (it draws nothing), the request's own
    seed when it has one, else a fresh random 63-bit seed (reported back, so the run repeats)."""
    if is_greedy(params):
        return None
    return params.seed if params.seed is not None else secrets.randbits(63)


def processed_probs(logits: torch.Tensor, params: SamplingLike) -> torch.Tensor:
    """logits [..., V] -> float64 probabilities after temperature, then top-k, top-p and min-p
    filtering (OpenAI / vLLM semantics: top_k 0 or -1 and top_p 1 are off; min_p keeps tokens
    with at least min_p times the top token's probability).

    Example (temperature 1): probs [.5, .3, .15, .05]; top_p .7 keeps the smallest prefix of the
    sorted tokens whose mass reaches .7 -> [.5, .3] -> renormalised [.625, .375, 0, 0].
    """
    x = logits.double() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


NUCLEUS_CANDIDATES = 1024


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes every token outside the smallest run of most likely tokens (ties by token id)
    whose mass reaches top_p; the top token always stays. Each row sorts only its candidates --
    the tokens at least as likely as its NUCLEUS_CANDIDATES-th -- and falls back to the whole
    vocabulary when the candidates' mass stays below top_p."""
    rows = probs.reshape(-1, probs.shape[-1])
    kept = torch.zeros_like(rows, dtype=torch.bool)
    k = min(NUCLEUS_CANDIDATES, rows.shape[-1])
    kth = rows.topk(k, dim=-1).values[:, -1]
    for r, row in enumerate(rows):
        for ids in ((row >= kth[r]).nonzero().squeeze(-1), None):
            vals = row if ids is None else row[ids]
            sorted_p, order = vals.sort(descending=True, stable=True)  # ties keep ascending ids
            mass = sorted_p.cumsum(0)
            if ids is not None and mass[-1] < top_p:
                continue  # the nucleus reaches past the candidates: sort the whole row
            inside = order[(mass - sorted_p) < top_p]
            kept[r, inside if ids is None else ids[inside]] = True
            break
    return probs.masked_fill(~kept.reshape(probs.shape), 0.0)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V], u [N] in [0, 1) -> [N] int64: the first id whose cumulative mass (in id
    order) exceeds u * total. Tokens of zero probability are never chosen."""
    cdf = probs.cumsum(dim=-1)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def choose_tokens(logits: torch.Tensor, params: SamplingLike, seed: int | None, positions: list[int]) -> torch.Tensor:
    """The target's token for each row: argmax when greedy, else the seeded draw for that row's
    absolute position. logits [N, V]; positions: the position of the token each row chooses."""
    if is_greedy(params):
        return logits.argmax(dim=-1)
    u = torch.tensor([uniform(seed, p) for p in positions], dtype=torch.float64, device=logits.device)
    return inverse_cdf(processed_probs(logits, params), u)
