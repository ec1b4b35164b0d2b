"""The tie rule: when two fp32 runs of the target choose different tokens, was it a near-tie?

A tree-verify pass and a one-token step (or two tensor-parallel shards and one process) sum in
different orders, so logits differ in the last bits. Where that flips a token it is a numerical
near-tie, not a bug: greedy, the target's top-2 logit gap is below LOGIT_TIE; sampled, the
seeded draw lies within CDF_TIE of the edge between two tokens in the cumulative distribution.
"""

from __future__ import annotations

import torch

from ddtree.kernels.sampling import processed_probs, uniform

LOGIT_TIE = 1e-3
CDF_TIE = 1e-6


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    out = model(torch.tensor([ids]), torch.arange(n)[None], model.prefill_mask(n), model.new_cache(1, n), logits_to_keep=1)
    return out.logits[0, -1]


def tie_gap(model, request, seed: int | None, context: list[int]) -> float:
    """How close the target was to choosing differently after `context`: the top-2 logit gap
    (greedy), or the distance of the seeded draw to the nearest CDF edge (sampled)."""
    logits = next_token_logits(model, request.prompt + context)
    if seed is None:
        top = logits.topk(2).values
        return float(top[0] - top[1])
    cdf = processed_probs(logits[None], request.sampling)[0].cumsum(-1)
    u = uniform(seed, len(request.prompt) + len(context)) * float(cdf[-1])
    return float((cdf - u).abs().min())


def divergence(model, request, seed: int | None, reference: list[int], got: list[int]):
    """None if the token lists are equal; else (index, gap, is_near_tie) of the first difference."""
    at = next((j for j, (a, b) in enumerate(zip(reference, got)) if a != b), None)
    if at is None:
        assert reference == got, "lengths differ without a divergence"
        return None
    gap = tie_gap(model, request, seed, reference[:at])
    return at, gap, gap < (LOGIT_TIE if seed is None else CDF_TIE)
