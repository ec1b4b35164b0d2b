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
from ..kernels.sampling import is_greedy
from ..kernels.tree import Tree, grow_tree
from .model import TargetModel
from .sessions import LocalDrafter, LocalTarget, Proposal

Budget = int | Literal["chain"]


def check_budget(budget: Budget, has_drafter: bool) -> Budget:
    """Returns `budget` if an engine with (or without) a drafter can run it, else ValueError."""
    if budget != "chain" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"budget must be a non-negative integer or 'chain', got {budget!r}")
    if budget != 0 and not has_drafter:
        raise ValueError(f"budget {budget!r} needs a drafter; use budget 0 for plain decoding")
    return budget


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
    transport_s: float = 0.0  # time in calls beyond the models' own work (Ray, serialization)
    budget: Budget | None = None  # the budget this round was granted (a batch may grant less than asked)


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
    """Per-request state of the loop. Invariant between rounds: the target session holds every
    committed token except the pending bonus, which sits at position `target.start`."""

    request: Request
    budget: Budget
    seed: int | None
    output: list[int]  # emitted completion tokens, the pending bonus last
    features: torch.Tensor | None  # [1, n, F] target features not yet handed to the drafter
    finish_reason: str | None = None
    text: str | None = None


class Coordinator:
    """Drives a target and an optional drafter over a batch of requests.

    The per-request state lives in `_Sequence` objects and in one session per model (its
    caches); the sequences of a batch run one after another. `target` and `drafter` are models
    in this process (wrapped in LocalTarget / LocalDrafter here) or any backend with the same
    `open` -- the distributed engine passes Ray-actor backends and runs this same loop.
    """

    def __init__(
        self,
        target,  # TargetModel, or a backend: open(slots, capture, q_len, static_shapes) -> session
        drafter=None,  # Proposer, or a backend: block_size, target_layer_ids, open(slots) -> session
        budget: Budget = 0,
        static_shapes: bool = True,
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.target = LocalTarget(target) if isinstance(target, TargetModel) else target
        self.drafter = drafter if drafter is None or hasattr(drafter, "open") else LocalDrafter(drafter)
        self.static_shapes = static_shapes
        self.decode = decode
        self.budget = self.check_budget(budget)

    def check_budget(self, budget: Budget) -> Budget:
        """Returns `budget` if this Coordinator can run it, else raises ValueError."""
        return check_budget(budget, has_drafter=self.drafter is not None)

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
        drafting = budget != 0
        capture = self.drafter.target_layer_ids if drafting else ()
        q_len = self.verify_len(budget)
        slots = len(request.prompt) + request.max_tokens + q_len + 1
        target = self.target.open(slots, capture, q_len, self.static_shapes)
        draft = self.drafter.open(slots) if drafting else None

        try:
            yield from self._run(request, budget, target, draft)
        finally:  # the sessions' caches go, however the request ended
            target.close()
            if draft is not None:
                draft.close()

    def _run(self, request: Request, budget: Budget, target, draft) -> Iterator[Update]:
        seed = None
        if not is_greedy(request.sampling):
            seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        t0 = time.perf_counter()
        step = target.prefill(request.prompt, request.sampling, seed)
        seq = _Sequence(request, budget, seed, output=step.tokens, features=step.features)
        prefill_s = time.perf_counter() - t0
        rounds: list[RoundStats] = []
        self._check_stop(seq)
        sent = 0
        while seq.finish_reason is None:
            yield Update(seq.output[sent:], rounds[-1] if rounds else None)
            sent = len(seq.output)
            rounds.append(self._round(seq, target, draft))
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

    def _round(self, seq: _Sequence, target, draft) -> RoundStats:
        start = target.start
        bonus = seq.output[-1]

        # 1. Draft: one drafter pass proposes the top-K tokens for each of the next B-1 positions.
        t0 = time.perf_counter()
        proposal = None
        if draft is not None:
            top_k = 1 if seq.budget == "chain" else seq.budget
            proposal = draft.propose(seq.features, bonus, start, top_k)
            seq.features = None
        t1 = time.perf_counter()

        # 2. Build the tree (root only for plain decoding).
        tree = self._tree(bonus, proposal, seq.budget)
        t2 = time.perf_counter()

        # 3-4. Verify and walk, on the target's side: one pass over the whole tree, the target's
        #      choice at every node, the path it agrees with; its KV rows are compacted there.
        step = target.verify(tree, seq.request.sampling, seq.seed)
        t3 = time.perf_counter()

        # 5. Commit: hand the path's features to the drafter, emit tokens, check stops.
        seq.features = step.features
        seq.output.extend(step.tokens)
        self._check_stop(seq)
        t4 = time.perf_counter()
        draft_s = proposal.draft_s if proposal else 0.0
        transport_s = (t1 - t0 - draft_s) + (t3 - t2 - step.forward_s - step.walk_s)
        per_depth = tuple(torch.bincount(tree.depths)[1:].tolist())
        return RoundStats(
            tree.size,
            len(step.path) - 1,
            draft_s,
            t2 - t1,
            step.forward_s,
            step.walk_s + (t4 - t3),
            per_depth,
            transport_s,
        )

    @staticmethod
    def _tree(bonus: int, proposal: Proposal | None, budget: Budget) -> Tree:
        if proposal is None:
            return Tree.root_only(bonus)
        depths = len(proposal.candidates.tokens)
        return grow_tree(bonus, proposal.candidates, depths if budget == "chain" else budget)

    def _check_stop(self, seq: _Sequence) -> None:
        seq.finish_reason, seq.text = check_stop(seq.request, seq.output, self.decode)


def check_stop(request: Request, out: list[int], decode: Callable[[list[int]], str] | None) -> tuple[str | None, str | None]:
    """Cuts `out` (in place) at the first EOS, stop string or max_tokens; returns
    (finish_reason or None, the decoded text cut before a stop string, or None without `decode`)."""
    finish_reason, text = None, None
    eos = set(request.eos_token_ids)
    for i, token in enumerate(out[: request.max_tokens]):
        if token in eos:
            del out[i + 1 :]
            finish_reason = "stop"
            break
    if finish_reason is None and len(out) >= request.max_tokens:
        del out[request.max_tokens :]
        finish_reason = "length"
    if decode is None:
        return finish_reason, text
    text = decode(out)
    hits = [(text.find(s), s) for s in request.stop if s and s in text]
    if hits:
        cut = min(hits)[0]
        # keep the fewest tokens whose text reaches the stop string's end
        end = cut + len(min(hits)[1])
        keep = next(n for n in range(1, len(out) + 1) if len(decode(out[:n])) >= end)
        del out[keep:]
        return "stop", text[:cut]
    return finish_reason, text
