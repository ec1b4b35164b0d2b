"""Continuous batching: one step loop over every running request, one target forward per step.

Each `step()`:
  1. takes what arrived or was cancelled since the last step; cancelled sequences leave now;
  2. admits waiting requests while `max_num_seqs` and the KV pool allow;
  3. prefills: chunks of at most `max_prefill_tokens`, cut at fixed multiples of it from the
     start of each prompt (so a sequence's chunks do not depend on what else runs), as many as
     fit in `max_prefill_tokens` tokens this step -- a long prompt never holds up the others'
     decoding by more than one chunk;
  4. drafts: one drafter pass per drafting sequence, and one tree per sequence at the budget it
     is granted (a fixed budget: see `grant`; "auto": workers.policy, which also picks the Q);
     with lookup on, each tree also holds the sequence's lookup branch (workers.lookup), which
     costs no drafter work -- an auto sequence that does not draft this step may verify it alone;
  5. verifies: ONE target forward over every decoding sequence's tree, each padded to the step's
     common row count Q (a bucket, so shapes repeat); padding rows sit at their row's start
     position, see only themselves and are never read -- on the CPU they are not computed
     (workers.model.Packing), and the policy grants each auto tree its own nodes;
  6. walks and commits: each row's choice by its own rule (greedy, or the seeded draw), the
     walks of all rows, the moves of every accepted path's KV rows in the pool at once;
  7. emits each sequence's new tokens; finished sequences give back their pages.

A request's tokens do not depend on the batch it ran in: the tree only decides how many tokens
a round commits, never which (docs/design.md, "Lossless"); prefill chunks are per sequence.

The models sit behind workers.batch_backends: a BatchTarget (the model and its KV storage in
this process, or tensor-parallel shard actors) and a BatchDrafter (in this process, or an
actor); the step loop, the page allocator and every decision stay here.

KV memory is a pool of pages (workers.kv_pool). A sequence that cannot grow its pages for a
verify pass preempts the latest-admitted other sequence: that one's pages are freed and it
waits, first in line, to be prefilled again over its prompt and the tokens it already emitted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels.batched import tree_metadata, walk_batch
from ..kernels.sampling import draw_seed
from ..kernels.tree import Candidates, Lookup, Tree, grow_tree
from ..kernels.tree_batch import TreeBatch, WalkBatch, unpack_bits
from ..kernels.triton_support import use_triton
from .batch_backends import BatchDrafter, BatchTarget, DraftRows, LocalBatchDrafter, LocalBatchTarget, TargetBatch
from .requests import (Budget, Request, Result, RoundStats, Update, accepted_sources, check_budget, check_request, check_stop,
                       kept_per_depth, tree_rows)
from .kv_pool import PageAllocator, PoolFull, block_table
from .graphs import GraphSettings
from .lookup import BATCH_DECAY as LOOKUP_BATCH_DECAY, LookupCalibration, SequenceLookup
from .model import TreeBits
from .calibration import measure_step_cost
from .policy import BudgetPolicy, CostCurve, PlanRow, RowReport, StepReport

# Verify row counts Q a step may use: a budget-2^k tree (2^k + 1 rows) fills its bucket exactly.
VERIFY_BUCKETS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 1025, 2049)
# a sequence's pending target features: the recent steps' are joined into one tensor when this many
FEATURE_CHUNKS = 32
# T(r) measured again mid-run (the live steps contradict it: BudgetPolicy.misfit) times the row
# counts up to twice the step's rows, at least this many
RECALIBRATION_ROWS = 129

logger = logging.getLogger("ddtree")


def bucket(rows: int) -> int:
    """The smallest verify bucket holding `rows` rows."""
    for q in VERIFY_BUCKETS:
        if q >= rows:
            return q
    return rows


# T(r) is measured at every row count up to this one: a packed step's rows (B + its nodes) fall
# anywhere, and the GEMMs' register tiles put steps in T(r) that the buckets do not see
DENSE_ROWS = 16


def row_counts(max_rows: int) -> list[int]:
    """Where T(r) is measured for the budget policy: every count up to DENSE_ROWS, the verify
    buckets above it below `max_rows`, and `max_rows` (B sequences x Q rows fall between them).
    Measured at the buckets alone, on a 2-core AVX2 EPYC, T(5) 74 ms and T(9) 90 put T(8) at
    86 by the line between them where it took 76 (T(9) is the step past an 8-row tile): a lone
    sequence's 7-node tree was priced as dear as a 4-node one plus half again."""
    dense = range(1, min(DENSE_ROWS, max_rows - 1) + 1)
    return list(dense) + [q for q in VERIFY_BUCKETS if DENSE_ROWS < q < max_rows] + [max_rows]


