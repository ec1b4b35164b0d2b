"""The speculative loop: draft -> build tree -> verify -> walk -> commit, until a stop.

Budget 0 is plain autoregressive decoding, "chain" is vanilla DFlash (top-1 per depth), an
integer budget is DDTree; all three are this one loop with different trees, and all emit the
target's own greedy tokens.

Glossary: a round's *accepted* tokens are the drafted tokens on the path the target agrees
with; its *bonus* is the target's own next token after them; its *output* tokens are
accepted + bonus (so every round emits at least one token). tau = output tokens per round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from ..kernels.tree import Tree, VerifyBlock, build_tree, chain_tree, compact_kv, greedy_walk, verify_block
from .drafter import Proposer
from .model import TargetModel

Budget = int | Literal["chain"]


@dataclass
class Request:
    prompt: list[int]  # prompt token ids (chat template already applied)
    max_tokens: int = 64
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded completion
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class RoundStats:
    tree_size: int  # real nodes, root included
    accepted: int  # drafted tokens accepted (output tokens of the round = accepted + 1)
    draft_s: float
    tree_s: float
    verify_s: float
    commit_s: float  # walk, KV compaction, feature hand-off, stop checks


@dataclass
class Result:
    tokens: list[int]  # completion token ids (an EOS token that ended it is included)
    text: str | None  # decoded completion, cut before a matched stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prefill_s: float
    decode_s: float
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean output tokens per round (the prefill's first token is not a round's)."""
        return (len(self.tokens) - 1) / len(self.rounds) if self.rounds else 0.0


@dataclass
class _Sequence:
    """Per-request state of the loop. Invariant between rounds: the target cache holds every
    committed token except the pending bonus, which sits at position `cache.lengths[0]`."""

    request: Request
    output: list[int]  # emitted completion tokens, the pending bonus last
    features: torch.Tensor | None  # [1, n, F] target features not yet handed to the drafter
    finish_reason: str | None = None
    text: str | None = None


class Coordinator:
    """Drives a target and an optional drafter over a batch of requests.

    The per-request state lives in `_Sequence` objects and the model caches carry a batch
    dimension; this in-process engine runs the sequences of a batch one after another.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Proposer | None = None,
        budget: Budget = 0,
        static_shapes: bool = True,
        decode: Callable[[list[int]], str] | None = None,
    ):
        if budget != 0 and drafter is None:
            raise ValueError(f"budget {budget!r} needs a drafter; use budget 0 for plain decoding")
        if budget != "chain" and (not isinstance(budget, int) or budget < 0):
            raise ValueError(f"budget must be a non-negative integer or 'chain', got {budget!r}")
        self.target = target
        self.drafter = drafter if budget != 0 else None
        self.budget = budget
        self.static_shapes = static_shapes
        self.decode = decode
        self.capture = tuple(self.drafter.target_layer_ids) if self.drafter else ()

    @property
    def verify_len(self) -> int:
        """Q: the fixed verify length of the static-shape path (budget + 1)."""
        if self.budget == "chain":
            return self.drafter.block_size
        return self.budget + 1

    def generate(self, requests: list[Request]) -> list[Result]:
        return [self._generate_one(r) for r in requests]

    # --- one request ----------------------------------------------------------------------

    def _generate_one(self, request: Request) -> Result:
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        slots = len(request.prompt) + request.max_tokens + self.verify_len + 1
        cache = self.target.new_cache(1, slots)
        draft_cache = self.drafter.new_cache(1, slots) if self.drafter else None
        block = VerifyBlock.allocate(self.verify_len) if self.static_shapes else None

        t0 = time.perf_counter()
        seq = self._prefill(request, cache)
        prefill_s = time.perf_counter() - t0
        rounds: list[RoundStats] = []
        self._check_stop(seq)
        while seq.finish_reason is None:
            rounds.append(self._round(seq, cache, draft_cache, block))
        return Result(
            tokens=seq.output,
            text=seq.text,
            finish_reason=seq.finish_reason,
            prefill_s=prefill_s,
            decode_s=time.perf_counter() - t0 - prefill_s,
            rounds=rounds,
        )

    def _prefill(self, request: Request, cache) -> _Sequence:
        tokens = torch.tensor([request.prompt], device=self.target.device)
        n = tokens.shape[1]
        out = self.target(
            tokens,
            torch.arange(n, device=tokens.device)[None],
            self.target.prefill_mask(n),
            cache,
            capture_layers=self.capture,
            logits_to_keep=1,
        )
        cache.lengths += n
        return _Sequence(request, output=[int(out.logits[0, -1].argmax())], features=out.features)

    def _round(self, seq: _Sequence, cache, draft_cache, block: VerifyBlock | None) -> RoundStats:
        start = int(cache.lengths[0])
        bonus = seq.output[-1]

        # 1. Draft: one drafter pass proposes distributions for the next B-1 positions.
        t0 = time.perf_counter()
        logprobs = None
        if self.drafter is not None:
            logprobs = self.drafter.draft(
                draft_cache, seq.features, torch.tensor([bonus]), torch.tensor([start])
            )[0]
            seq.features = None
        t1 = time.perf_counter()

        # 2. Build the tree (root only for plain decoding).
        tree = self._tree(bonus, logprobs)
        t2 = time.perf_counter()

        # 3. Verify: one target pass over the whole tree, padded to the static length.
        vb = block.fill(tree, start) if block is not None else verify_block(tree, start)
        out = self.target(
            vb.tokens[None], vb.positions[None], vb.mask[None], cache, capture_layers=self.capture
        )
        t3 = time.perf_counter()

        # 4. Walk: the longest path the target agrees with, and its bonus token.
        walk = greedy_walk(tree, out.logits[0, : vb.num_nodes].argmax(dim=-1))

        # 5. Commit: keep the path's KV rows, hand its features to the drafter, emit tokens.
        compact_kv(cache.k, cache.v, 0, start, walk.path)
        cache.lengths += len(walk.path)
        if out.features is not None:
            seq.features = out.features[:, walk.path]
        seq.output.extend(tree.tokens[walk.path[1:]].tolist())
        seq.output.append(walk.bonus)
        self._check_stop(seq)
        t4 = time.perf_counter()
        return RoundStats(tree.size, len(walk.path) - 1, t1 - t0, t2 - t1, t3 - t2, t4 - t3)

    def _tree(self, bonus: int, logprobs: torch.Tensor | None) -> Tree:
        if logprobs is None:
            return Tree.root_only(bonus)
        if self.budget == "chain":
            return chain_tree(bonus, logprobs)
        return build_tree(bonus, logprobs, self.budget)

    def _check_stop(self, seq: _Sequence) -> None:
        """Cuts the output at the first EOS, stop string or max_tokens and sets finish_reason."""
        request, out = seq.request, seq.output
        eos = set(request.eos_token_ids)
        for i, token in enumerate(out[: request.max_tokens]):
            if token in eos:
                del out[i + 1 :]
                seq.finish_reason = "stop"
                break
        if seq.finish_reason is None and len(out) >= request.max_tokens:
            del out[request.max_tokens :]
            seq.finish_reason = "length"
        if self.decode is None:
            return
        text = self.decode(out)
        hits = [(text.find(s), s) for s in request.stop if s and s in text]
        if hits:
            cut = min(hits)[0]
            # keep the fewest tokens whose text reaches the stop string's end
            end = cut + len(min(hits)[1])
            keep = next(n for n in range(1, len(out) + 1) if len(self.decode(out[:n])) >= end)
            del out[keep:]
            seq.finish_reason, seq.text = "stop", text[:cut]
        else:
            seq.text = text
