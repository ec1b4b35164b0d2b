"""`budget: auto`: each step, the trees that maximize the batch's expected output tokens per
second, from costs measured on the running machine and each sequence's own acceptance.

The step's rate, for B decoding sequences of which the set S drafts, tree s granted n_s nodes:

    rate = (B + sum_{s in S} E_s(n_s)) / (V + D(|S|, R_S) + O(B, N)),   N = sum_s n_s

- V, the target's verify pass: T(B x Q) on a device that pads every tree to the step's Q rows
  (one Q per step, n_s <= Q - 1); T(B + N) where padding rows are not computed (`packed`, the
  CPU: workers.model.Packing). T(r) is a `CostCurve` measured at start-up (ddtree.calibrate) and
  refreshed from every step's own forward at the rows it computed.
- D(k, R) = d0 + d1 k + c R: the drafter's pass over k sequences taking in R context rows (a
  sequence's target features since its last draft). An idle sequence's catch-up rows past one
  round's are priced over the rounds they buy: the SEQ_MEMORY its estimate vouches for, fewer
  where its max_tokens leaves fewer.
- O(B, N) = o0 + o1 B + o2 N: the rest of the step (growing, walking and committing the trees).
  D and O are least-squares fits (`LinearCost`) to the live steps, faded over COST_MEMORY steps.

E_s(n), the expected accepted tokens of the first n nodes of a best-first tree: the accepted
tokens are the tree's nodes on the target's path, so E_s(n) = sum_{i <= n} P(node i is on it).
Each node carries its path probability p_i as its source scored it -- the drafter, or a lookup
chain (workers.lookup) -- and P(i on path) = c_b p_i, times a_s for the drafter's nodes:

- c_b, the calibration of a node class b: the drafter's nodes by bin of p (`BINS`); the chain's
  nodes the drafter did not propose; the nodes both sources proposed. Of the nodes of that class
  in the recent trees of every sequence, how many the target's path took over their summed p. A
  merged tree's two sources are calibrated apart by whether they agree: the chain's probabilities
  are measured over every round it was offered, and where the drafter proposed another token
  the chain is right far less often than that (where both agree, more);
- a_s, the sequence's own factor: of its drafter nodes, how many the path took over their summed
  c_b p_i (1: as the batch), faded by 1 / SEQ_MEMORY a step, so old evidence goes stale.

Each is one `Ratio`: faded hits over mass, shrunk to a prior of 1 as if PRIOR_MASS had been seen
there -- the mean of a Gamma posterior, whose standard deviation says how much is known. Per
depth, the path takes at most one node and reaches a depth only via the one above, so a depth's
summed probability is clamped to [0, the depth above's] (`tree_gains`).

Every drafted tree teaches c_b and a_s whole, not only the prefix verified: the target's choice
at each position is the token the sequence commits there, so once the sequence has committed a
few more tokens the path through every node is known (`_Kept`). Learning from the verified prefix
alone would learn only from nodes chosen because they looked good.

A step decides twice. Before drafting (`plan`): which sequences draft, from each one's expected
tree -- the moving average of its recent drafted trees' calibrated curves, C_s(n) (SHAPE_WEIGHT
for the newest; the batch's average for a sequence that has not drafted) -- times an optimistic
a_s: its mean plus OPTIMISM standard deviations. That is the exploration rule: a sequence whose
acceptance is unknown (little evidence) or stale (evidence faded while it did not draft) is
priced at what it could plausibly gain, drafts if that pays, and its drafted tree -- verified or
not -- adds evidence, shrinking the bound; a sequence that never accepts stops drafting after a
bounded number of drafts, and is tried again only as its evidence fades. After drafting
(`choose`): each tree's exact curve at a_s's mean, the drafter's pass already paid.

Both decisions maximize the rate the same way (`_allocate`, Dinkelbach's method): at a rate rho,
a sequence's tree is worth max_n E_s(n) - rho kappa n - rho c R_s (kappa: a node's seconds), the
best set of sequences is a prefix of them by worth against the shared D(k), the set's exact rate
becomes the next rho, until it stops rising; per Q on a padded device, once on a packed one.
The J sequences still prefilling join the batch within a few steps, so a second now is worth the
joined batch's rate: both decisions count them as the plain rows they will be (B + J tokens, and
V + O at B + J rows less at B added to the step's seconds), and a tree pays only if it beats that.

Sequences with a fixed budget keep it; Q never goes below what they need. The policy only chooses
tree shapes, never tokens: output is the target's own at every Q.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ..kernels.tree import DRAFTER, LOOKUP, Lookup, Tree
from .calibration import plausible

BINS = (0.5, 0.2, 0.05)  # edges of the p bins calibrated apart: the drafter is overconfident at high p, less below
PRIOR_MASS = 2.0  # a factor starts at 1 as if this many expected tokens had been seen there
BATCH_MEMORY = 256  # the drafter's per-bin factors fade over this many resolved trees (a workload's drafter)
SEQ_MEMORY = 64  # a sequence's evidence fades over this many of its steps (its acceptance drifts within a reply)
OPTIMISM = 0.25  # the plan prices a sequence's factor at its mean plus this many standard deviations
SHAPE_WEIGHT = 0.3  # weight of a sequence's newest drafted tree in the tree it is expected to draft next
EMA = 0.2  # weight of a step's timing at its row count in T(r)
COST_MEMORY = 64  # D and O fit the steps of about this many last (a host's speed drifts within minutes)
MIN_WIDTH = 16  # a draft grows at least this many nodes (the trees granted at many streams: a few) ...
GROWTH = 2  # ... or this times its last granted tree's, this many depths past that tree's: a tree may grow each step
MISFIT = 2.0  # a forward off T(r) by over this factor ...
MISFIT_STEPS = 8  # ... this many steps in a row (doubling each time) has T(r) measured again


class CostCurve:
    """Seconds of one operation against its size (rows), as measured points: a size observed at
    a point moves it by EMA; a new size near points (within 1.5x) scales them towards what it
    measured and becomes a point itself; one far from every point becomes a point at what it
    measured. Between points: linear; below the first: the first; above the last: proportional
    to the size (the pessimistic guess for a size never seen)."""

    def __init__(self, points: dict[int, float] | None = None):
        self.points: dict[int, float] = dict(sorted((points or {}).items()))

    def __bool__(self) -> bool:
        return bool(self.points)

    def __str__(self) -> str:  # for the logs: size -> milliseconds
        return ", ".join(f"{size}: {1000 * s:.1f} ms" for size, s in self.points.items())

    def predict(self, size: int) -> float:
        if not self.points:
            return 0.0
        sizes = list(self.points)
        if size <= sizes[0]:
            return self.points[sizes[0]]
        if size >= sizes[-1]:
            return self.points[sizes[-1]] * size / sizes[-1]
        i = bisect.bisect_left(sizes, size)
        lo, hi = sizes[i - 1], sizes[i]
        w = (size - lo) / (hi - lo)
        return (1 - w) * self.points[lo] + w * self.points[hi]

    def observe(self, size: int, seconds: float) -> None:
        if size in self.points:
            self.points[size] += EMA * (seconds - self.points[size])
            return
        near = [p for p in self.points if p / 1.5 <= size <= p * 1.5]
        guess = self.predict(size) if near else seconds
        factor = (seconds / max(guess, 1e-12)) ** EMA
        for p in near:
            self.points[p] *= factor
        self.points[size] = guess + EMA * (seconds - guess)
        self.points = dict(sorted(self.points.items()))


class LinearCost:
    """Seconds as a linear function of a few sizes, y = w . (1, x...), by least squares over the
    observations faded by 1 / COST_MEMORY each, with a small ridge (1e-9 of the weight's scale)
    so that sizes that never varied share their part instead of failing the solve."""

    def __init__(self, sizes: int):
        n = sizes + 1
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n
        self.w = [0.0] * n

    def predict(self, *x: float) -> float:
        return max(0.0, self.w[0] + sum(w * v for w, v in zip(self.w[1:], x)))

    def coefficient(self, i: int) -> float:
        """The seconds one unit of size i (0-based) adds, at least 0."""
        return max(0.0, self.w[i + 1])

    def observe(self, seconds: float, *x: float) -> None:
        v, fade = (1.0, *x), 1 - 1 / COST_MEMORY
        for i, a in enumerate(v):
            self.xy[i] = fade * self.xy[i] + a * seconds
            for j, b in enumerate(v):
                self.xx[i][j] = fade * self.xx[i][j] + a * b
        n = len(v)
        m = [[self.xx[i][j] + (1e-9 * (1 + self.xx[i][i]) if i == j else 0.0) for j in range(n)] + [self.xy[i]]
             for i in range(n)]
        for c in range(n):  # Gauss-Jordan with partial pivoting: n <= 3
            p = max(range(c, n), key=lambda r: abs(m[r][c]))
            m[c], m[p] = m[p], m[c]
            if abs(m[c][c]) < 1e-300:
                return
            for r in range(n):
                if r != c:
                    f = m[r][c] / m[c][c]
                    m[r] = [a - f * b for a, b in zip(m[r], m[c])]
        self.w = [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class Ratio:
    """Hits over mass (the tokens a model expected), faded, shrunk to 1 as if PRIOR_MASS had been
    seen there: the mean of the Gamma(hits + PRIOR_MASS, mass + PRIOR_MASS) posterior of a Poisson
    rate, and its standard deviation (how much is known)."""

    hits: float = 0.0
    mass: float = 0.0

    def mean(self) -> float:
        return (self.hits + PRIOR_MASS) / (self.mass + PRIOR_MASS)

    def upper(self, sds: float) -> float:
        """The mean plus `sds` standard deviations."""
        return self.mean() + sds * math.sqrt(self.hits + PRIOR_MASS) / (self.mass + PRIOR_MASS)

    def fade(self, keep: float) -> None:
        self.hits *= keep
        self.mass *= keep

    def add(self, hits: float, mass: float) -> None:
        self.hits += hits
        self.mass += mass


def class_of(p: float, source: int = DRAFTER) -> int:
    """A node's calibration class, from its path probability p and source (kernels.tree's
    DRAFTER / LOOKUP bits): the drafter's bin of p, 0 for p >= BINS[0] ... len(BINS) below the
    last; len(BINS) + 1 the lookup chain's alone; len(BINS) + 2 both sources'."""
    if source & LOOKUP:
        return len(BINS) + (2 if source & DRAFTER else 1)
    for b, edge in enumerate(BINS):
        if p >= edge:
            return b
    return len(BINS)


def tree_gains(p: list[float], depth: list[int], sources: list[int], factors: list[float],
               scale: float = 1.0) -> list[float]:
    """E(n), n = 0 ... len(p): the expected accepted tokens of a best-first tree's first n
    non-root nodes (path probability p, depth, source bits; 0 counts as the drafter's): node i
    adds factors[class] x p_i, times scale for the drafter's own, to its depth's reach; the path
    reaches depth d with min(1, reach_1, ..., reach_d), summed over the depths."""
    reach = [0.0] * (1 + max(depth, default=0))
    out = [0.0]
    for pi, d, source in zip(p, depth, sources):
        b = class_of(pi, source)
        reach[d] += factors[b] * pi * (scale if b <= len(BINS) else 1.0)
        total, low = 0.0, 1.0
        for r in reach[1:]:
            low = min(low, r)
            if low <= 0.0:
                break
            total += low
        out.append(total)
    return out


@dataclass
class _Kept:
    """A drafted tree, whole, until the tokens its sequence commits after its root decide the
    target's path through it (`resolve`)."""

    tokens: list[int]  # [N] root first
    parents: list[int]  # [N]
    p: list[float]  # [N - 1] the non-root nodes' path probabilities ...
    sources: list[int]  # [N - 1] ... and who proposed them (DRAFTER / LOOKUP bits; 0: the drafter)
    after: list[int] = field(default_factory=list)  # tokens committed after the root so far

    def resolve(self) -> set[int] | None:
        """The non-root nodes on the target's path, once `after` decides it (a node with no child
        on it, or a leaf); else None."""
        at, path = 0, set()
        for token in self.after:
            nxt = next((i for i in range(at + 1, len(self.tokens))
                        if self.parents[i] == at and self.tokens[i] == token), None)
            if nxt is None:
                return path
            at = nxt
            path.add(at)
        return path if at not in self.parents else None


@dataclass
class _Sequence:
    """What the policy knows of one auto sequence."""

    factor: Ratio = field(default_factory=Ratio)  # a_s
    shape: list[float] | None = None  # C_s(n): its expected tree's calibrated gains, before a_s
    nodes: int = 0  # its last granted tree's nodes ...
    depth: int = MIN_WIDTH // GROWTH // GROWTH  # ... and depth (at first: what a MIN_WIDTH-node tree reaches, about)
    last_depths: list[int] = field(default_factory=list)  # its drafted tree's node depths, until `choose`
    pending: list[_Kept] = field(default_factory=list)


@dataclass
class PlanRow:
    """An auto sequence the plan may have draft."""

    seq_id: int
    context: int  # target feature rows its draft would take in
    left: int = 1 << 30  # tokens it may still commit (its max_tokens less its output)


@dataclass
class Draft:
    """What the plan asks of a sequence that drafts."""

    width: int  # nodes its tree is grown to (and the drafter's top-k per depth)
    depth: int  # depths the drafter proposes
    explores: bool  # the sequence has never drafted: its acceptance is unknown


@dataclass
class Decision:
    q: int  # the step's verify rows per sequence (the bucket its largest tree fills)
    nodes: list[int]  # per curve: its granted nodes
    predicted: list[float]  # per curve: its expected accepted tokens
    rate: float  # predicted output tokens per second of the step


@dataclass
class RowReport:
    """One auto sequence's part of a step's outcome."""

    seq_id: int
    committed: list[int]  # the tokens it committed: its accepted nodes' (root excluded), then the bonus
    finished: bool


@dataclass
class StepReport:
    """What a decode step cost and what its auto sequences committed."""

    batch: int  # sequences verified
    q: int  # verify rows per sequence
    nodes: int  # drafted and lookup nodes verified, all sequences
    verify_s: float  # the target's forward
    drafting: int  # sequences in the drafter's pass ...
    context: int  # ... the context rows it took in ...
    draft_s: float  # ... and its seconds (growing the trees included)
    rest_s: float  # the rest of the step
    rows: list[RowReport]


class BudgetPolicy:
    """The costs and acceptance estimates of one scheduler, and its two decisions per step."""

    def __init__(self, step_cost: CostCurve | None = None, cap: int = 64, packed: bool = False):
        self.cap = cap  # the most drafted nodes a sequence may be granted
        self.packed = packed  # a step's forward computes its real rows (B + N), not B x Q; the scheduler sets it
        self.recalibrations, self.misfits = 0, 0
        self.verify = step_cost or CostCurve()  # T(r)
        self.draft = LinearCost(2)  # D(k, R)
        self.rest = LinearCost(2)  # O(B, N)
        self._cold_draft = True  # the process's first drafter pass builds its buffers: not the drafter's cost
        self.bins = [Ratio() for _ in range(len(BINS) + 3)]  # c_b: the drafter's bins, the chain's alone, both
        self.shape: list[float] | None = None  # the batch's expected tree, for a sequence that never drafted
        self.sequences: dict[int, _Sequence] = {}

    # --- costs ------------------------------------------------------------------------------------

    def calibrate(self, step_cost: CostCurve) -> None:
        """T(r) as measured (at start-up, or again after a misfit)."""
        self.verify, self.misfits = step_cost, 0

    def misfit(self) -> bool:
        """Whether the live steps contradict T(r) so that it should be measured again: the forward
        took over MISFIT times (or under 1 / MISFIT of) what T(r) predicted MISFIT_STEPS steps in a
        row, twice as many after each re-measurement."""
        return self.misfits >= MISFIT_STEPS << self.recalibrations

    def recalibrate(self, measured: CostCurve) -> bool:
        """T(r) measured again up to some largest count: its points replace the curve's, and the
        points above are scaled by what the largest count found. A measurement that cannot be the
        machine's (`plausible`) is not taken. Returns whether it was taken."""
        self.recalibrations += 1
        self.misfits = 0
        if not plausible(measured.points):
            return False
        top = max(measured.points)
        scale = measured.points[top] / max(self.verify.predict(top), 1e-12)
        self.calibrate(CostCurve(measured.points | {r: s * scale for r, s in self.verify.points.items() if r > top}))
        return True

    def verify_s(self, batch: int, q: int, nodes: int) -> float:
        """V: T(B x Q), or packed T(B + nodes)."""
        return self.verify.predict(batch + nodes if self.packed else batch * q)

    def _seconds(self, batch: int, q: int, nodes: int, drafting: int, context: float) -> float:
        """The whole step: V + D(k, R) (0 with nothing drafting) + O(B, N)."""
        draft = self.draft.predict(drafting, context) if drafting else 0.0
        return self.verify_s(batch, q, nodes) + draft + self.rest.predict(batch, nodes)

    def _node_s(self, batch: int, q: int, nodes: int) -> float:
        """kappa: a node's seconds at a step of `nodes` nodes: its part of O, and packed the slope
        of T over the rows past B + nodes (the next MIN_WIDTH of them when none yet)."""
        kappa = self.rest.coefficient(1)
        if self.packed:
            lo, span = batch + nodes, max(nodes, MIN_WIDTH)
            kappa += max(0.0, self.verify.predict(lo + span) - self.verify.predict(lo)) / span
        return kappa

    # --- acceptance -------------------------------------------------------------------------------

    def factors(self) -> list[float]:
        """c_b of every node class (`class_of`)."""
        return [r.mean() for r in self.bins]

    def _state(self, seq_id: int) -> _Sequence:
        return self.sequences.setdefault(seq_id, _Sequence())

    def expected(self, seq_id: int) -> list[float] | None:
        """The plan's E_s(n) of a sequence's next tree: its expected tree (the batch's if it never
        drafted; None before any tree) at its factor's optimistic bound, at most n."""
        state = self.sequences.get(seq_id) or _Sequence()
        shape = state.shape or self.shape
        if shape is None:
            return None
        a = state.factor.upper(OPTIMISM)
        return [min(n, a * g) for n, g in enumerate(shape)]

    def curve(self, seq_id: int, tree: Tree, most: int) -> list[float]:
        """This step's E_s(n) of a drafted `tree`'s first n nodes, n = 0 ... min(its nodes, most),
        at the sequence's mean factor. The tree, whole, is kept until its path is known, and its
        calibrated curve moves the sequence's (and the batch's) expected tree."""
        state = self._state(seq_id)
        p = tree.scores[1:].exp().tolist()
        depth = tree.depths[1:].tolist()
        sources = tree.sources[1:].tolist() if tree.sources is not None else [DRAFTER] * len(p)
        state.pending.append(_Kept(tree.tokens.tolist(), tree.parents.tolist(), p, sources))
        end = min(len(p), most)
        shape = tree_gains(p[:end], depth[:end], sources[:end], self.factors())
        state.shape = _blend(state.shape, shape)
        self.shape = _blend(self.shape, shape)
        state.last_depths = depth[:end]
        return tree_gains(p[:end], depth[:end], sources[:end], self.factors(), state.factor.mean())

    def chain_curve(self, branch: Lookup, most: int) -> list[float]:
        """E(n) of a lookup chain verified alone: the node at depth d is reached with the product
        of the chain's first d probabilities (calibrated already)."""
        reach, out = 0.0, [0.0]
        for logprob in branch.logprobs[:most]:
            reach += logprob
            out.append(out[-1] + min(1.0, math.exp(reach)))
        return out

    def lookup_floor(self, batch: int) -> float:
        """A step in which nothing drafts: the first-node probability at or below which no lookup
        chain verified alone can raise the step above plain decoding (each of its nodes gains at
        most that probability, and costs at least kappa at the plain step's rate), so the
        scheduler builds and prices no such chain."""
        seconds = self._seconds(batch, 1, 0, 0, 0.0)
        return batch / seconds * self._node_s(batch, 2, 0) if seconds > 0 else 0.0

    # --- the decisions ----------------------------------------------------------------------------

    def plan(self, batch: int, buckets: list[int], rows: list[PlanRow], fixed_drafting: int = 0,
             fixed_nodes: int = 0, joining: int = 0) -> list[Draft | None]:
        """Before drafting: per auto sequence (`rows`), its draft, or None where it does not draft:
        the set of the highest rate at its optimistic E_s (`expected`), beside `fixed_drafting`
        sequences of fixed budgets drafting `fixed_nodes` nodes, `joining` sequences prefilling
        (`_allocate`). Before any tree was seen, the first sequence drafts, to give the batch an
        expected tree."""
        if not rows:
            return []
        curves = [self.expected(r.seq_id) for r in rows]
        if self.shape is None:
            chosen = {0}
        else:
            context = [self._priced_context(r, c) for r, c in zip(rows, curves)]
            nodes, _ = self._allocate(batch, buckets, curves, fixed_nodes, fixed_drafting, context, joining=joining)
            chosen = {i for i, n in enumerate(nodes) if n}
        return [self.draft_of(r.seq_id, buckets[-1] - 1) if i in chosen else None for i, r in enumerate(rows)]

    def draft_of(self, seq_id: int, most: int) -> Draft:
        """A sequence's draft: GROWTH times its last granted tree's nodes, at least MIN_WIDTH
        (GROWTH x MIN_WIDTH at first), at most `most`; GROWTH depths past that tree's depth."""
        state = self._state(seq_id)
        width = max(MIN_WIDTH, GROWTH * state.nodes) if state.shape else GROWTH * MIN_WIDTH
        return Draft(max(1, min(most, width)), state.depth + GROWTH, state.shape is None)

    def _priced_context(self, row: PlanRow, curve: list[float] | None) -> float:
        """The context rows a draft is charged for: a round's own (1 + its expected gains), and the
        rows of a catch-up past them spread over the rounds they buy: SEQ_MEMORY (its estimate
        vouches for no more), or the rounds its tokens left fill at 1 + its gains a round."""
        steady = 1 + (curve or [0.0])[-1]
        rounds = max(1.0, min(SEQ_MEMORY, row.left / steady))
        return row.context if row.context <= steady else steady + (row.context - steady) / rounds

    def choose(self, batch: int, buckets: list[int], curves: list[list[float]], draft_s: float,
               fixed_nodes: int = 0, ids: list[int | None] | None = None, joining: int = 0) -> Decision:
        """After drafting: each auto tree's granted nodes (a best-first prefix) and the step's Q,
        of the highest predicted rate, from the trees' exact curves (`curve`, `chain_curve`), the
        drafter's pass already spent (`draft_s`) and the fixed budgets' nodes. `ids`: per curve,
        the drafted sequence it is (None: a lookup chain alone), whose granted tree the next
        draft is sized from; `joining`: sequences prefilling (`_allocate`)."""
        nodes, rate = self._allocate(batch, buckets, curves, fixed_nodes, 0, None, sunk=draft_s, joining=joining)
        for seq_id, n in zip(ids or [], nodes):
            if seq_id in self.sequences:
                state = self.sequences[seq_id]
                state.nodes = n
                state.depth = max(state.last_depths[:n], default=0) if n else state.depth
        widest = 1 + max(nodes, default=0)
        q = next((b for b in buckets if b >= widest), buckets[-1])
        return Decision(q, nodes, [c[n] for c, n in zip(curves, nodes)], rate)

    def _allocate(self, batch: int, buckets: list[int], curves: list[list[float] | None], fixed_nodes: int,
                  fixed_drafting: int, context: list[float] | None, sunk: float = 0.0,
                  joining: int = 0) -> tuple[list[int], float]:
        """Nodes per curve (0: none, or does not draft) of the highest rate (module docstring),
        and that rate. `context`: per curve, the rows its draft takes in (the plan: drafting
        costs D); None: the draft is spent (`sunk` seconds) and every tree is free to take.
        `joining`: sequences still prefilling, priced as plain rows of the step."""
        c_row = self.draft.coefficient(1)
        # the J's plain rows, added to every option's seconds
        joined = self._seconds(batch + joining, 1, 0, 0, 0.0) - self._seconds(batch, 1, 0, 0, 0.0) if joining else 0.0

        def seconds(q: int, nodes: int, k: int, rows: float) -> float:
            draft = self.draft.predict(fixed_drafting + k, rows) if fixed_drafting + k and context is not None else sunk
            nodes += fixed_nodes
            return joined + self.verify_s(batch, q, nodes) + draft + self.rest.predict(batch, nodes)

        best = ([0] * len(curves), (batch + joining) / max(seconds(buckets[0], 0, 0, 0.0), 1e-12))
        options = [buckets[-1]] if self.packed else [q for q in buckets if q > 1]
        for q in options:
            rho, total = best[1], 0
            while True:
                lam = rho * self._node_s(batch, q, fixed_nodes + total)
                worth = []  # (worth, index, nodes)
                for i, c in enumerate(curves):
                    if not c or len(c) < 2:
                        continue
                    top = min(len(c) - 1, q - 1)
                    n = max(range(1, top + 1), key=lambda m: c[m] - lam * m)
                    v = c[n] - lam * n - (rho * c_row * context[i] if context is not None else 0.0)
                    if v > 0:
                        worth.append((v, i, n))
                worth.sort(reverse=True)
                if context is not None:  # the shared pass: the best prefix by worth against D(k)
                    base = self.draft.predict(fixed_drafting, 0.0) if fixed_drafting else 0.0
                    score, k_best, acc = 0.0, 0, 0.0
                    for k, (v, _, _) in enumerate(worth, start=1):
                        acc += v
                        s = acc - rho * (self.draft.predict(fixed_drafting + k, 0.0) - base)
                        if s > score:
                            score, k_best = s, k
                    worth = worth[:k_best]
                nodes = [0] * len(curves)
                for _, i, n in worth:
                    nodes[i] = n
                total = sum(nodes)
                rows = sum(context[i] for _, i, _ in worth) if context is not None else 0.0
                tokens = batch + joining + sum(curves[i][n] for _, i, n in worth)
                rate = tokens / max(seconds(q, total, len(worth), rows), 1e-12)
                if rate > best[1]:
                    best = (nodes, rate)
                if rate <= rho * (1 + 1e-9) or not worth:
                    break
                rho = rate
        return best

    # --- learning ---------------------------------------------------------------------------------

    def observe(self, step: StepReport) -> None:
        """A step's outcome: its costs teach T, D and O; each auto sequence's committed tokens
        decide the path through its kept trees, which teach c_b and a_s (`_learn`); a finished
        sequence's state is dropped."""
        if math.isfinite(step.verify_s) and step.verify_s > 0:
            rows = step.batch + step.nodes if self.packed else step.batch * step.q
            if self.verify:
                ratio = step.verify_s / max(self.verify.predict(rows), 1e-12)
                self.misfits = self.misfits + 1 if not 1 / MISFIT <= ratio <= MISFIT else 0
            self.verify.observe(rows, step.verify_s)
        if step.drafting and step.draft_s > 0:
            if self._cold_draft:
                self._cold_draft = False
            else:
                self.draft.observe(step.draft_s, step.drafting, step.context)
        if step.rest_s > 0:
            self.rest.observe(step.rest_s, step.batch, step.nodes)
        for row in step.rows:
            state = self.sequences.get(row.seq_id)
            if state is None:
                continue
            state.factor.fade(1 - 1 / SEQ_MEMORY)
            undecided = []
            for kept in state.pending:
                kept.after += row.committed
                path = kept.resolve()
                if path is not None:
                    self._learn(state, kept, path)
                elif not row.finished:
                    undecided.append(kept)
            state.pending = undecided
            if row.finished:
                self.drop(row.seq_id)

    def _learn(self, state: _Sequence, kept: _Kept, path: set[int]) -> None:
        """One resolved tree: per node, whether the path took it, against its p (its class's
        c_b) and, a drafter node's, its c_b p (a_s)."""
        factors = self.factors()
        for r in self.bins:
            r.fade(1 - 1 / BATCH_MEMORY)
        for i, (p, source) in enumerate(zip(kept.p, kept.sources), start=1):
            b, hit = class_of(p, source), float(i in path)
            self.bins[b].add(hit, p)
            if b <= len(BINS):
                state.factor.add(hit, factors[b] * p)

    def drop(self, seq_id: int) -> None:
        """Forgets a sequence (finished, cancelled)."""
        self.sequences.pop(seq_id, None)


def _blend(old: list[float] | None, new: list[float]) -> list[float]:
    """A moving average of gain curves (SHAPE_WEIGHT for the newest), the shorter held at its
    last value."""
    if old is None:
        return list(new)
    n = max(len(old), len(new))
    at = lambda c, i: c[min(i, len(c) - 1)]  # noqa: E731
    return [at(old, i) + SHAPE_WEIGHT * (at(new, i) - at(old, i)) for i in range(n)]