class QueueFull(RuntimeError):
    """The scheduler holds `max_num_seqs` running and `max_waiting` waiting requests already."""


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int = 16  # sequences running at once
    max_waiting: int = 256  # requests waiting to be admitted; more -> QueueFull
    max_prefill_tokens: int = 256  # prompt tokens prefilled per step (and per chunk)
    max_step_tokens: int = 1024  # verify rows per step: sequences x Q
    kv_cache_tokens: int = 32768  # the KV pool's size in tokens
    kv_page_tokens: int = 16  # tokens per page of the pool


def grant(asked: list[int], limits: BatchLimits) -> tuple[list[int], int]:
    """The rule that fits a step's trees into `max_step_tokens` rows: every tree is cut to the
    largest bucket Q with (sequences x Q) <= max_step_tokens. asked: drafted nodes each sequence
    asks for (its budget; a chain asks for block - 1) -> (granted nodes, the bucket cap).

    Example: asked [64, 8, 0], max_step_tokens 64 -> the cap is Q = 17 (3 x 17 = 51 rows; 3 x 33
    would be 99), so the grants are [16, 8, 0].
    """
    n = max(len(asked), 1)
    cap = max([q for q in VERIFY_BUCKETS if n * q <= limits.max_step_tokens], default=1)
    return [min(a, cap - 1) for a in asked], cap


class PendingFeatures:
    """A sequence's target features not yet given to the drafter, [1, rows, F] in order, as a
    few tensors: a step's rows are a view of that step's gathered features (no copy a step: on a
    GPU a copy per sequence would be a kernel launch each), and every FEATURE_CHUNKS of those are
    joined into one, so a sequence left idle holds a tensor per FEATURE_CHUNKS steps and each row
    is copied once before its draft joins them all (`joined`).

    Joined whole every 32 steps before, an idle auto sequence's whole context was copied again at
    every join (`torch.cat` ~40 ms of a 20 s pass at 64 streams)."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []  # [1, n, F] each: the joined ones first, then the recent steps'
        self.joined_chunks = 0  # how many of `chunks` are joined ones
        self.rows = 0  # what the next draft takes in (the plan asks every step)

    def add(self, features: torch.Tensor) -> None:
        """Appends [1, n, F] rows."""
        self.chunks.append(features)
        self.rows += features.shape[1]
        if len(self.chunks) - self.joined_chunks >= FEATURE_CHUNKS:  # the recent steps' as one
            self.chunks[self.joined_chunks :] = [torch.cat(self.chunks[self.joined_chunks :], dim=1)]
            self.joined_chunks += 1

    def joined(self) -> torch.Tensor:
        """[1, rows, F], a tensor of its own."""
        return torch.cat(self.chunks, dim=1)

    def clear(self) -> None:
        """The drafter took them in."""
        self.chunks, self.joined_chunks, self.rows = [], 0, 0


@dataclass(eq=False)  # one sequence is itself alone: `in` and `remove` compare identity, not every field
class _Sequence:
    """One request's state. Invariant between steps once prefilled: the pool holds positions
    [0, length) -- every committed token but the pending bonus output[-1], which sits at
    position `length`."""

    id: int
    request: Request
    budget: Budget
    seed: int | None
    arrived: float
    context: list[int]  # tokens to prefill: the prompt, or prompt + output[:-1] after a preemption
    topk: int | None = None  # the most children a node of its trees may have (None: its budget's nodes)
    output: list[int] = field(default_factory=list)  # emitted completion tokens (pending bonus last)
    pages: list[int] = field(default_factory=list)  # block table in the KV pool
    length: int = 0  # positions of `context` in the pool (== len(context) once prefilled)
    features: PendingFeatures = field(default_factory=PendingFeatures)  # not yet given to the drafter
    drafting: bool = False  # the drafter holds a context cache for this sequence (set once prefilled)
    rounds: list[RoundStats] = field(default_factory=list)
    lookup: SequenceLookup | None = None  # lookup branches on: its context's n-grams and their calibration
    sent: int = 0  # output tokens already emitted
    prefill_s: float = 0.0
    decode_started: float = 0.0
    finish_reason: str | None = None
    text: str | None = None

    @property
    def prefilled(self) -> bool:
        return self.length >= len(self.context)


@dataclass(eq=False)
class _Row:
    """A decoding sequence's part of one step, from its plan to its commit."""

    seq: _Sequence
    nodes: int = 0  # drafted nodes: asked (a fixed budget's, cut by `grant`), drafted, then granted
    auto: bool = False  # budget "auto" and drafting: the policy plans whether it drafts and sizes its tree
    drafts: bool = False  # in this step's drafter pass
    depth: int = 0  # an auto draft's depths (the policy's; a fixed budget drafts `nodes` depths)
    explores: bool = False  # an auto sequence's first draft: its acceptance is unknown
    pending: int = 0  # target feature rows its draft would take in
    proposal: Candidates | None = None  # the drafter's candidates, where it drafted
    branch: Lookup | None = None  # its lookup branch, where it has one
    tree: Tree | None = None  # what it verifies (the root alone where it has nothing to verify)
    curve: list[float] | None = None  # an auto tree's expected accepted tokens by nodes (policy.curve)
    predicted: float = 0.0  # an auto tree's expected accepted tokens at its granted nodes
    draft_s: float = 0.0  # its share of the drafter's pass


