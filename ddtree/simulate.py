"""`ddtree simulate`: a trace (ddtree.trace) replayed through the real Scheduler under a cost
model and a budget policy, on a virtual clock: tokens/s per concurrency, the same every run.

The Scheduler runs unchanged -- admission, prefill chunks, the policy's plans and choices, tree
growth, the walks, commits, lookup branches (recomputed from the committed tokens by the real
workers.lookup.SequenceLookup) -- over two replay backends and a `VirtualClock` it is given as
its `clock`:

- `ReplayTarget` (a workers.batch_backends.BatchTarget): a verify pass returns, at each tree
  node, the target's choice as the trace's committed continuation says it (the committed next
  token where the node's path from the root is the committed continuation; no walk reaches any
  other node, whose choice is `OFF_PATH`); a prefill returns the committed first token. It
  holds no KV (a KV move is free) and returns zero-width features. It advances the clock by the
  cost model's T(rows) for every forward -- the rows the step computes: its trees' real rows
  where the cost model is `packed` (the CPU), B x Q otherwise -- and a verify pass also by the
  step's host work, O(B) + the trees' nodes x `node_s`, booked after the pass
  (`VirtualClock.after_read`).
- `ReplayDrafter` (a BatchDrafter): the trace's candidates at each sequence's bonus position,
  cut to the depths and top-k the scheduler asks for; it advances the clock by D(n) + c x the
  context rows the pass takes in.

So the policy's start-up calibration (workers.calibration.measure_step_cost, through the same
backend) measures the cost model's T(r) -- `replay_scheduler` hands the policy that curve
directly -- and every phase the scheduler times is the cost model's. The replay is lossless by construction: each result's tokens are checked against the
trace's (`ReplayMismatch` otherwise: the replay or the scheduler is wrong).

Closed-loop streams as ddtree.load_bench.run_inprocess: c streams each send a request, and a
finished stream sends the next (the trace's sequences in turn) before the next step.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .load_bench import Throughput
from .trace import Trace
from .workers.batch_backends import DraftRows, TargetBatch, TargetStep
from .workers.model import TreeBits
from .workers.calibration import measure_step_cost
from .workers.policy import CostCurve
from .workers.requests import Budget
from .workers.scheduler import BatchLimits, Scheduler, row_counts
from .kernels.sampling import draw_seed
from .kernels.tree import Candidates
from .kernels.tree_batch import unpack_bits

__all__ = ["CostModel", "ReplayDrafter", "ReplayMismatch", "ReplayTarget", "SimRow", "Trace", "VirtualClock",
           "markdown", "simulate"]

# the target's choice at a node no walk reaches (off the committed path, or past the trace's end,
# where the sequence has finished and check_stop cuts whatever follows): no token id equals it
OFF_PATH = -1


class ReplayMismatch(AssertionError):
    """The replayed tokens left the trace's: the replay or the scheduler is wrong."""


@dataclass
class CostModel:
    """What a machine's steps cost, in seconds. The file is JSON with these fields;
    `step_seconds` is the format of the calibration cache's entries (ddtree.calibrate), so a
    machine's own measured T(r) can be pasted in."""

    name: str
    step_seconds: dict[int, float]  # T(r): one target forward over r rows (between points linear, past the last proportional)
    draft_seconds: dict[int, float] = field(default_factory=dict)  # D(n): the drafter's pass over n sequences
    context_row_s: float = 0.0  # c: a drafter pass's seconds per context row it takes in
    overhead_s: float = 0.0  # O(B) = overhead_s + B x overhead_seq_s: a decode step's host work ...
    overhead_seq_s: float = 0.0
    node_s: float = 0.0  # ... and per drafted tree node (growing, walking, committing it)
    packed: bool = False  # a step computes its trees' real rows (the CPU), not B x Q (a GPU's static shapes)
    note: str = ""  # where the numbers come from

    def __post_init__(self):
        self._t, self._d = CostCurve(self.step_seconds), CostCurve(self.draft_seconds)

    def T(self, rows: int) -> float:
        return self._t.predict(rows)

    def D(self, sequences: int, context_rows: int = 0) -> float:
        return (self._d.predict(sequences) if self.draft_seconds else 0.0) + self.context_row_s * context_rows

    def O(self, batch: int, nodes: int = 0) -> float:  # noqa: E743 -- the model's own name for it
        return self.overhead_s + batch * self.overhead_seq_s + nodes * self.node_s

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        raw = json.loads(path.read_text())
        if "step_seconds" not in raw:
            raise ValueError(f"{path}: a cost model needs step_seconds (rows -> seconds of one target forward)")
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in raw.items() if k in known}
        fields["step_seconds"] = {int(r): float(s) for r, s in raw["step_seconds"].items()}
        fields["draft_seconds"] = {int(n): float(s) for n, s in raw.get("draft_seconds", {}).items()}
        fields.setdefault("name", path.stem)
        return cls(**fields)


