"""The speculative loop: draft -> build tree -> verify -> walk -> commit, until a stop.

Budget 0 is plain autoregressive decoding, "chain" is vanilla DFlash (top-1 per depth), an
integer budget is DDTree; all three are this one loop with different trees, and all emit the
target's own greedy tokens.

Glossary: a round's *accepted* tokens are the drafted tokens on the path the target agrees
with; its *bonus* is the target's own next token after them; its *output* tokens are
accepted + bonus (so every round emits at least one token). tau = output tokens per round.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal

import torch

from ..config import GREEDY, SamplingParams
from ..kernels.sampling import choose_tokens, is_greedy
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
    sampling: SamplingParams = GREEDY
    budget: Budget | None = None  # overrides the Coordinator's budget for this request


@dataclass
class RoundStats:
    tree_size: int  # real nodes, root included
    accepted: int  # drafted tokens accepted (output tokens of the round = accepted + 1)
    draft_s: float
    tree_s: float
    verify_s: float
    commit_s: float  # walk, KV compaction, feature hand-off, stop checks
    drafted_per_depth: tuple[int, ...] = ()  # [depth - 1] -> tree nodes at that depth


@dataclass
class Result:
    tokens: list[int]  # completion token ids (an EOS token that ended it is included)
    text: str | None  # decoded completion, cut before a matched stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    seed: int | None  # the seed the draws used (the request's, or a random one); None if greedy
    prefill_s: float
    decode_s: float
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean output tokens per round (the prefill's first token is not a round's)."""
        return (len(self.tokens) - 1) / len(self.rounds) if self.rounds else 0.0


@dataclass
class Update:
    """What one step of a request emitted: the prefill's first token, then each round's."""

    new_tokens: list[int]  # completion tokens emitted since the previous update
    round: RoundStats | None = None  # the round that emitted them (None for the prefill's)
    result: Result | None = None  # set on the request's last update only


@dataclass
class _Sequence:
    """Per-request state of the loop. Invariant between rounds: the target cache holds every
    committed token except the pending bonus, which sits at position `cache.lengths[0]`."""

    request: Request
    budget: Budget
    seed: int | None
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
        self.target = target
        self.drafter = drafter
        self.static_shapes = static_shapes
        self.decode = decode
        self.budget = self.check_budget(budget)

    def check_budget(self, budget: Budget) -> Budget:
        """Returns `budget` if this Coordinator can run it, else raises ValueError."""
        if budget != "chain" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"budget must be a non-negative integer or 'chain', got {budget!r}")
        if budget != 0 and self.drafter is None:
            raise ValueError(f"budget {budget!r} needs a drafter; use budget 0 for plain decoding")
        return budget

    def verify_len(self, budget: Budget) -> int:
        """Q: the fixed verify length of the static-shape path (budget + 1)."""
        if budget == "chain":
            return self.drafter.block_size
        return budget + 1

    def generate(self, requests: list[Request]) -> list[Result]:
        results = []
        for request in requests:
            for update in self.stream(request):
                pass
            results.append(update.result)
        return results

    # --- one request ----------------------------------------------------------------------

    def stream(self, request: Request) -> Iterator[Update]:
        """Runs one request, yielding the tokens of every step as soon as they are final."""
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        budget = self.check_budget(self.budget if request.budget is None else request.budget)
        drafter = self.drafter if budget != 0 else None
        capture = tuple(drafter.target_layer_ids) if drafter else ()
        q_len = self.verify_len(budget)
        slots = len(request.prompt) + request.max_tokens + q_len + 1
        cache = self.target.new_cache(1, slots)
        draft_cache = drafter.new_cache(1, slots) if drafter else None
        block = VerifyBlock.allocate(q_len) if self.static_shapes else None

        seed = None
        if not is_greedy(request.sampling):
            seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        t0 = time.perf_counter()
        seq = self._prefill(request, budget, seed, cache, capture)
        prefill_s = time.perf_counter() - t0
        rounds: list[RoundStats] = []
        self._check_stop(seq)
        sent = 0
        while seq.finish_reason is None:
            yield Update(seq.output[sent:], rounds[-1] if rounds else None)
            sent = len(seq.output)
            rounds.append(self._round(seq, cache, drafter, draft_cache, block, capture))
        result = Result(
            tokens=seq.output,
            text=seq.text,
            finish_reason=seq.finish_reason,
            seed=seed,
            prefill_s=prefill_s,
            decode_s=time.perf_counter() - t0 - prefill_s,
            rounds=rounds,
        )
        yield Update(seq.output[sent:], rounds[-1] if rounds else None, result)

    def _prefill(self, request: Request, budget: Budget, seed: int | None, cache, capture) -> _Sequence:
        tokens = torch.tensor([request.prompt], device=self.target.device)
        n = tokens.shape[1]
        out = self.target(
            tokens,
            torch.arange(n, device=tokens.device)[None],
            self.target.prefill_mask(n),
            cache,
            capture_layers=capture,
            logits_to_keep=1,
        )
        cache.lengths += n
        first = int(choose_tokens(out.logits[0, -1:], request.sampling, seed, [n])[0])
        return _Sequence(request, budget, seed, output=[first], features=out.features)

    def _round(self, seq: _Sequence, cache, drafter, draft_cache, block: VerifyBlock | None, capture) -> RoundStats:
        start = int(cache.lengths[0])
        bonus = seq.output[-1]

        # 1. Draft: one drafter pass proposes distributions for the next B-1 positions.
        t0 = time.perf_counter()
        logprobs = None
        if drafter is not None:
            logprobs = drafter.draft(
                draft_cache, seq.features, torch.tensor([bonus]), torch.tensor([start])
            )[0]
            seq.features = None
        t1 = time.perf_counter()

        # 2. Build the tree (root only for plain decoding).
        tree = self._tree(bonus, logprobs, seq.budget)
        t2 = time.perf_counter()

        # 3. Verify: one target pass over the whole tree, padded to the static length.
        vb = block.fill(tree, start) if block is not None else verify_block(tree, start)
        out = self.target(
            vb.tokens[None], vb.positions[None], vb.mask[None], cache, capture_layers=capture
        )
        t3 = time.perf_counter()

        # 4. Walk: the target chooses a token at every node (argmax, or the seeded draw for the
        #    position after the node); follow the path it agrees with, then its bonus token.
        after = (start + tree.depths + 1).tolist()
        choices = choose_tokens(out.logits[0, : vb.num_nodes], seq.request.sampling, seq.seed, after)
        walk = greedy_walk(tree, choices)

        # 5. Commit: keep the path's KV rows, hand its features to the drafter, emit tokens.
        compact_kv(cache.k, cache.v, 0, start, walk.path)
        cache.lengths += len(walk.path)
        if out.features is not None:
            seq.features = out.features[:, walk.path]
        seq.output.extend(tree.tokens[walk.path[1:]].tolist())
        seq.output.append(walk.bonus)
        self._check_stop(seq)
        t4 = time.perf_counter()
        per_depth = tuple(torch.bincount(tree.depths)[1:].tolist())
        return RoundStats(tree.size, len(walk.path) - 1, t1 - t0, t2 - t1, t3 - t2, t4 - t3, per_depth)

    @staticmethod
    def _tree(bonus: int, logprobs: torch.Tensor | None, budget: Budget) -> Tree:
        if logprobs is None:
            return Tree.root_only(bonus)
        if budget == "chain":
            return chain_tree(bonus, logprobs)
        return build_tree(bonus, logprobs, budget)

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