@dataclass
class StepPlan:
    """What a decode step verifies."""

    rows: list[_Row]  # [B] the sequences verified, each with its tree
    q_len: int  # verify rows per sequence, trees padded to it (a VERIFY_BUCKETS entry)
    drafted: int  # sequences in the drafter's pass
    context: int  # target feature rows the drafter's pass took in
    draft_s: float  # the drafter's pass and growing its trees: what the policy prices a draft at
    tree_s: float  # from the drafter's pass to the trees chosen


@dataclass
class VerifyRecord:
    """One row of a verify pass, as the target saw it (Scheduler.on_verify)."""

    seq_id: int
    request: Request  # the request the row serves
    emitted: int  # completion tokens the sequence had before this round (its root is the last)
    tree: Tree  # the real nodes: tokens, parents, depths, scores, sources
    q_len: int  # rows the pass held for it: tree.size real, the rest padding
    positions: list[int]  # [Q] each row's position (padding: the root's)
    mask: list[list[bool]]  # [Q, Q] row i sees block row j
    path: list[int]  # the accepted nodes, root first
    bonus: int  # the target's token after the path


@dataclass
class StepOutcome:
    """What the verify pass accepted."""

    paths: torch.Tensor  # [B, Q] int64: each row's accepted node indices, root first (then padding)
    lengths: list[int]  # [B] accepted nodes per row, its root included
    bonus: list[int]  # [B] the target's token after each accepted path
    features: list[torch.Tensor] | None  # [B] of [n_b, F]: the accepted nodes' target features
    verify_s: float  # the target's forward
    walk_s: float  # the walks and the KV moves