class VirtualClock:
    """Seconds that pass only when a replay backend says so: `advance` at once; `after_read`
    once the clock has been read next -- a verify pass's host work (the walks, commits) follows
    the scheduler's reading of the pass's end, so it books that work as the step's rest, as it
    books the real one, not as the target's forward."""

    def __init__(self):
        self.now = 0.0
        self._pending = 0.0

    def __call__(self) -> float:
        now = self.now
        self.now += self._pending
        self._pending = 0.0
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def after_read(self, seconds: float) -> None:
        self._pending += seconds


class ReplayTarget:
    """The target, as the trace says it decodes (module docstring). A sequence is known by its
    context: when a prefill's last chunk asks for the next token, the context (read from the
    chunks of the sequence's first page) is matched to a trace sequence's prompt (and seed) and
    committed prefix; its verify rows then find it by their first page."""

    device = torch.device("cpu")

    def __init__(self, trace: Trace, cost: CostModel, clock: VirtualClock):
        self.cost, self.clock = cost, clock
        self.packs_rows = cost.packed
        self.full = [torch.tensor(s.prompt + s.completion) for s in trace.sequences]  # [P + N] each
        self.prompt_lengths = sorted({len(s.prompt) for s in trace.sequences})
        self.by_prompt: dict[tuple, list[int]] = {}
        for i, s in enumerate(trace.sequences):
            self.by_prompt.setdefault(tuple(s.prompt), []).append(i)
        self.seeds = [draw_seed(s.sampling) for s in trace.sequences]  # a trace's sampled requests carry their seeds
        self.chunks: dict[int, list[int]] = {}  # first page -> the context prefilled into its sequence so far
        self.owner: dict[int, int] = {}  # first page -> trace sequence, once its prefill is done

    def allocate(self, num_pages: int, page: int) -> None:
        self.chunks, self.owner = {}, {}

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pass  # no KV is held

    def identify(self, context: list[int], seed: int | None) -> int | None:
        """The trace sequence whose prompt `context` starts with and whose committed tokens it
        continues (of several, the one with the request's seed); None if none."""
        for p in self.prompt_lengths:
            if p > len(context):
                break
            found = [i for i in self.by_prompt.get(tuple(context[:p]), [])
                     if len(context) <= len(self.full[i]) and self.full[i][:len(context)].tolist() == context]
            if found:
                return next((i for i in found if self.seeds[i] == seed), found[0])
        return None

    def forward(self, batch: TargetBatch) -> TargetStep:
        b, q = batch.tokens.shape
        features = torch.zeros(b, q, 0) if batch.capture else None
        if isinstance(batch.mask, TreeBits):
            return self._verify(batch, features)
        self.clock.advance(self.cost.T(b * q))
        choices = torch.full((b, max(batch.logits_to_keep, 0) or q), OFF_PATH, dtype=torch.int64)
        if batch.logits_to_keep == 1 and b == 1:  # a prefill chunk: the token after it, once its sequence is known
            page = batch.tables[0][0]
            if batch.lengths[0] == 0:
                self.chunks[page] = []
            self.chunks[page] = self.chunks.get(page, []) + batch.tokens[0].tolist()
            i = self.identify(self.chunks[page], batch.seeds[0])
            if i is not None:
                self.owner[page] = i
                end = len(self.chunks[page])
                if end < len(self.full[i]):
                    choices[0, 0] = self.full[i][end]
        return TargetStep(choices, features, self.cost.T(b * q))

    def _verify(self, batch: TargetBatch, features) -> TargetStep:
        b, q = batch.tokens.shape
        real = batch.rows or [q] * b
        rows = sum(real) if self.packs_rows else b * q
        seconds = self.cost.T(rows)
        self.clock.advance(seconds)
        self.clock.after_read(self.cost.O(b, sum(real) - b))
        seqs = [self.full[self.owner[t[0]]] for t in batch.tables]
        # each row's committed sequence, padded past its end: [B, L + 2]
        longest = max(len(s) for s in seqs) + 2
        committed = torch.full((b, longest), OFF_PATH - 1, dtype=torch.int64)
        for r, s in enumerate(seqs):
            committed[r, :len(s)] = s
        pos = batch.positions.clamp(max=longest - 2)
        roots = committed[torch.arange(b), torch.tensor(batch.lengths)]
        if not torch.equal(roots, batch.tokens[:, 0]):
            raise ReplayMismatch(f"verify roots {batch.tokens[:, 0].tolist()} are not the committed tokens {roots.tolist()}")
        matches = committed.gather(1, pos) == batch.tokens  # [B, Q]: the node's token is the committed one there
        sees = unpack_bits(batch.mask.bits, q)  # [B, Q, Q]: row i sees its ancestors and itself
        on_path = ~(sees & ~matches[:, None, :]).any(-1)  # [B, Q]
        nxt = committed.gather(1, pos + 1)
        choices = torch.where(on_path & (nxt >= 0), nxt, torch.full_like(nxt, OFF_PATH))
        return TargetStep(choices, features, seconds)


