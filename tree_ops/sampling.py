"""Seeded sampling that does not depend on the tree: the rule, and its batched form.

The token at absolute position t is drawn from the target's processed distribution there with
one uniform number u(seed, t) from a counter-based generator, by inverse CDF over the vocabulary
in id order. Nothing else enters the draw, so the token at t depends only on the seed, t and the
target's distribution at t -- not on the budget, the tree's shape, or other requests in a batch.
That is what makes a seeded speculative run emit exactly the tokens of plain seeded sampling:
every tree node is offered the draw its position would get without speculation.

`uniform` and `processed_probs` state the rule for one request (plain decoding uses them);
`uniforms` and `processed_probs_rows` compute it for a step's rows at once, each row with its own
request's parameters and seed, without a Python loop over rows or a host read per row, and give
the same bits (tests/test_sampling.py holds them to it).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Protocol

import torch

from . import triton_support

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


def _as_int64(x: int) -> int:
    """The two's-complement int64 with the low 64 bits of x."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _MIX1, _MIX2 = (_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x >> n of int64 tensors read as unsigned 64-bit (torch shifts int64 arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """_splitmix64 over an int64 tensor: the same bits (int64 sums and products wrap mod 2^64)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`uniform` for many draws at once, where the tensors are: seeds [B] int64, positions
    [B, Q] int64 -> [B, Q] float64, element (b, i) = uniform(seeds[b], positions[b, i])."""
    mixed = _splitmix64_tensor(_splitmix64_tensor(seeds.to(torch.int64))[:, None] ^ positions.to(torch.int64))
    return _shift_right(mixed, 11).to(torch.float64) * 2.0**-53


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
# rows one sort of whole vocabularies holds on the device path of _nucleus_rows (its memory: this
# many rows' probabilities, sorted ids and running sums)
NUCLEUS_SORT_ROWS = 64


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


@dataclass(frozen=True)
class RowSampling:
    """The sampling parameters of N rows (each row a tree node of some request), as tensors for
    processed_probs_rows, and what the rows need in all (decided on the host, where the
    parameters are, so that processing them reads nothing back from the device).

    Example: rows of requests (T 0.7, top_k 20) x 2 and (T 1) x 1 -> temperature [0.7, 0.7, 1],
    top_k [20, 20, 0], top_p [1, 1, 1], min_p [0, 0, 0]; largest_top_k 20, no top_p, no min_p."""

    temperature: torch.Tensor  # [N] float64
    top_k: torch.Tensor  # [N] int64: 0 = off (also for -1 and for a top_k not below the vocabulary)
    top_p: torch.Tensor  # [N] float64: 1 = off
    min_p: torch.Tensor  # [N] float64: 0 = off
    largest_top_k: int  # the largest top_k in effect, 0 when none is
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def of(cls, params: list[SamplingLike], vocab: int, device=None) -> "RowSampling":
        """One row per entry of `params` (none of them greedy)."""
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
            torch.tensor(top_k, dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device),
            max(top_k, default=0), any(p.top_p < 1.0 for p in params), any(p.min_p > 0.0 for p in params),
        )

    def select(self, index: torch.Tensor) -> "RowSampling":
        """The rows `index` [M] (a device tensor: no host read), their needs as the whole's."""
        return RowSampling(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index],
                           self.largest_top_k, self.any_top_p, self.any_min_p)


def processed_probs_rows(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """processed_probs of every row of logits [N, V] under its own parameters, at once: row i
    is bitwise processed_probs(logits[i : i + 1], params of row i)."""
    x = logits.double() / rows.temperature[:, None]
    if rows.largest_top_k:
        # the k-th largest of each row, as topk(k) gives it: the k-th of the largest top_k's topk
        kth = x.topk(rows.largest_top_k, dim=-1).values.gather(-1, (rows.top_k.clamp(min=1) - 1)[:, None])
        x = x.masked_fill((rows.top_k > 0)[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if rows.any_top_p:
        probs = _nucleus_rows(probs, rows.top_p)
    if rows.any_min_p:
        probs = probs.masked_fill(probs < rows.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _nucleus_rows(probs: torch.Tensor, top_p: torch.Tensor, on_device: bool | None = None) -> torch.Tensor:
    """_nucleus of rows [N, V] with their own top_p [N] (rows at 1 kept whole), batched: the
    rows' NUCLEUS_CANDIDATES largest, ranked (probability descending, id ascending); the rows
    whose nucleus those cannot decide -- their mass stays below top_p, or more ids tie the last
    candidate than it holds -- rank their whole vocabulary instead. The same kept ids as _nucleus:
    a candidate prefix ranks and sums as the whole vocabulary's prefix does.

    Which rows are undecided is a value on the device. The host path (`on_device` False) reads
    it back and ranks those rows alone; the device path (True) reads nothing: it ranks every
    row's whole vocabulary, NUCLEUS_SORT_ROWS rows a sort, and keeps that ranking's nucleus where
    the row is undecided -- more work, no wait for the device. None: the device path for tensors
    off the CPU and where the engine's device path runs on the CPU (triton_support.KERNELS_ON_CPU),
    the host path on the CPU."""
    if on_device is None:
        on_device = probs.device.type != "cpu" or triton_support.KERNELS_ON_CPU
    k = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    values, ids = probs.topk(k, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # ascending ids, so that the stable sort ranks ties by id
    sorted_p, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ranked = ids.gather(-1, order)
    mass = sorted_p.cumsum(-1)
    inside = (mass - sorted_p) < top_p[:, None]
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, ranked, inside)
    undecided = ((mass[:, -1] < top_p) | ((probs >= sorted_p[:, -1:]).sum(-1) > k)) & (top_p < 1.0)
    if on_device:
        for lo in range(0, probs.shape[0], NUCLEUS_SORT_ROWS):
            hi = lo + NUCLEUS_SORT_ROWS
            whole = _whole_nucleus(probs[lo:hi], top_p[lo:hi])
            kept[lo:hi] = torch.where(undecided[lo:hi, None], whole, kept[lo:hi])
    else:
        rows = undecided.nonzero().view(-1)  # one host read for the call
        if len(rows):
            kept[rows] = _whole_nucleus(probs[rows], top_p[rows])
    kept |= (top_p >= 1.0)[:, None]
    return probs.masked_fill(~kept, 0.0)


def _whole_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[M, V] bool: each row's nucleus, its whole vocabulary ranked (probability descending, id
    ascending). probs [M, V], top_p [M]."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    inside = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    return torch.zeros_like(sorted_p, dtype=torch.bool).scatter_(-1, order, inside)


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