class Scheduler:
    """Owns the running batch of one target (+ optional drafter), behind the backends of
    workers.batch_backends: models in this process (`Scheduler.local`), or Ray actors.

    `add` and `cancel` may be called from any thread; `step` runs on one thread at a time.
    """

    def __init__(
        self,
        target: BatchTarget,
        drafter: BatchDrafter | None = None,  # None: plain decoding only
        budget: Budget = 0,
        limits: BatchLimits = BatchLimits(),
        decode: Callable[[list[int]], str] | None = None,
        policy: BudgetPolicy | None = None,  # budget "auto" (workers.policy); a fresh one by default
        lookup: bool = False,  # lookup branches in every tree unless a request says otherwise
        topk: int | None = None,  # the most children a tree node may have unless a request says otherwise
        record_features: tuple[int, ...] = (),  # target layers every sequence keeps (Result.features); budget 0 only
        clock: Callable[[], float] = time.perf_counter,  # seconds: what every phase is timed by (ddtree.simulate: a virtual one)
    ):
        if limits.max_num_seqs > limits.max_step_tokens:
            raise ValueError(
                f"max_num_seqs ({limits.max_num_seqs}) exceeds max_step_tokens ({limits.max_step_tokens}): "
                "a step could not give every sequence one verify row"
            )
        self.target, self.drafter = target, drafter
        self.limits, self.decode, self.clock = limits, decode, clock
        self.budget = check_budget(budget, drafter is not None)
        self.policy = policy or BudgetPolicy()
        self.policy.packed = getattr(target, "packs_rows", False)  # its cost model follows the target's rows
        self.lookup, self.topk = lookup, topk
        self.record_features = tuple(record_features)
        self.lookup_calibration = LookupCalibration(LOOKUP_BATCH_DECAY)  # engine-wide, every sequence's prior
        self.pool = PageAllocator(limits.kv_cache_tokens, limits.kv_page_tokens)  # the storage: the target's
        self.target.allocate(self.pool.num_pages, self.pool.page)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._arrivals: deque[_Sequence] = deque()
        self._cancels: deque[int] = deque()
        self._next_id = 0
        self.preemptions = 0  # sequences preempted so far (their pages freed, recomputed later)
        self.cancelled = 0  # sequences that left because their request was cancelled
        # called with each verify pass's rows, when set (ddtree audit's --dump): a VerifyRecord per row
        self.on_verify: Callable[[list[VerifyRecord]], None] | None = None

    @classmethod
    def local(cls, model, drafter=None, budget: Budget = 0, limits: BatchLimits = BatchLimits(),
              decode: Callable[[list[int]], str] | None = None, policy: BudgetPolicy | None = None,
              lookup: bool = False, topk: int | None = None, record_features: tuple[int, ...] = (),
              graphs: GraphSettings | None = None) -> "Scheduler":
        """Over a TargetModel and an optional Proposer (workers.drafter) in this process; with
        `graphs`, the target's padded verify forwards captured (workers.graphs) and every verify
        step padded, not packed (the forward the graphs hold)."""
        target = LocalBatchTarget(model, packs_rows=False if graphs is not None else None, graphs=graphs)
        return cls(target, LocalBatchDrafter(drafter) if drafter is not None else None,
                   budget, limits, decode, policy, lookup, topk, record_features)

    # --- the requests' side ---------------------------------------------------------------------

    def check_budget(self, budget: Budget) -> Budget:
        return check_budget(budget, has_drafter=self.drafter is not None)

    def add(self, request: Request) -> int:
        """Queues a request; returns its id. ValueError for a request that can never run,
        QueueFull when `max_waiting` requests wait already."""
        check_request(request)
        budget = self.check_budget(self.budget if request.budget is None else request.budget)
        if self.record_features and budget != 0:
            raise ValueError("a scheduler that records features runs plain decoding (budget 0) only")
        largest = self.pool.pages_for(len(request.prompt) + 1 + self._nodes(budget) + 1)
        if largest > self.pool.num_pages:
            raise ValueError(
                f"the prompt ({len(request.prompt)} tokens) does not fit this replica's KV pool "
                f"({self.pool.tokens} tokens)"
            )
        # arrivals not yet admitted count against the running places first, then the queue
        held = len(self.running) + len(self.waiting) + len(self._arrivals)
        if held >= self.limits.max_num_seqs + self.limits.max_waiting:
            raise QueueFull(f"{self.limits.max_num_seqs} requests run and {self.limits.max_waiting} wait already")
        seq = _Sequence(self._next_id, request, budget, draw_seed(request.sampling), self.clock(), list(request.prompt),
                        topk=self.topk if request.topk is None else request.topk)
        if budget not in (0, "chain") and (self.lookup if request.lookup is None else request.lookup):
            seq.lookup = SequenceLookup(list(request.prompt), self.lookup_calibration)
        self._next_id += 1
        self._arrivals.append(seq)
        return seq.id

    def cancel(self, seq_id: int) -> None:
        """The sequence leaves at the start of the next step and frees its memory."""
        self._cancels.append(seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._arrivals or self._cancels)

    def generate(self, requests: list[Request]) -> list[Result]:
        """Runs `requests` as one batch to the end; results in request order."""
        ids = [self.add(r) for r in requests]
        results: dict[int, Result] = {}
        while len(results) < len(ids):
            for seq_id, update in self.step():
                if update.result is not None:
                    results[seq_id] = update.result
        return [results[i] for i in ids]

    # --- the step ---------------------------------------------------------------------------------

    def step(self) -> list[tuple[int, Update]]:
        """One step of the whole batch; returns (sequence id, update) for every sequence that
        emitted tokens or finished."""
        # 1. arrivals and cancellations
        while self._arrivals:
            self.waiting.append(self._arrivals.popleft())
        while self._cancels:
            self._drop(self._cancels.popleft())
        # 2. admission
        self._admit()
        # 3. prefill chunks; 4-6. draft, verify, walk, commit
        touched = self._prefill() + self._decode()
        touched += [s for s in self.running if s.finish_reason is not None]  # e.g. out of memory
        emitted, seen = [], set()
        for seq in touched:
            if seq.id not in seen:
                seen.add(seq.id)
                emitted.append((seq.id, self._emit(seq)))
        # 7. retire
        for seq in [s for s in self.running if s.finish_reason is not None]:
            self._retire(seq)
        return emitted

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            # the whole context now, plus one page for the first rounds: prefill never stalls half-way
            if self.pool.pages_for(len(seq.context)) + 1 > self.pool.free_pages and self.running:
                return
            self.waiting.popleft()
            self.running.append(seq)

    def _prefill(self) -> list[_Sequence]:
        """Prefill chunks, up to max_prefill_tokens tokens this step (at least one chunk),
        fewest remaining prompt tokens first: a short prompt that arrives behind a long one is
        prefilled at the next step, not after all of the long one's chunks."""
        done, used = [], 0
        chunk = self.limits.max_prefill_tokens
        waiting = [s for s in self.running if not s.prefilled]
        for seq in sorted(waiting, key=lambda s: (len(s.context) - s.length, s.arrived)):
            while not seq.prefilled:
                end = min(len(seq.context), (seq.length // chunk + 1) * chunk)
                if used and used + end - seq.length > chunk:
                    return done
                used += end - seq.length
                if self._prefill_chunk(seq, end):
                    done.append(seq)
        return done

    def _prefill_chunk(self, seq: _Sequence, end: int) -> bool:
        """Prefills context[length:end]; True when that completed the prefill."""
        t0 = self.clock()
        try:
            self._make_room(seq, end)
        except PoolFull:
            return True  # it ended ("length"): not even the whole pool holds its context
        n = end - seq.length
        capture = self._capture(seq)
        out = self.target.forward(TargetBatch(
            tokens=torch.tensor([seq.context[seq.length : end]]),
            positions=seq.length + torch.arange(n)[None],
            mask=torch.ones(n, n, dtype=torch.bool).tril()[None],
            tables=[seq.pages], lengths=[seq.length], capture=capture, logits_to_keep=1,
            sampling=[seq.request.sampling], seeds=[seq.seed], draw_positions=torch.tensor([[end]]),
        ))
        seq.length = end
        if out.features is not None:
            seq.features.add(out.features)
        if not seq.prefilled:
            seq.prefill_s += self.clock() - t0
            return False
        if not seq.output:  # a fresh sequence: its first token; a recomputed one has its bonus
            seq.output.append(int(out.choices[0, 0]))
            seq.finish_reason, seq.text = check_stop(seq.request, seq.output, self.decode)
        if capture and seq.budget != 0 and not seq.drafting:
            slots = len(seq.request.prompt) + seq.request.max_tokens + self.drafter.block_size + 1
            self.drafter.open(seq.id, slots)
            seq.drafting = True
        seq.prefill_s += self.clock() - t0
        seq.decode_started = self.clock()
        return True

    def _capture(self, seq: _Sequence) -> tuple[int, ...]:
        if self.record_features:
            return self.record_features
        return tuple(self.drafter.target_layer_ids) if seq.budget != 0 else ()

    def _nodes(self, budget: Budget) -> int:
        """Drafted nodes a budget asks for (a chain: one per drafted depth; auto: the most the
        policy may grant)."""
        if budget == "auto":
            return self.policy.cap if self.drafter is not None else 0
        return tree_rows(budget, self.drafter.block_size if self.drafter is not None else 1) - 1

    def _decode(self) -> list[_Sequence]:
        """4-7 of `step` for every prefilled sequence: plan (who drafts, the drafter's pass, each
        tree, Q, pages), execute (one verify pass, the walks, the KV moves), commit, observe."""
        rows = [_Row(s) for s in self.running if s.prefilled and s.finish_reason is None]
        if not rows:
            return []
        started = self.clock()
        plan = self._plan(rows)
        rows = self._reserve(plan)
        if not rows:
            return []
        outcome = self._execute(plan)
        reports = [self._commit(row, plan, outcome, path[:n], bonus, features)
                   for row, path, n, bonus, features in zip(rows, outcome.paths, outcome.lengths, outcome.bonus,
                                                            outcome.features or [None] * len(rows))]
        self._observe(plan, outcome, self.clock() - started, [r for r in reports if r is not None])
        return [r.seq for r in rows]

    def _observe(self, plan: StepPlan, outcome: StepOutcome, step_s: float, rows: list[RowReport]) -> None:
        """The policy learns from the step's outcome: its costs, and what each auto sequence
        committed; T(r) is measured again where the live steps contradict it."""
        nodes = sum(r.tree.size - 1 for r in plan.rows)
        self.policy.observe(StepReport(len(plan.rows), plan.q_len, nodes, outcome.verify_s, plan.drafted,
                                       plan.context, plan.draft_s, step_s - outcome.verify_s - plan.draft_s, rows))
        if self.policy.misfit() and any(r.seq.budget == "auto" for r in plan.rows):
            self._recalibrate(len(plan.rows) + nodes)

    @property
    def _joining(self) -> int:
        """Sequences admitted but still prefilling: they join the decoding batch within a few steps."""
        return sum(not s.prefilled for s in self.running)

    def _plan(self, rows: list[_Row]) -> StepPlan:
        """4. Who drafts, the drafter's one pass over them, and each row's tree. Fixed budgets ask
        for their nodes (cut to the step's row limit, `grant`); the policy plans which auto
        sequences draft and how wide, then chooses each auto tree's nodes from what they drafted."""
        t0 = self.clock()
        asked = [0 if r.seq.budget == "auto" else self._nodes(r.seq.budget) for r in rows]
        granted, q_max = grant(asked, self.limits)
        for r, nodes in zip(rows, granted):
            r.nodes, r.auto = nodes, r.seq.budget == "auto" and r.seq.drafting
            r.pending = r.seq.features.rows  # what its draft would take in
        fixed = [r for r in rows if r.nodes and r.seq.drafting]
        for r in fixed:
            r.drafts = True
        q_floor = bucket(1 + max(granted))
        buckets = [q for q in VERIFY_BUCKETS if q_floor <= q <= q_max and q - 1 <= self.policy.cap] or [q_floor]
        most = buckets[-1] - 1
        auto = [r for r in rows if r.auto]
        fixed_asked = sum(r.nodes for r in fixed)  # the fixed budgets' nodes, before their trees grow
        plan_rows = [PlanRow(r.seq.id, r.pending, r.seq.request.max_tokens - len(r.seq.output)) for r in auto]
        drafts = self.policy.plan(len(rows), buckets, plan_rows, len(fixed), fixed_asked, self._joining)
        for r, d in zip(auto, drafts):
            if d is not None:  # each drafted tree grown as wide as the policy may grant it
                r.drafts, r.nodes, r.depth, r.explores = True, d.width, d.depth, d.explores
        drafting = [r for r in rows if r.drafts]
        self._draft(drafting)
        t1 = self.clock()

        # where nothing drafts, a chain too improbable to pay alone is not built or priced
        self._lookup_branches(rows, 0.0 if drafting or not auto else self.policy.lookup_floor(len(rows)))
        # an auto sequence the plan left out verifies its lookup branch alone, if it has one
        auto_trees = [r for r in rows if (r.auto and r.drafts) or (r.branch is not None and r.seq.budget == "auto")]
        for r in auto_trees:
            if r.proposal is None:
                r.nodes = most
        t_grow = self.clock()
        for r in rows:  # a lookup chain alone is grown once the policy chose its nodes
            r.tree = (grow_tree(r.seq.output[-1], r.proposal, r.nodes, r.branch, r.seq.topk) if r.proposal is not None
                      else Tree.root_only(r.seq.output[-1]))
        # the policy prices a draft as the drafter's pass and growing its trees
        draft_s = (t1 - t0) + (self.clock() - t_grow if drafting else 0.0)
        for r in auto_trees:
            r.curve = (self.policy.curve(r.seq.id, r.tree, most) if r.proposal is not None
                       else self.policy.chain_curve(r.branch, most))
        if auto_trees:
            self._choose(rows, auto_trees, buckets, draft_s)
        for r in drafting:
            r.draft_s = (t1 - t0) / len(drafting)
        # Q holds every tree, and a fixed budget's whole grant even where its tree came out smaller
        # (a topk-limited or short one): a static-shape verify pads to its budget
        q_len = bucket(max(max(r.tree.size for r in rows), max((1 + r.nodes for r in rows if r.drafts and not r.auto),
                                                                default=1)))
        return StepPlan(rows, q_len, len(drafting), sum(r.pending for r in drafting),
                        draft_s, self.clock() - t1)

    def _draft(self, drafting: list[_Row]) -> None:
        """The drafter's one pass over the drafting rows: each takes in its pending target
        features and proposes candidates for its tree."""
        if not drafting:
            return
        proposals = self.drafter.propose(DraftRows(
            ids=[r.seq.id for r in drafting],
            features=[r.seq.features.joined() for r in drafting],
            bonus=[r.seq.output[-1] for r in drafting],
            start=[r.seq.length for r in drafting],
            top_k=[kept_per_depth(r.seq.budget, r.nodes, r.seq.topk) for r in drafting],
            depths=[r.depth if r.auto else r.nodes for r in drafting],
        ))
        for r, proposal in zip(drafting, proposals):
            r.seq.features.clear()
            r.proposal = proposal

    def _choose(self, rows: list[_Row], auto_trees: list[_Row], buckets: list[int], draft_s: float) -> None:
        """The policy's nodes for each auto tree: each keeps its best-first prefix of them (a
        lookup branch alone is grown to them)."""
        fixed_nodes = sum(r.tree.size - 1 for r in rows if r.curve is None)
        decision = self.policy.choose(len(rows), buckets, [r.curve for r in auto_trees], draft_s, fixed_nodes,
                                      [r.seq.id if r.proposal is not None else None for r in auto_trees],
                                      self._joining)
        for r, nodes, predicted in zip(auto_trees, decision.nodes, decision.predicted):
            r.nodes, r.predicted = nodes, predicted
            if r.proposal is not None:
                r.tree = r.tree.prefix(nodes)
            elif nodes:
                r.tree = grow_tree(r.seq.output[-1], None, nodes, r.branch)

    def _execute(self, plan: StepPlan) -> StepOutcome:
        """5-6. One target forward over every tree, padded to Q rows each; each row's choice (made
        by its own rule, on the target's side), the walks, and the moves of every accepted path's
        KV rows in the pool at once. Where the walk runs on the device, all of it stays there
        until the step reads its choices back, once: the paths, their lengths and the bonus
        tokens as one tensor (tests/test_gpu_step.py counts the reads)."""
        rows, dev = plan.rows, self.target.device
        t0 = self.clock()
        seqs, trees = [r.seq for r in rows], [r.tree for r in rows]
        batch = TreeBatch.of(trees, plan.q_len, dev)
        meta = tree_metadata(batch, torch.tensor([s.length for s in seqs], dtype=torch.int64, device=dev))
        capture = self.record_features or (
            tuple(self.drafter.target_layer_ids) if any(s.budget != 0 for s in seqs) else ())
        out = self.target.forward(TargetBatch(
            tokens=batch.tokens, positions=meta.positions, mask=TreeBits(meta.bits, batch.sizes),
            tables=[s.pages for s in seqs], lengths=[s.length for s in seqs], capture=capture, logits_to_keep=0,
            sampling=[s.request.sampling for s in seqs], seeds=[s.seed for s in seqs],
            draw_positions=meta.positions + 1,  # each node's choice is the token after it
            rows=[t.size for t in trees],
        ))
        t1 = self.clock()
        walk = walk_batch(batch, out.choices.to(dev))
        # the longest path a tree can accept: its deepest node and the root (the trees are the host's)
        width = 1 + max(int(t.depths.max()) for t in trees)
        if width > 1:  # where every path is its root alone (a plain step) no KV row moves
            self._move_paths([s.pages for s in seqs], meta.positions[:, :1], walk, width)
        # the step's one read of the device: every row's path, its length and its bonus at once
        chosen = torch.cat([walk.path, walk.length[:, None], walk.bonus[:, None]], dim=1).cpu()  # [B, Q + 2]
        paths, lengths, bonus = chosen[:, : plan.q_len], chosen[:, -2].tolist(), chosen[:, -1].tolist()
        features = None
        if out.features is not None:  # the accepted paths' target features in one gather, each row's a view of it
            on_paths = [(b, node) for b, row in enumerate(paths.tolist()) for node in row[: lengths[b]]]
            at = torch.tensor(on_paths, dtype=torch.int64).to(out.features.device)  # [sum(lengths), 2]
            features = list(out.features[at[:, 0], at[:, 1]].split(lengths))
        if self.on_verify is not None:
            mask, positions = unpack_bits(meta.bits.cpu(), plan.q_len), meta.positions.cpu()
            self.on_verify([VerifyRecord(s.id, s.request, len(s.output), t, plan.q_len, positions[b].tolist(), mask[b].tolist(),
                                         paths[b, :lengths[b]].tolist(), bonus[b])
                            for b, (s, t) in enumerate(zip(seqs, trees))])
        return StepOutcome(paths, lengths, bonus, features, t1 - t0, self.clock() - t1)

    def _move_paths(self, tables: list[list[int]], starts: torch.Tensor, walk: WalkBatch, width: int) -> None:
        """Every accepted path's KV rows to the positions after its committed prefix, in one
        move, from the walk where it ran (on a GPU: nothing read back). starts [B, 1] each row's
        committed length; `width`: at least the longest path. Row b's position starts[b] + i
        takes the row of starts[b] + path[b, i] for i < length[b]; past its path a position
        takes its own row (a move to itself), so the move's shape follows B and `width` alone.
        On the CPU the moves to themselves are dropped first (the walk is the host's there).

        Example (page 4, width 3): table [[2, 5]], starts [[3]], path [[0, 2, -1]], length [2]
        -> positions 3, 4, 5 take 3, 5, 5: slots [11, 21, 21] to [11, 20, 21]."""
        dev = walk.path.device
        table = block_table(tables, dev)
        offsets = torch.arange(width, device=dev)[None, :]
        on_path = offsets < walk.length[:, None]
        src = self.pool.slots_of(table, starts + torch.where(on_path, walk.path[:, :width], offsets)).view(-1)
        dst = self.pool.slots_of(table, starts + offsets).view(-1)
        if not use_triton(src):  # the host's walk: only the rows that move
            moved = src != dst
            src, dst = src[moved], dst[moved]
        self.target.move(src, dst)

    def _commit(self, row: _Row, plan: StepPlan, outcome: StepOutcome, path: torch.Tensor, bonus: int,
                features: torch.Tensor | None) -> RowReport | None:
        """7. One row's accepted tokens and bonus into its sequence; its round's statistics. Returns
        what an auto sequence committed, for the policy to learn from."""
        seq, tree, n = row.seq, row.tree, len(path)
        seq.length += n
        self.pool.shrink(seq.pages, seq.length + 1)
        if features is not None and (seq.budget != 0 or self.record_features):
            seq.features.add(features[None])
        before = len(seq.output)
        committed = tree.tokens[path[1:]].tolist() + [bonus]
        seq.output.extend(committed)
        seq.finish_reason, seq.text = check_stop(seq.request, seq.output, self.decode)
        if seq.lookup is not None:  # what the request emitted: the path past a stop is not
            seq.lookup.observe(tree, path[: 1 + min(n - 1, len(seq.output) - before)].tolist())
        per_depth = tuple(torch.bincount(tree.depths)[1:].tolist()) if tree.size > 1 else ()
        auto, budget = seq.budget == "auto", row.nodes
        if seq.budget == "chain" and row.nodes == self._nodes("chain"):
            budget = "chain"
        seq.rounds.append(RoundStats(tree.size, n - 1, row.draft_s, plan.tree_s, outcome.verify_s, outcome.walk_s,
                                     per_depth, budget=budget, predicted=row.predicted if auto else None,
                                     probe=row.explores, accepted_sources=accepted_sources(tree, path),
                                     verify_rows=plan.q_len))
        return RowReport(seq.id, committed, seq.finish_reason is not None) if auto else None

    def _recalibrate(self, step_rows: int) -> None:
        """The target's T(r) measured again between two steps, where the live steps contradict
        the policy's curve (BudgetPolicy.misfit), over the row counts up to twice this step's rows
        (at least RECALIBRATION_ROWS), each in a warm-up and 2 rounds: 5.5-6.4 s for SmolLM2 on a
        2-core AVX2 EPYC (in the start-up's 9 rounds for the counts up to 17 rows,
        `measure_step_cost`, a 14 s stall), where the start-up's counts up to 1024 rows take
        ~35-40 s. The measurement's pages come from the pool's free ones and go back; a pool with
        none left waits for the next step."""
        if not self.pool.free_pages:
            return
        most = min(self.limits.max_step_tokens, max(RECALIBRATION_ROWS, 2 * step_rows))
        before, misfits = dict(self.policy.verify.points), self.policy.misfits
        measured = CostCurve(measure_step_cost(self, row_counts(most), repeats=2, dense_repeats=2))  # a short stall
        taken = self.policy.recalibrate(measured)
        logger.warning("budget auto: the live steps contradicted the target's step cost %d steps in a row; measured "
                       "again: %s (was %s)%s", misfits, measured, CostCurve(before),
                       "" if taken else "; not taken: it cannot be the machine's (is another process running?)")

    def _lookup_branches(self, rows: list[_Row], floor: float = 0.0) -> None:
        """Each row's lookup branch (kernels.tree.Lookup), for the rows with lookup on and a match
        in their context; `floor`: the first-node probability an auto row's chain must beat
        (BudgetPolicy.lookup_floor), else it has none."""
        for r in rows:
            if r.seq.lookup is not None and r.seq.drafting:
                r.branch = r.seq.lookup.propose(r.seq.output, floor=floor if r.seq.budget == "auto" else 0.0)

    def _reserve(self, plan: StepPlan) -> list[_Row]:
        """Grows every row's pages to hold its verify block (positions length ... + Q - 1),
        preempting the latest-admitted sequences when the pool runs out; the plan keeps the rows
        still running."""
        for r in plan.rows:
            if r.seq not in self.running:  # preempted by an earlier row of this loop
                continue
            try:
                self._make_room(r.seq, r.seq.length + plan.q_len)
            except PoolFull:
                pass  # it ended ("length") and is emitted as finished
        running = set(self.running)
        plan.rows = [r for r in plan.rows if r.seq in running and r.seq.finish_reason is None]
        return plan.rows

    def _make_room(self, seq: _Sequence, positions: int) -> None:
        """Preempts the latest-admitted other sequences until `seq` can hold `positions`; a
        sequence that cannot fit even alone ends with finish_reason "length"."""
        while True:
            try:
                self.pool.grow(seq.pages, positions)
                return
            except PoolFull:
                victims = [s for s in self.running if s is not seq]
                if not victims:
                    seq.finish_reason = "length"
                    seq.text = self.decode(seq.output) if self.decode else None
                    raise PoolFull(f"sequence {seq.id} needs {positions} positions; the pool holds {self.pool.tokens}")
                self._preempt(victims[-1])

    def _preempt(self, seq: _Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self.pool.release(seq.pages)
        self._stop_drafting(seq)
        seq.length = 0
        seq.features.clear()
        seq.context = list(seq.request.prompt) + seq.output[:-1]
        self.waiting.appendleft(seq)

    def _emit(self, seq: _Sequence) -> Update:
        new = seq.output[seq.sent :]
        seq.sent = len(seq.output)
        result = None
        if seq.finish_reason is not None:
            now = self.clock()
            result = Result(seq.output, seq.text, seq.finish_reason, seq.seed, seq.prefill_s,
                            now - seq.decode_started if seq.decode_started else 0.0, seq.rounds)
            if self.record_features:  # every committed token's, in order (the last, pending, has none yet)
                result.features = seq.features.joined()[0]
        return Update(new, seq.rounds[-1] if seq.rounds else None, result)

    def _retire(self, seq: _Sequence) -> None:
        self.policy.drop(seq.id)
        self.running.remove(seq)
        self.pool.release(seq.pages)
        self._stop_drafting(seq)

    def _stop_drafting(self, seq: _Sequence) -> None:
        if seq.drafting:
            self.drafter.close(seq.id)
            seq.drafting = False

    def abort_all(self) -> None:
        """Drops every sequence (after a failed step): their pages go back to the pool."""
        for seq in [*self.running, *self.waiting]:
            self.policy.drop(seq.id)
        for seq in self.running:
            self.pool.release(seq.pages)
            self._stop_drafting(seq)
        self.running, self.waiting = [], deque()
        self._arrivals.clear()
        self._cancels.clear()

    def _drop(self, seq_id: int) -> None:
        for seq in list(self.running):
            if seq.id == seq_id:
                self._retire(seq)
                self.cancelled += 1
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self.policy.drop(seq.id)
                self.waiting.remove(seq)
                self.cancelled += 1

    def stats(self) -> dict:
        """The batch now: sequences running and waiting, KV pages free of all, and counts."""
        return {"running": len(self.running), "waiting": len(self.waiting) + len(self._arrivals),
                "free_pages": self.pool.free_pages, "pages": self.pool.num_pages,
                "preemptions": self.preemptions, "cancelled": self.cancelled,
                "recalibrations": self.policy.recalibrations}