class ReplayDrafter:
    """The drafter, as the trace recorded it: the candidates at each sequence's bonus position.
    `assign(seq_id, i)` says which trace sequence a scheduler sequence replays."""

    def __init__(self, trace: Trace, cost: CostModel, clock: VirtualClock):
        self.trace, self.cost, self.clock = trace, cost, clock
        self.block_size = trace.block_size
        self.target_layer_ids = (0,)  # features are placeholders; the scheduler asks for some
        self.sequences: dict[int, int] = {}  # scheduler sequence id -> trace sequence

    def assign(self, seq_id: int, index: int) -> None:
        self.sequences[seq_id] = index

    def open(self, seq_id: int, slots: int) -> None:
        pass

    def close(self, seq_id: int) -> None:
        pass

    def propose(self, rows: DraftRows) -> list[Candidates]:
        self.clock.advance(self.cost.D(len(rows.ids), sum(f.shape[1] for f in rows.features)))
        depths = rows.depths or [self.block_size - 1] * len(rows.ids)
        out = []
        for seq_id, bonus, start, depth, k in zip(rows.ids, rows.bonus, rows.start, depths, rows.top_k):
            seq = self.trace.sequences[self.sequences[seq_id]]
            at = start - len(seq.prompt)  # the bonus's completion index
            if not 0 <= at < len(seq.cand_tokens) or seq.completion[at] != bonus:
                raise ReplayMismatch(f"sequence {seq_id} drafts after token {bonus} at position {start}, which trace "
                                     f"sequence {self.sequences[seq_id]} did not commit there")
            out.append(seq.candidates(at, max(0, min(depth, self.block_size - 1)), k))
        return out


@dataclass
class SimRow(Throughput):
    """One cell: a policy at a concurrency under a cost model (seconds virtual; the busy steps:
    a closed loop's ramp and drain left out)."""

    cost: str = ""
    steps: int = 0
    drafted_rounds: int = 0  # rounds that verified drafted nodes ...
    drafted_nodes: int = 0  # ... and their nodes

    @property
    def mean_nodes(self) -> float:
        """Drafted nodes of the rounds that verified any."""
        return self.drafted_nodes / self.drafted_rounds if self.drafted_rounds else 0.0

    def summary(self) -> dict:
        return {**super().summary(), "mean_nodes": self.mean_nodes}

    def line(self) -> str:
        return (f"{self.cost} budget {self.budget} x{self.concurrency}: {self.tokens_per_s:.1f} tokens/s, "
                f"tau {self.tau or 0:.2f}, {self.mean_nodes:.1f} nodes a drafted round")


def replay_scheduler(trace: Trace, cost: CostModel, concurrency: int, max_step_tokens: int = 1024,
                     lookup: bool = False, calibrate: bool = True, policy=None, scheduler_class=Scheduler) -> Scheduler:
    """A Scheduler over the replay backends and a virtual clock, room for `concurrency` sequences
    (its KV pool holds every one whole: a replay prices compute, not memory); with `calibrate`,
    its policy's T(r) measured at start-up as the engine's is (workers.calibration.measure_step_cost).
    `policy`: the budget policy "auto" runs (the Scheduler's `policy`; a fresh BudgetPolicy by
    default); `scheduler_class`: the step loop (another revision's, benchmarks/policy_revision.py)."""
    clock = VirtualClock()
    longest = max(len(s.prompt) + s.max_tokens for s in trace.sequences)
    steps = max(max_step_tokens, concurrency)
    limits = BatchLimits(max_num_seqs=concurrency, max_step_tokens=steps,
                         kv_cache_tokens=concurrency * (longest + 2 * 129) + steps + 128)
    scheduler = scheduler_class(ReplayTarget(trace, cost, clock), ReplayDrafter(trace, cost, clock), 0, limits,
                                policy=policy, lookup=lookup, clock=clock)
    if calibrate:  # what measure_step_cost through the replay target measures (tests/test_simulate.py), without its work
        curve = type(scheduler.policy.verify)  # the policy's own module's CostCurve
        scheduler.policy.calibrate(curve({r: cost.T(r) for r in row_counts(steps)}))
    return scheduler


