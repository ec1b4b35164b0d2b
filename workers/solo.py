"""The solo loop: one request at a time, its own caches, draft -> build tree -> verify -> walk ->
commit until a stop. The engine serves through the batched step loop (workers.scheduler); this
is the loop that loop is checked against (tests: every request of a batch equals its solo run)
and the one whose verify pass the CUDA-graph check captures (benchmarks/gpu_check.py).

Budget 0 is plain autoregressive decoding, "chain" is vanilla DFlash (top-1 per depth), an
integer budget is DDTree; all three are this one loop with different trees, and all emit the
target's own tokens (greedy, or the seeded draws of kernels.sampling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..kernels.sampling import draw_seed
from ..kernels.tree import Tree, grow_tree
from .requests import (Budget, Request, Result, RoundStats, Update, check_budget, check_request, check_stop, kept_per_depth,
                       tree_rows)
from .sessions import DraftBackend, LocalDrafter, LocalTarget, Proposal, TargetBackend


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


class SoloLoop:
    """Drives a target backend and an optional drafter backend (workers.sessions) over requests,
    one after another; the per-request state lives in `_Sequence` objects and in one session
    per model (its caches). `SoloLoop.local` runs models in this process."""

    def __init__(
        self,
        target: TargetBackend,
        drafter: DraftBackend | None = None,
        budget: Budget = 0,
        static_shapes: bool = True,
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.target, self.drafter = target, drafter
        self.static_shapes = static_shapes
        self.decode = decode
        self.budget = self.check_budget(budget)

    def check_budget(self, budget: Budget) -> Budget:
        """Returns `budget` if this loop can run it, else raises ValueError. "auto" is the batch
        scheduler's policy (workers.policy); this loop runs fixed budgets."""
        budget = check_budget(budget, has_drafter=self.drafter is not None)
        if budget == "auto":
            raise ValueError("budget 'auto' runs in the batch scheduler (workers.scheduler); give a fixed budget")
        return budget

    @classmethod
    def local(cls, model, drafter=None, budget: Budget = 0, static_shapes: bool = True,
              decode: Callable[[list[int]], str] | None = None) -> "SoloLoop":
        """Over a TargetModel and an optional Proposer (workers.drafter) in this process."""
        return cls(LocalTarget(model), LocalDrafter(drafter) if drafter is not None else None, budget, static_shapes, decode)

    def verify_len(self, budget: Budget) -> int:
        """Q: the fixed verify length of the static-shape path (the tree's rows)."""
        return tree_rows(budget, self.drafter.block_size if self.drafter is not None else 1)

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
        check_request(request)
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
        seed = draw_seed(request.sampling)
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
            top_k = kept_per_depth(seq.budget, seq.budget if seq.budget != "chain" else 1, seq.request.topk)
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