def simulate(trace: Trace, cost: CostModel, budget: Budget, concurrency: int, requests: int | None = None,
             lookup: bool = False, max_step_tokens: int = 1024, scheduler: Scheduler | None = None,
             policy=None, on_result=None) -> SimRow:
    """`requests` completions (default: max(2 x concurrency, the trace's sequences)), the trace's
    sequences in turn, over `concurrency` closed-loop streams -> the cell's row. Raises
    ReplayMismatch where a result's tokens are not the trace's. `policy`: a fresh budget policy
    object for budget "auto" (replay_scheduler). `on_result(i, result)`: each completion of trace
    sequence i, as it finishes."""
    scheduler = scheduler or replay_scheduler(trace, cost, concurrency, max_step_tokens, lookup,
                                              calibrate=budget == "auto", policy=policy)
    clock, drafter = scheduler.clock, scheduler.drafter
    seqs = trace.sequences
    requests = requests or max(2 * concurrency, len(seqs))
    todo = deque(i % len(seqs) for i in range(requests))
    live: dict[int, int] = {}  # scheduler sequence id -> trace sequence
    row = SimRow(budget, concurrency, cost=cost.name)

    def send() -> None:
        i = todo.popleft()
        seq_id = scheduler.add(seqs[i].request(budget, lookup if budget not in (0, "chain") else None))
        drafter.assign(seq_id, i)
        live[seq_id] = i

    while todo and len(live) < concurrency:
        send()
    start = clock()
    while live:
        row.steps += 1
        busy, before = len(live) == concurrency, clock()
        updates = scheduler.step()
        if busy:
            row.busy_seconds += clock() - before
            row.busy_tokens += sum(len(update.new_tokens) for _, update in updates)
        for seq_id, update in updates:
            if update.result is None:
                continue
            i, result = live.pop(seq_id), update.result
            if result.tokens != seqs[i].completion:
                raise ReplayMismatch(f"trace sequence {i} replayed at budget {budget} to {result.tokens}, "
                                     f"recorded {seqs[i].completion}")
            if on_result is not None:
                on_result(i, result)
            row.requests += 1
            row.tokens += len(result.tokens)
            row.rounds += len(result.rounds)
            row.round_tokens += len(result.tokens) - 1
            for r in result.rounds:
                row.granted[r.budget] = row.granted.get(r.budget, 0) + 1
                if r.tree_size > 1:
                    row.drafted_rounds += 1
                    row.drafted_nodes += r.tree_size - 1
                if r.predicted is not None:
                    row.predicted += r.predicted
                    row.accepted += r.accepted
            if todo:
                send()
    row.seconds = clock() - start
    return row


def markdown(rows: list[SimRow]) -> str:
    """One table per cost model: tokens/s per budget (rows) and concurrency (columns), and each
    budget's ratio to plain decoding; auto's also to the best fixed budget, and its predicted
    over realized accepted tokens."""
    out = []
    for cost in dict.fromkeys(r.cost for r in rows):
        cells = {(r.budget, r.concurrency): r for r in rows if r.cost == cost}
        budgets = list(dict.fromkeys(b for b, _ in cells))
        levels = list(dict.fromkeys(c for _, c in cells))
        out.append(f"\n{cost}: tokens/s (virtual), x plain; tau; nodes a drafted round\n")
        out.append("| budget | " + " | ".join(f"{c} streams" for c in levels) + " |")
        out.append("|---|" + "---|" * len(levels))
        for b in budgets:
            parts = []
            for c in levels:
                r, plain = cells.get((b, c)), cells.get((0, c))
                if r is None:
                    parts.append("")
                    continue
                ratio = f" ({r.tokens_per_s / plain.tokens_per_s:.2f}x)" if plain and plain.tokens_per_s else ""
                told = f"; pred/real {r.predicted / r.accepted:.2f}" if r.budget == "auto" and r.accepted else ""
                parts.append(f"{r.tokens_per_s:.1f}{ratio}; {r.tau or 0:.2f}; {r.mean_nodes:.1f}{told}")
            out.append(f"| {b} | " + " | ".join(parts) + " |")
        if any(b == "auto" for b in budgets):
            for label, rate in (("auto / best fixed", lambda r: r.tokens_per_s),
                                ("busy steps: auto / best fixed", lambda r: r.busy_tokens_per_s)):
                best = []
                for c in levels:
                    fixed = [rate(cells[(b, c)]) for b in budgets if b != "auto" and (b, c) in cells]
                    auto = cells.get(("auto", c))
                    best.append(f"{rate(auto) / max(fixed):.2f}x" if auto and fixed and max(fixed) else "")
                out.append(f"| {label} | " + " | ".join(best) + " |")
    return "\n".join(out)
