"""`budget: auto`: each step, the tree each sequence gets is the one that maximizes the batch's
expected output tokens per second, from costs measured on the running machine and each
sequence's own acceptance.

The model (README, "How budget: auto chooses"):

    rate(Q, S) = (B + sum_{s in S} E_s(Q - 1)) / (T(B * Q) + D(|S|) + c R_S + O(B))

- B sequences decode this step; every one verifies a block of Q rows (a bucket: the step pads
  every tree to the same Q, so within one step a sequence's nodes up to Q - 1 cost no more rows);
  S are the sequences that draft, the others verify their root alone.
- Packed (`packed`: on the CPU the padding rows are not computed, workers.model.Packing), each
  tree s gets its own nodes n_s and the step costs its real rows:
      rate(n) = (B + sum_s E_s(n_s)) / (T(B) + k (T1(B + N) - T1(B)) + D(|S|) + c R_S + O(B)),
  N = sum_s n_s, T1 the start-up curve as measured (`shape`: the GEMMs' register tiles make the
  first rows past a multiple of 4 nearly free), k(B) = measured / T1's extra seconds of the
  recent steps with trees in batches of about B (`row_factor`, one per power-of-two band of B:
  a node of a 16-sequence batch costs more than T1 says, one of a lone sequence less), and within
  a band one per power-of-two group of N (the live steps' shape is not T1's); nodes are granted
  highest marginal gain first.
- T(r): seconds of one target forward over r rows in all (`CostCurve`), calibrated over row
  counts at start-up (ddtree.calibrate) and refreshed from every step's own timing.
- D(n) + c R: the drafter's pass over n sequences and growing their trees, plus c seconds per
  context row it takes in (R: the drafting sequences' target features since their last draft --
  a new sequence's whole prompt, an idle one's every token since: a probe of 16 new sequences at
  16 streams spent 161 ms drafting where D(16) said 70; the plan spreads the rows past a round's
  steady ones over the rounds the sequence has left, `priced_context`); O(B): the rest of a step
  (lookup branches, walk, commit), one curve for plain steps (Q = 1) and one for steps with
  trees, which cost more; all learned from the live steps.
- E_s(n): the expected accepted tokens of sequence s's best-first tree of n nodes. DDTree grows
  the tree in order of the drafter's path probabilities p_i, so with a calibrated drafter the
  probability that the target's own path reaches depth d is the mass m_d(n) of the tree's first n
  nodes at depth d (the path takes at most one node per depth). The drafter is not calibrated,
  and not alike at every p: on chat its nodes of p >= .5 were taken 0.64 times as often as p
  said, those below .2 1.03-1.11 times; on math 0.81-0.87 at every p. So each sequence keeps a
  factor per bin of p (`BINS`), c_b = (nodes of bin b the path took) / (their summed p) over its
  recent rounds (shrunk to the batch-wide factor while it has few), node i counts c_b(i) p_i, and
      R_s(n) = sum_d min(1, sum_{i at depth d} c_b(i) p_i + l_d(n))   (the sum made
  non-increasing in d: a path reaches d only via d-1),
      E_s(n) = sum_{k <= n} b_g(k) (R_s(k) - R_s(k - 1)),
  where b_g is the realized / predicted ratio of the recent verified trees of the same source
  (those were chosen because they were predicted to pay, so what optimism the factors leave
  shows there) at the ranks of group g (1, 2-3, 4-7, ...: how often the path took the nodes of
  those ranks over their marginal gains, starting from the source's whole ratio): one set for
  trees with the drafter's nodes, one for lookup chains verified alone. With lookup branches,
  the sum counts the drafter's nodes alone and l_d is the mass of the nodes on the lookup chain,
  whose scores are already calibrated from the chain's measured acceptance (workers.lookup): c_b
  learns only from the drafter's nodes, so a stretch of trees that are mostly (or only) a lookup
  chain does not teach it the chain's hit rate. A drafted tree teaches c_b and b whole, every
  node of it, not the prefix verified: the target's choice at each position is the token the
  sequence commits there, so its path through the tree is known a few steps later (`hindsight`);
  the prefixes verified were chosen because they were predicted to pay, and learned from alone
  they priced every other tree ~11% low. (A factor per depth, before: learned on the
  policy's own trees, mostly their p >= .5 nodes, it priced the siblings that a wider tree adds
  at the top nodes' 0.4-0.65, and on chat predicted 0.58 accepted tokens for budget 4's trees
  that took 0.77.)

A step decides twice: before drafting, from each sequence's recent E_s (read through what drafted
steps gained after such recent gains: `foretell`), which sequences draft (`plan`); after drafting,
from this step's exact E_s, which Q (`choose`). Q = 1 is plain decoding.
A sequence the plan leaves out is probed (drafts anyway: one drafter row, and the step's Q still
chosen from what it drafted; the others' drafts share its pass, and the plan prices them at what
they add to it) at its first step, then after 8 idle steps, 16, 32, 64, so a
new sequence is learnt and one whose acceptance collapsed is re-probed cheaply -- but only while
the best gains seen lately (`hope`: any sequence's) would make drafting it pay at this step's
costs: under a load where no tree can pay (many streams on a CPU) the band probes only once its
last probe's net cost is HOPELESS_SHARE of its seconds since (`_overdue`: `hope` is learned from
drafted trees alone, and a low first estimate would otherwise stand for good), and then only the
due sequences whose predicted cost that share pays for (`_affordable`, at least one). While nothing
drafts, `hope` rises slowly back to the best gains ever seen, so a workload that changed during
a stretch of plain decoding gets probed again. A probe is paid for by what follows it: a
band of batch sizes probes while a quarter or more of its recent probes were followed by the
plan drafting that sequence for its gains (`probe_yield`), else once every EXPLORE steps, and
that share of the due sequences at a time, fewest context rows first (`_rationed`; those of one
step share the drafter's pass), and no sooner than its last such probe's
net cost (`probe_cost`: its seconds past what its tokens take plain) is a share of the band's time
since: at 16 streams a probe of a new wave of sequences cost ~100 ms past its tokens. The share is
what a probe is expected to return -- the share of probes followed by drafting times what the best
gains seen would add to the step's rate -- between HOPELESS_SHARE and EXPLORE_SHARE: one sequence
found drafting adds ~40% at one stream, a few per cent to a step of 16.
A batch that drains (no request waits and it runs fewer sequences than it did since it last
grew: the scheduler's `draining`) ends when its longest sequence does: the steps the others
take ride on the ones that sequence needs anyway. So while it drains, both decisions weigh each
sequence's expected accepted tokens by its tokens left over the batch's mean (`drain_weights`):
at 4 streams, trees sized by gain alone left the chat sequences (the lowest acceptance) the
longest ones, the last of a pass ran 12 steps alone where budget 4's ran 6, and the drain cost
auto ~2% of the pass against budget 4. The weights only choose; what a step predicts, and is
checked against, is its unweighted tokens.
The pieces are learned apart, so each band also checks their sum against its steps as a whole:
an option with trees is weighed at what the band's steps with trees realized of the rate
predicted for them, over what its plain steps realized of theirs (`tree_rate`, at most 1).
Sequences with a fixed budget keep it; Q never goes below what they need.
Two shortcuts that change no decision keep auto's own work small where trees do not pay (many
streams on a CPU): no set of sequences beats the plain step where each gains at most what its
nodes' rows and its draft cost at the plain step's rate (`node_floor`: the least seconds a node,
`least_node_s`, times that rate; `draft_floor`: the least seconds the drafter takes a sequence,
likewise), so the plan does not price the sets of such a Q, and in a step where nothing
drafts the scheduler builds and prices no lookup chain whose first node is too improbable to pay
for its row alone (`lookup_floor`).

The policy only chooses tree shapes, never tokens: output is the target's own at every Q.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import GREEDY
from ..kernels.tree import DRAFTER, Lookup, Tree
from .batch_backends import TargetBatch

EMA = 0.2  # weight of a new observation in the cost curves and in a sequence's gain estimates
SEQ_DECAY = 0.9  # a sequence's acceptance counts fade by this per round (it adapts within ~10 rounds)
BATCH_DECAY = 0.995  # the batch-wide counts fade slower
PRIOR_WEIGHT = 1.0  # predicted reaches of the batch-wide factor a sequence starts from
BIAS_DECAY = 0.99  # per verified tree, the rounds behind the realized / predicted correction fade
HOPE_EASE = 0.05  # a gain below the best seen moves the best this far towards it ...
HOPE_RISE = 0.01  # ... and each step in which nothing drafts, this far back to the best ever seen
FIRST_PROBE = 8  # a sequence that does not draft drafts anyway after this many steps ...
LAST_PROBE = 64  # ... doubling each time up to this: acceptance that collapsed is re-probed cheaply
YIELD_DECAY = 0.9  # per probe outcome, the counts behind a band's probe yield fade by this ...
YIELD_PRIOR = 2.0  # ... which starts at 1 as if this many probes had each been followed by drafting
MIN_YIELD = 0.25  # a band probes while at least this share of its probes is followed by drafting ...
EXPLORE = 32  # ... or once this many of its steps have gone by without a probe ...
EXPLORE_SHARE = 0.02  # ... and its last probe's net cost is at most this share of their seconds
HOPELESS_SHARE = 0.005  # where even the best gains seen could not pay, a band still probes at this share
CALIBRATION_CONTEXT = 64  # committed tokens before the rows `measure_step_cost` times ...
DENSE_COUNT = 17  # ... and the counts up to this many rows (~0.9 s a round for SmolLM2 on 2 cores) ...
DENSE_REPEATS = 9  # ... it times in at least this many rounds: their differences are a few ms
STALE = 24  # packed rows: nodes granted past the best rate seen before the policy stops looking
ROW_DECAY = 0.95  # packed rows: per step with trees, the sums behind the row factor fade by this
ROW_PRIOR_S = 0.05  # ... which starts at 1 as if this many seconds had been measured as calibrated
SIZE_ROW_PRIOR_S = 0.01  # ... and one per step size, at the band's factor as if this many had (a few nodes: ~5 ms)
ROW_FACTOR_FLOOR = 0.25  # ... and never below this: a node's rows never make a step cheaper
PLAIN_SEEN = 3  # ... and learns only from batches whose plain step was seen this many times;
# a batch of auto sequences alone decodes plainly until then (`baseline_due`) ...
PLAIN_REFRESH = 128  # ... and once more after this many steps with trees in a row (at one stream, where
# a tree gains ~40%, one plain step in 129 costs ~0.3%)
ROW_FLOOR_SPAN = 16  # packed rows: a node costs at least a quarter of T1's mean slope over this many rows past B
# the drafter's nodes are calibrated per bin of their path probability p: 0 for p >= .5, 1 for
# .2 <= p < .5, 2 for .05 <= p < .2, 3 below
BINS = (0.5, 0.2, 0.05)
FORETOLD_PRIOR = 0.4  # the plan's regression of a step's gains on the recent ones starts at y = x, as if
# this much squared spread of recent gains had been seen on that line
SIZE_PRIOR = 2.0  # a rank group's correction starts from its source's as if this many tokens were predicted
HORIZON = 16  # the most rounds over which the plan spreads a sequence's context catch-up (`priced_context`)
MIN_DRAFT_DEPTH = 4  # an auto sequence's draft asks for at least this many depths ...
DEPTH_MARGIN = 2  # ... and this many past its last chosen tree's depth
MIN_DRAFT_WIDTH = 16  # an auto sequence's drafted tree holds at most this many nodes ...
WIDTH_FACTOR = 2  # ... or this many times its last chosen tree's, if more (`draft_width`)
FIRST_DRAFT_DEPTH = MIN_DRAFT_DEPTH + DEPTH_MARGIN  # its first draft (a probe, mostly) asks this many depths ...
FIRST_DRAFT_WIDTH = WIDTH_FACTOR * MIN_DRAFT_WIDTH  # ... and grows a tree of this many nodes
CONTEXT_ROWS = 8  # a draft taking in more context rows a sequence than this teaches c, not D(n)
MISFIT = 2.0  # a target forward that took over this times, or under 1 / this of, what T(r) predicted ...
MISFIT_STEPS = 8  # ... in this many steps in a row (doubling with each re-measurement) has T(r) measured again
DIP_TOLERANCE = 1.5  # a plausible T(r): no count's forward takes under 1 / this of a smaller count's ...
DIP_JITTER_S = 0.003  # ... less this many seconds, a shared 2-core machine's scheduling jitter
RATE_DECAY = 0.97  # per step of its kind, a band's realized / predicted rates fade by this ...
RATE_PRIOR = 8.0  # ... and start at 1 as if this many steps had been predicted exactly
DRAFT_FORGET = 64  # a count of drafting sequences D(n) has not seen in this many drafts may not stay dear (`CostCurve._forget`)


class CostCurve:
    """Seconds of one operation against its size (rows, sequences), as measured points: a new
    size far from every point becomes a point at what it measured; a new size near points
    scales them towards what it measured and becomes a point of its own, started from the
    curve's guess moved likewise. Between points: linear; below the first: the first; above the
    last: proportional to the size (the pessimistic guess for a size never seen).

    A near size once only scaled its neighbours. Between calibrated points 9 and 17 the plain
    step of 16 sequences ran at 56.8 ms where the line said 59.5, and plain steps of 13-15
    sequences pulled point 17 the other way; T(16) never settled, so at 16 streams plain decoding
    looked 5% dearer than it ran and `budget: auto` granted trees that lost 4-6% to it."""

    def __init__(self, points: dict[int, float] | None = None, forget_after: int | None = None):
        self.points: dict[int, float] = dict(sorted((points or {}).items()))
        # with `forget_after`: a point not observed in that many observations of the curve is
        # dropped where it stands above the proportional guess from the freshest point below it
        # (`_forget`); the observations so far, and each point's last
        self.forget_after = forget_after
        self.observed = 0
        self.last_seen: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.points)

    def __str__(self) -> str:  # for the logs: size -> milliseconds
        return ", ".join(f"{size}: {1000 * s:.1f} ms" for size, s in self.points.items())

    def predict(self, size: int) -> float:
        if not self.points:
            return 0.0
        sizes = list(self.points)  # ascending: the points are kept sorted
        if size <= sizes[0]:
            return self.points[sizes[0]]
        if size >= sizes[-1]:
            return self.points[sizes[-1]] * size / sizes[-1]
        # the plan prices ~30k sizes a pass at 64 streams: a scan of the points cost ~3 us each
        i = bisect.bisect_left(sizes, size)
        lo, hi = sizes[i - 1], sizes[i]
        if hi == size:
            return self.points[hi]
        w = (size - lo) / (hi - lo)
        return (1 - w) * self.points[lo] + w * self.points[hi]

    def observe(self, size: int, seconds: float) -> None:
        self.observed += 1
        self.last_seen[size] = self.observed
        self._observe(size, seconds)
        if self.forget_after is not None:
            self._forget()

    def _forget(self) -> None:
        """Drops the stale points (not observed in `forget_after` observations) that stand above
        the proportional guess from the nearest fresh point below them. A point priced too high
        is never corrected where its price keeps that size from being chosen: the drafter's pass
        over 4 sequences, learned at 30-38 ms from the warm-up's first passes at new shapes,
        priced drafting all four of a 4-stream batch out for good, where budget 4's passes took
        17 ms (a point priced too low is chosen, and so observed, and so corrected)."""
        fresh = None
        for size in list(self.points):
            if self.observed - self.last_seen.get(size, 0) <= self.forget_after:
                fresh = size
            elif fresh is not None and self.points[size] > self.points[fresh] * size / fresh:
                del self.points[size]

    def _observe(self, size: int, seconds: float) -> None:
        if size in self.points:
            self.points[size] += EMA * (seconds - self.points[size])
            return
        near = [p for p in self.points if p / 1.5 <= size <= p * 1.5]
        if not near:
            self.points[size] = seconds
            self.points = dict(sorted(self.points.items()))
            return
        guess = self.predict(size)
        factor = (seconds / max(guess, 1e-9)) ** EMA
        for p in near:
            self.points[p] *= factor
        self.points[size] = guess + EMA * (seconds - guess)
        self.points = dict(sorted(self.points.items()))


@dataclass
class Acceptance:
    """Realized against predicted hits of the drafter's nodes per probability bin (`bin_of`;
    module docstring: c_b)."""

    decay: float
    prior: "Acceptance | None" = None
    hits: list[float] = field(default_factory=list)  # [bin] the path's nodes in it, faded
    mass: list[float] = field(default_factory=list)  # [bin] its nodes' probabilities, faded

    def factor(self, bin_: int) -> float:
        base = self.prior.factor(bin_) if self.prior is not None else 1.0
        hits = self.hits[bin_] if bin_ < len(self.hits) else 0.0
        mass = self.mass[bin_] if bin_ < len(self.mass) else 0.0
        return _shrunk((hits, mass), base, PRIOR_WEIGHT)

    def factors(self) -> list[float]:
        """The factor of every bin, [len(BINS) + 1]."""
        return [self.factor(b) for b in range(len(BINS) + 1)]

    def observe(self, mass: list[float], hits: list[float]) -> None:
        """One round: per bin, `mass[b]` the summed probabilities of the tree's nodes it counts
        (before the factors) and `hits[b]` how many of them the target's path took."""
        grow = len(mass) - len(self.hits)
        if grow > 0:
            self.hits += [0.0] * grow
            self.mass += [0.0] * grow
        for i in range(len(self.hits)):
            self.hits[i] *= self.decay
            self.mass[i] *= self.decay
        for i, m in enumerate(mass):
            self.mass[i] += m
            self.hits[i] += float(hits[i]) if i < len(hits) else 0.0


@dataclass
class Regression:
    """y against x by least squares over faded observations, starting from y = x as if
    FORETOLD_PRIOR of spread in x had been seen on that line; its slope kept within [0, 1]."""

    decay: float
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, y, xx, xy

    def observe(self, x: float, y: float) -> None:
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self.sums[i] = self.decay * self.sums[i] + v

    def line(self) -> tuple[float, float, float]:
        """(mean x, mean y, slope): y = mean y + slope (x - mean x)."""
        w, sx, sy, sxx, sxy = self.sums
        if w <= 0.0:
            return 0.0, 0.0, 1.0
        mx, my = sx / w, sy / w
        slope = (sxy - w * mx * my + FORETOLD_PRIOR) / (sxx - w * mx * mx + FORETOLD_PRIOR)
        return mx, my, min(1.0, max(0.0, slope))

    def predict(self, x: float) -> float:
        mx, my, slope = self.line()
        return my + slope * (x - mx)


def bin_of(p: float) -> int:
    """A node's bin of its path probability p: 0 for p >= BINS[0], ..., len(BINS) below the last."""
    for b, edge in enumerate(BINS):
        if p >= edge:
            return b
    return len(BINS)


@dataclass
class TreeNodes:
    """A best-first tree's non-root nodes, in order, as Python lists: the policy's arithmetic
    over a tree of <= 65 nodes runs in plain Python (as torch ops on such small tensors it took
    ~0.3 ms a round at one stream)."""

    p: list[float]  # each node's path probability (`Tree.scores`, exponentiated)
    depth: list[int]
    chain: list[bool]  # on a lookup chain (calibrated already), not the drafter's alone

    @classmethod
    def of(cls, tree: Tree, most: int | None = None) -> "TreeNodes":
        """The first `most` nodes of `tree` (all by default)."""
        end = tree.size if most is None else min(tree.size, most + 1)
        chain = tree.on_chain()
        return cls(tree.scores[1:end].exp().tolist(), tree.depths[1:end].tolist(),
                   chain[1:end].tolist() if chain is not None else [False] * (end - 1))


def tree_gains(nodes: TreeNodes, factors: list[float]) -> list[float]:
    """E(n), the expected accepted tokens of the tree's first n nodes, n = 0 ... all of them
    (module docstring): node i adds its path probability to its depth's reach, times the factor
    c_b of its bin (`factors`) when the drafter proposed it, as is on a lookup chain (whose
    scores are calibrated already); the target's path reaches depth d with min(1, reach_1, ...,
    reach_d) (it takes at most one node per depth, and reaches d only via d - 1), and E(n) sums
    that over the depths."""
    reach = [0.0] * (1 + max(nodes.depth, default=0))
    out = [0.0]
    for p, depth, on_chain in zip(nodes.p, nodes.depth, nodes.chain):
        reach[depth] += p if on_chain else p * factors[bin_of(p)]
        total, low = 0.0, 1.0
        for r in reach[1:]:
            if r < low:
                low = r
                if low <= 0.0:
                    break
            total += low
        out.append(total)
    return out


@dataclass
class Hindsight:
    """A drafted tree, whole, kept until the sequence's committed tokens tell how far the
    target's path runs through it (`resolve`): the target's choice at every position is the
    committed token there (its own decoding, greedy or seeded by position), so the path through
    the nodes that were never verified is known a few steps later, exactly."""

    root: int  # the index of the tree's root token in the sequence's output
    tokens: list[int]  # [N] root first
    parents: list[int]  # [N]
    nodes: TreeNodes  # its non-root nodes, as the policy priced them
    raw: list[float]  # tree_gains of those nodes at the factors it was drafted with
    drafted: bool  # whether it holds any of the drafter's nodes (`_has_drafted`)
    path: list[int] = field(default_factory=lambda: [0])  # the target's path so far (node indices, root first)

    def resolve(self, output: list[int]) -> list[int] | None:
        """The target's path through the tree (root first) once `output` decides it -- a node
        with no child on it, or a leaf -- else None (the path reaches the output's end)."""
        while True:
            at, position = self.path[-1], self.root + len(self.path)
            children = [i for i in range(at + 1, len(self.tokens)) if self.parents[i] == at]
            if not children:
                return self.path
            if position >= len(output):
                return None
            taken = next((i for i in children if self.tokens[i] == output[position]), None)
            if taken is None:
                return self.path
            self.path.append(taken)


@dataclass
class SequenceEstimate:
    """What the policy knows of one sequence: its acceptance factors, its recent expected
    accepted tokens per bucket Q (None until it drafted once), and when it is probed next."""

    acceptance: Acceptance
    gain: dict[int, float] | None = None
    peak: dict[int, float] = field(default_factory=dict)  # per Q, the most any of its drafted steps gained
    idle: int = 0  # steps since it last drafted
    probe_after: int = FIRST_PROBE
    probed: int | None = None  # the band of the batch it was last probed in, until its next plan says if it drafts
    depth: int | None = None  # the depth of its last tree the policy chose (None until it drafted once) ...
    nodes: int | None = None  # ... and its drafted nodes
    drafted: int = 0  # its drafted trees so far
    context: int = 0  # target features its next draft takes in (the scheduler sets it each step) ...
    remaining: int | None = None  # ... and the tokens it may still emit (None: unknown)
    weight: float = 1.0  # what its expected tokens count for in this step's decisions (`drain_weights`)
    pending: list[Hindsight] = field(default_factory=list)  # its drafted trees whose outcome is not known yet

    def priced_context(self) -> float:
        """The context rows the plan charges its draft for: a sequence that drafts every round takes
        in its last round's tokens (~1 + its gain), and one idle for a while all of them since --
        a catch-up paid once, after which it drafts at the steady rows again. Charged whole to
        one step, the catch-up outweighed any one round's gain, so a sequence idle for long
        stayed plain where drafting paid: at 4 streams, the last sequence left of a pass (one
        stream) ran 20 steps at 32 tokens/s with one draft where budget 4 ran 40. So the rows past
        the steady ones are spread over the rounds it has left, at most HORIZON (its gain
        estimates turn over within ~10 rounds: a catch-up is worth paying only for rounds the
        estimate still vouches for)."""
        steady = 1 + max((self.gain or {0: 0.0}).values())
        if self.context <= steady or self.remaining is None:
            return float(self.context)
        rounds = max(1.0, min(HORIZON, self.remaining / steady))
        return steady + (self.context - steady) / rounds

    def draft_depth(self, most: int) -> int:
        """The depths its next draft asks of the drafter: DEPTH_MARGIN past its last chosen
        tree's, at least MIN_DRAFT_DEPTH, at most `most` (FIRST_DRAFT_DEPTH until it drafted
        once). The drafter's head runs once per depth (over 26k draft-vocabulary rows for
        SmolLM2's), and the trees chosen at one stream reach depth 3-6 of the 15 drafted: the
        rest was work no tree used. The margin lets the trees deepen step by step when acceptance
        rises. A first draft asked every depth before: at 64 streams a probe of 22-33 new
        sequences at once ran the head over 15 depths each, 150-330 ms of drafting a step where
        a plain step of the batch took ~100."""
        if self.depth is None:
            return max(1, min(most, FIRST_DRAFT_DEPTH))
        return max(1, min(most, max(MIN_DRAFT_DEPTH, self.depth + DEPTH_MARGIN)))

    def draft_width(self, most: int) -> int:
        """The nodes its next drafted tree is grown to (and the drafter's top-k per depth):
        WIDTH_FACTOR times its last chosen tree's, at least MIN_DRAFT_WIDTH, at most `most`
        (FIRST_DRAFT_WIDTH until it drafted once). The policy grants a best-first prefix of the
        tree, and at 1-64 streams chose 0-18 nodes of the 64 drafted (measured 2026-12-06): the rest was
        grown, priced and kept for hindsight each step (~0.4 ms a step of 4 sequences growing
        them alone). The factor lets a tree double each step as acceptance rises."""
        if self.nodes is None:
            return max(1, min(most, FIRST_DRAFT_WIDTH))
        return max(1, min(most, max(MIN_DRAFT_WIDTH, WIDTH_FACTOR * self.nodes)))


@dataclass
class Decision:
    q: int  # the step's verify rows per sequence (the bucket its largest tree fills)
    predicted: float  # expected accepted tokens of the whole step
    rate: float  # predicted output tokens per second
    nodes: list[int] = field(default_factory=list)  # per auto tree (choose's order): its drafted nodes


def by_bucket(curve: list[float], buckets: list[int]) -> dict[int, float]:
    """A gain curve (expected accepted tokens of a tree's first n nodes, n = 0 ... N) per
    bucket Q: its first Q - 1 nodes, or all N."""
    return {q: curve[min(q - 1, len(curve) - 1)] for q in buckets}


class BudgetPolicy:
    """The costs and acceptance estimates of one scheduler, and its two decisions per step."""

    def __init__(self, step_cost: CostCurve | None = None, cap: int = 64, packed: bool = False):
        self.cap = cap  # the most drafted nodes a sequence may be granted
        # whether a step's target cost follows its real rows (B + the nodes: padding rows are
        # not computed, workers.model.Packing) or B x Q; the scheduler sets it from its target
        self.packed = packed
        # packed: `verify` learns plain steps (B rows); the rows of a step's nodes add what the
        # calibrated curve adds from B to B + nodes rows (`shape`: the GEMMs' register tiles make
        # the first extra rows of a small batch nearly free), times a factor learned from the
        # steps with trees of batches of about that size (`_band`): faded sums of their measured
        # and their shape's extra seconds, from batches whose plain step was seen PLAIN_SEEN
        # times (others' T(B) is still the guess). `misfits`: the steps in a row whose forward
        # the curve mispredicted by over MISFIT (`misfit`); `recalibrations`: re-measurements so far
        self.recalibrations = 0
        self.calibrate(step_cost or CostCurve())  # verify, shape, _extra, _plain_seen, misfits
        self.draft = CostCurve(forget_after=DRAFT_FORGET)  # D(n), the context rows' part taken out ...
        self.context_row_s = 0.0  # ... c: seconds per context row, from drafts that took in many (`observe_step`)
        # the drafter's first pass in a process runs cold (it builds its draft-vocabulary head,
        # allocates its buffers): 69 ms against ~10 warm for SmolLM2's drafter here. Taken as
        # the draft's cost, it priced every tree out at one stream, and with no draft ever
        # predicted to pay no later pass corrected it. It is not observed.
        self._cold_draft = True
        self.other = CostCurve()  # the rest of a plain step (Q = 1) ...
        self.other_trees = CostCurve()  # ... and of a step with trees: building, walking and committing them
        self.batch = Acceptance(BATCH_DECAY)
        # per Q, the best gains seen lately: up at once to a higher gain, eased down by lower
        # ones, and while nothing drafts rising back to the best ever seen (`best_seen`), so a
        # workload that changed after a stretch of plain decoding is probed again
        self.hope: dict[int, float] | None = None
        self.best_seen: dict[int, float] = {}
        # of the last plan: the sequences (its indices) that draft as probes, not for their gains
        self.probed: set[int] = set()
        # per band of batch sizes: of its recent probes, how many were followed by drafting for
        # their gains at the sequence's next plan (faded [drafted, probes]), and the steps since
        # its last probe
        self._yield: dict[int, list[float]] = {}
        self._since_probe: dict[int, int] = {}
        # per band: the seconds of its steps since its last probe, and that probe's net cost
        # (`probe_cost`); the accepted tokens of the step under way (`observe_round` counts them)
        self._since_probe_s: dict[int, float] = {}
        self._probe_cost: dict[int, float] = {}
        self._step_accepted = 0
        # realized / predicted accepted tokens of the recent verified trees (faded sums), per
        # source (`drafted`: trees with the drafter's nodes; else a lookup chain alone): the
        # trees verified are those predicted to pay, so what the factors c_b leave of
        # optimism shows here, and every gain of that source is scaled by it
        # drafted -> [hits, mass]; and per group of ranks (`_size`): (drafted, group) -> [hits, mass]
        self._bias: dict[bool | tuple[bool, int], list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}
        # per Q: a drafted step's gains against its sequence's recent gains before it (`foretell`)
        self.foretold: dict[int, Regression] = {}
        # per (band, whether the step verified trees): faded [sum of realized / predicted step
        # rates, steps] (`tree_rate`), and the predicted rate of the step under way (`choose`)
        self._rates: dict[tuple[int, bool], list[float]] = {}
        self._foreseen: float | None = None

    def calibrate(self, step_cost: CostCurve) -> None:
        """T(r) as measured at start-up: the live curve starts from it, and the packed rows'
        `shape` keeps it, made non-decreasing (each point at most every later one's: a forward
        over more rows never costs less). A start-up curve of T(1) 37 ms, T(2) and T(3) 31
        priced 1-3 nodes of a lone sequence at nothing (T1(1 + n) - T1(1) <= 0, which no row
        factor scales up): auto granted 3 nodes at 282 of ~380 steps, predicted their verify
        at 32.9 ms, and it took 39.2. What the live steps learned on top of an earlier curve
        (the row factors, the plain steps seen) starts again."""
        self.verify = step_cost
        points, lowest = {}, math.inf
        for rows, seconds in sorted(step_cost.points.items(), reverse=True):
            lowest = min(lowest, seconds)
            points[rows] = lowest
        self.shape = CostCurve(points)
        # band, and (band, tree size `_size`) -> [measured, shape's] extra seconds
        self._extra: dict[int | tuple[int, int], list[float]] = {}
        self._plain_seen: dict[int, int] = {}
        self._since_plain: dict[int, int] = {}  # per batch size: its steps with trees since its last plain one
        self.misfits = 0
        self._node_floor: tuple = (None, 0.0)  # (batch, most) and its `node_floor`, until a step teaches the costs

    def misfit(self) -> bool:
        """Whether the live steps contradict T(r) so that it should be measured again: the target's
        forward took over MISFIT times (or under 1 / MISFIT of) what the curve predicted in
        MISFIT_STEPS steps in a row, twice as many after each re-measurement. A start-up curve
        measured while another process ran on the machine, and cached, said T(1) 1215 ms and
        T(129) 623 (the forward took 30 and 174): made non-decreasing, the shape was flat, every
        node looked free, and at one stream -- no plain step, so nothing the row factor could learn
        from -- auto verified 64-node trees at 0.53x budget 4's tokens/s for good."""
        return self.misfits >= MISFIT_STEPS << self.recalibrations

    def recalibrate(self, measured: CostCurve) -> bool:
        """T(r) measured again (`misfit`), over the row counts up to some largest: its points
        replace the curve's, and the curve's points above them are scaled by the ratio the largest
        measured count found there. A measurement that cannot be the machine's (`plausible`:
        another process ran during it) is not taken -- made non-decreasing it would price nodes
        at nothing -- and the next needs a misfit twice as long all the same. Returns whether it
        was taken."""
        self.recalibrations += 1
        if not plausible(measured.points):
            self.misfits = 0
            return False
        top = max(measured.points)
        scale = measured.points[top] / max(self.verify.predict(top), 1e-12)
        above = {r: s * scale for r, s in self.verify.points.items() if r > top}
        self.calibrate(CostCurve(measured.points | above))
        return True

    def sequence(self) -> SequenceEstimate:
        return SequenceEstimate(Acceptance(SEQ_DECAY, prior=self.batch))

    def _other(self, q: int) -> CostCurve:
        return self.other_trees if q > 1 and self.other_trees else self.other

    def verify_s(self, batch: int, q: int, nodes: int) -> float:
        """The target's forward over a step of `batch` sequences padded to Q rows, `nodes`
        drafted in all: T(B x Q), or packed T(B) + what the nodes' rows add (`node_rows_s`)."""
        if not self.packed:
            return self.verify.predict(batch * q)
        return self.verify.predict(batch) + self.node_rows_s(batch, nodes)

    def node_rows_s(self, batch: int, nodes: int) -> float:
        """Packed: what `nodes` rows add to a plain step of `batch` sequences: the calibrated
        curve's T(B + nodes) - T(B), times the learned `row_factor`."""
        return self._rows_s(batch)(nodes)

    def _rows_s(self, batch: int):
        """`node_rows_s` for one batch, as rows_s(nodes): T1(B) once, the row factor once per group
        of node counts (`_size`) -- the plan and `choose` price many node counts a step."""
        at, factors = self._shape_at(batch), {}

        def rows_s(nodes: int) -> float:
            if not nodes:
                return 0.0
            if _size(nodes) not in factors:
                factors[_size(nodes)] = self.row_factor(batch, nodes)
            return factors[_size(nodes)] * self._shape_extra(batch, nodes, at)

        return rows_s

    def _shape_at(self, batch: int) -> tuple[float, float]:
        """T1(B) of the calibrated shape, and the least a node adds to it: a quarter of the
        shape's mean slope over the next ROW_FLOOR_SPAN rows. A start-up curve of T(1) 33.2 ms
        and T(2) 32.1, made non-decreasing, is flat from 1 to 2 rows: one node of a lone
        sequence was priced at nothing, which no row factor scales up, and took 2.6 ms (auto
        verified 1-node trees at 29-32 tokens/s where plain steps ran 31)."""
        base = self.shape.predict(batch)
        return base, (self.shape.predict(batch + ROW_FLOOR_SPAN) - base) / (4 * ROW_FLOOR_SPAN)

    def _shape_extra(self, batch: int, nodes: int, at: tuple[float, float] | None = None) -> float:
        """T1(B + nodes) - T1(B) of the calibrated shape, at least the floor of `_shape_at` a
        node (`at`: `_shape_at(batch)` when already known)."""
        base, floor = self._shape_at(batch) if at is None else at
        return max(self.shape.predict(batch + nodes) - base, nodes * floor)  # floor >= 0: the shape never falls

    def row_factor(self, batch: int, nodes: int | None = None) -> float:
        """Measured over calibrated extra seconds of the recent steps with trees in batches of
        `batch`'s band (1 at first); with `nodes`, of those whose trees held about that many
        nodes in all (`_size`; the band's factor at first), at least ROW_FACTOR_FLOOR.
        The measured extra is a step's forward less the plain T(B), a difference of two noisy
        times: at 16 streams three plain steps of 118 ms (100 before) taught T(16), steps with
        4-9 nodes then took 90, and the band's factor fell to -0.41 -- every node priced as a
        saving. One factor for every batch once
        priced a 4-sequence batch's nodes at what one sequence's had taught (0.47: its first
        rows ride the GEMM's register tiles), and auto granted 10-22-node trees at 4 streams
        that lost 13% to budget 4. One factor for every tree size, at one stream, priced 1-3
        nodes 7 ms dearer than they ran and 16 or more 9 ms cheaper: the calibrated curve's
        shape is not the live steps'."""
        factor = max(ROW_FACTOR_FLOOR, _shrunk(self._extra.get(_band(batch), (0.0, 0.0)), 1.0, ROW_PRIOR_S))
        if nodes is None:
            return factor
        return max(ROW_FACTOR_FLOOR,
                   _shrunk(self._extra.get((_band(batch), _size(nodes)), (0.0, 0.0)), factor, SIZE_ROW_PRIOR_S))

    def _step_time(self, batch: int, fixed_drafting: int, fixed_nodes: int):
        """seconds(q, k, context): a step of `batch` sequences in which `k` auto sequences fill
        Q - 1 nodes each beside the fixed budgets' (`fixed_drafting` sequences, `fixed_nodes`
        nodes), the drafter taking in `context` rows. What does not change with Q and k is
        computed once: the plan prices ~100 (Q, k) a step at 16 streams, ~1.3 ms with every part
        predicted anew."""
        plain, rows_s = self.verify.predict(batch), self._rows_s(batch)
        draft, other = {}, {}

        def seconds(q: int, k: int, context: float = 0.0) -> float:
            verify = plain + rows_s(fixed_nodes + k * (q - 1)) if self.packed else self.verify.predict(batch * q)
            drafting = k + fixed_drafting
            if drafting not in draft:
                draft[drafting] = self.draft.predict(drafting) if drafting else 0.0
            if q not in other:
                other[q] = self._other(q).predict(batch)
            return verify + draft[drafting] + self.context_row_s * context + other[q]

        return seconds

    def baseline_due(self, batch: int, fixed_nodes: int = 0) -> bool:
        """Packed rows: whether a step of `batch` sequences, no fixed budget's nodes among them,
        decodes plainly (`rest`, no lookup chain) to measure T(B), the plain step every tree is
        weighed against: until that batch's plain step has been seen PLAIN_SEEN times, and after
        PLAIN_REFRESH steps with trees in a row. T(B) and the nodes' extra seconds are learned
        only from such steps: at 16 streams auto granted lookup chains from its first step,
        never saw a plain step of 16, priced trees by the start-up curve (6.1 s of tree steps
        predicted at 4.9) and ran 0.90x plain."""
        if not self.packed or fixed_nodes:
            return False
        return (self._plain_seen.get(batch, 0) < PLAIN_SEEN
                or self._since_plain.get(batch, 0) >= PLAIN_REFRESH)

    def rest(self, estimates: list[SequenceEstimate]) -> list[bool]:
        """`plan` for a step that measures the plain baseline (`baseline_due`): none drafts."""
        self.probed, self._step_accepted, self._foreseen = set(), 0, None
        for e in estimates:
            e.idle, e.weight = e.idle + 1, 1.0
        return [False] * len(estimates)

    def plan(self, batch: int, fixed_drafting: int, buckets: list[int], estimates: list[SequenceEstimate],
             fixed_nodes: int = 0, draining: bool = False) -> list[bool]:
        """Before drafting: which of the auto sequences (`estimates`) draft this step: those of
        the (Q, set) with the highest predicted rate from their recent gains, and the probes.
        `fixed_nodes`: the nodes the fixed budgets' trees ask for; `draining`: the batch drains,
        and each sequence's gains are weighed by its tokens left (`drain_weights`, kept in
        `SequenceEstimate.weight` for this step's `choose`)."""
        # a step starts here: a `choose` of a step whose rows were all preempted foresees nothing now
        self.probed, self._step_accepted, self._foreseen = set(), 0, None
        if not estimates:  # a batch of fixed budgets only: nothing to plan
            return []
        band = _band(batch)
        for e, w in zip(estimates, drain_weights(estimates) if draining else [1.0] * len(estimates)):
            e.weight = w
        due = {i for i, e in enumerate(estimates) if e.gain is None or e.idle >= e.probe_after}
        context = {i: e.priced_context() for i, e in enumerate(estimates)}
        lines = self.foretold_lines()  # once a plan: 64 sequences x 8 Q's each took 0.3 ms
        floors = (0.0, 0.0) if fixed_nodes else (self.node_floor(batch, (max(buckets) - 1) * batch),
                                                  self.draft_floor(batch, len(estimates)))
        known = {i: _weighed(self.foretell(e, lines), e.weight) for i, e in enumerate(estimates) if i not in due}
        chosen, known_rate = self._best(batch, fixed_drafting, fixed_nodes, buckets, known, context, floors)
        chosen = set(chosen)
        for i, e in enumerate(estimates):  # what the probes of its last step came to
            if e.probed is not None and i not in due:
                _fade_in(self._yield.setdefault(e.probed, [0.0, 0.0]), YIELD_DECAY, float(i in chosen), 1.0)
                e.probed = None
        self._since_probe[band] = self._since_probe.get(band, 0) + 1

        @functools.cache  # priced once a plan, and only where asked
        def hoped() -> tuple[list[int], float]:  # the best set were the due sequences' gains the best seen
            hopeful = {i: _weighed(self.hope if i in due else e.gain, e.weight) for i, e in enumerate(estimates)}
            return self._best(batch, fixed_drafting, fixed_nodes, buckets, hopeful, context, floors)

        worth = None if self.hope is None else lambda: hoped()[1] / max(known_rate, 1e-12) - 1.0
        if due and not self.probing(batch, worth):  # the due sequences wait (idle) for a band whose probes pay
            due = set()
        if due and self.hope is not None and max(buckets) > 1 and self._overdue(batch):
            whole = {i: e.context for i, e in enumerate(estimates)}  # a probe pays its catch-up whole
            due = self._affordable(batch, fixed_drafting, fixed_nodes, due, whole)
        elif due and self.hope is not None:  # probe those that could pay, were they the best seen
            due &= set(hoped()[0])
        due = self._rationed(batch, due, estimates)
        self.probed = due
        if due:
            self._since_probe[band], self._since_probe_s[band] = 0, 0.0
            # the probes draft anyway: the others share their drafter pass, D(k + probes) - D(probes)
            # a draft, not D(k) (no draft floor: the least share of a pass is not a shared pass's)
            shared, _ = self._best(batch, fixed_drafting + len(due), fixed_nodes, buckets, known, context,
                                   (floors[0], 0.0))
            chosen = set(shared)
        for i, e in enumerate(estimates):
            if i in chosen:
                e.idle, e.probe_after = 0, FIRST_PROBE
            elif i in due:
                e.idle, e.probe_after = 0, (e.probe_after if e.gain is None else min(2 * e.probe_after, LAST_PROBE))
                e.probed = band
            else:
                e.idle += 1
        return [i in chosen or i in due for i in range(len(estimates))]

    def foretold_lines(self) -> dict[int, tuple[float, float, float]]:
        """Per Q, the line of `foretold` (`Regression.line`)."""
        return {q: r.line() for q, r in self.foretold.items()}

    def foretell(self, estimate: SequenceEstimate,
                 lines: dict[int, tuple[float, float, float]] | None = None) -> dict[int, float]:
        """A sequence's gains per Q at its next step, from its recent ones (`SequenceEstimate.gain`,
        a moving average of its drafted steps' gains): what drafted steps gained against their
        sequence's recent gains before them, by regression (`foretold`), never above the most any
        of its own steps gained (`peak`: a sequence the drafter never helps stays plain). Recent
        gains are noisy, and a low stretch is followed by gains nearer the usual: at one stream on
        the mixed prompts, steps drafted after recent gains of 0.4-0.6 tokens at Q = 5 took 0.77
        with 4 nodes (the regression's slope there: ~0.6). Read as they stood, the plan left 18% of
        the steps plain below its threshold of ~0.45, tau fell to 1.90-2.17 from pass to pass and
        auto ran 0.99x budget 4 (48 requests, four passes); foretold: tau 2.19-2.23, 1.005x.
        `lines`: `foretold_lines()` when already known."""
        lines = self.foretold_lines() if lines is None else lines
        out = {}
        for q, g in (estimate.gain or {}).items():
            if q in lines:
                mx, my, slope = lines[q]
                g = min(my + slope * (g - mx), estimate.peak.get(q, g))
            out[q] = g
        return out

    def _affordable(self, batch: int, fixed_drafting: int, fixed_nodes: int, due: set[int],
                    context: dict[int, int]) -> set[int]:
        """An overdue probe (`_overdue`: none could pay, were it the best seen): of the due
        sequences, those -- fewest context rows first, at least one -- whose probe's predicted net
        cost (a drafter pass taking in their context rows, a node each, past the plain step) is
        within HOPELESS_SHARE of the band's seconds since its last probe. A band that had never
        probed (its last probe's cost 0) once probed every due sequence: at 64 streams all 64 new
        sequences at once, the drafter taking in their 8,700 prompt rows -- 1.4 s of drafting for
        78 accepted tokens, then 570 ms more for a wave of 51 in the band below; auto ran 0.91x
        plain that pass."""
        seconds = self._step_time(batch, fixed_drafting, fixed_nodes)
        allowance = HOPELESS_SHARE * self._since_probe_s.get(_band(batch), 0.0) + seconds(1, 0)
        chosen, rows = [], 0
        for i in sorted(due, key=lambda i: context.get(i, 0)):
            rows += context.get(i, 0)
            if chosen and seconds(2, len(chosen) + 1, rows) > allowance:
                break
            chosen.append(i)
        return set(chosen)

    def _rationed(self, batch: int, due: set[int], estimates: list[SequenceEstimate]) -> set[int]:
        """Of the sequences a step would probe, as many as the band's probes say will be worth
        it: the share `probe_yield` of them (at least one), those with the fewest context rows
        for the drafter to take in first. A band's probe is paid for by the sequences it finds
        worth drafting; where few are, probing them all at once costs them all to learn what a
        few tell. At 64 streams, as a wave's prefill brought the batch past 32 sequences, every
        pass probed 22-33 new sequences at once (each one's whole prompt for the drafter to take
        in, 67-135 nodes to verify): 370-720 ms a step where a plain step took ~100, ~1% of the
        pass, and none drafted after."""
        if len(due) <= 1:
            return due
        most = max(1, math.ceil(self.probe_yield(batch) * len(due) - 1e-9))
        return set(sorted(due, key=lambda i: (estimates[i].context, i))[:most])

    def probe_yield(self, batch: int) -> float:
        """Of the recent probes in batches of `batch`'s band, the share its sequence's next plan
        drafted for its gains (1 at first)."""
        return _shrunk(self._yield.get(_band(batch), (0.0, 0.0)), 1.0, YIELD_PRIOR)

    def probing(self, batch: int, worth: Callable[[], float] | None = None) -> bool:
        """Whether a batch of `batch` sequences probes the sequences due: while its band's
        probes are followed by drafting (`probe_yield` >= MIN_YIELD), else once every EXPLORE
        steps, and only once the band's seconds since its last probe are that probe's net cost
        over a share of them: what a probe is expected to return, `worth()` (how much the best
        gains seen, were the due sequences' gains those, would raise the step's predicted rate,
        relative) times `probe_yield`, between HOPELESS_SHARE and EXPLORE_SHARE (EXPLORE_SHARE
        without `worth`). At 4 streams on the mixed prompts, 27-37 steps of ~250 drafted
        probes (52-66 tokens/s against plain steps' 68-78) and 3-4 drafted for their gains: the
        probes bought almost nothing and cost ~3% of the run, auto ran 0.93x plain. At 16
        streams, once every 32 steps, a probe of the due sequences (a new wave's, each with its
        whole prompt for the drafter to take in) took 225 ms where its tokens took 130 plain:
        ~4% of the run. With EXPLORE_SHARE for every band, 16 streams still spent ~3% of their
        decoding on probes (5 a pass, ~100 ms each against ~57 ms plain steps) where one
        sequence found drafting adds a few per cent to a step of 16: auto ran 0.95-0.96x plain.
        One stream, where it adds ~40%, keeps EXPLORE_SHARE (a share that fell with the yield
        alone cost it more than it saved, measured 2026-12-04)."""
        yield_ = self.probe_yield(batch)
        if yield_ >= MIN_YIELD:
            return True
        if self._since_probe.get(_band(batch), 0) < EXPLORE:
            return False
        share = EXPLORE_SHARE if worth is None else min(EXPLORE_SHARE, max(HOPELESS_SHARE, worth() * yield_))
        return self._explore(batch, share)

    def _overdue(self, batch: int) -> bool:
        """Whether `batch`'s band probes its due sequences even where the best gains seen say
        they cannot pay: once EXPLORE steps have gone by without a probe, and its last probe's net
        cost is HOPELESS_SHARE of its seconds since. The best gains are learned only from drafted
        trees, so without this a low first estimate never changed: in `ddtree bench` the warm-up's
        8-token reply (its first tree, the hardest to draft) set them to 0.36 accepted tokens at
        Q = 5, no later sequence was ever probed, and auto decoded 10 prompts' 1200 steps plainly
        (1.09x plain; budget 4 ran 1.54x at tau 2.25)."""
        return self._explore(batch, HOPELESS_SHARE)

    def _explore(self, batch: int, share: float) -> bool:
        """EXPLORE steps of `batch`'s band have gone by without a probe, and its last probe's
        net cost is at most `share` of its seconds since."""
        band = _band(batch)
        return (self._since_probe.get(band, 0) >= EXPLORE
                and share * self._since_probe_s.get(band, 0.0) >= self.probe_cost(batch))

    def tree_rate(self, batch: int) -> float:
        """What the steps with trees of `batch`'s band realized of the rate predicted for them,
        over what its plain steps realized of theirs (each a faded mean of per-step ratios, from
        1 as if RATE_PRIOR steps had been predicted exactly), at most 1: `choose` and `plan`
        weigh an option with trees at this much of its predicted rate. The costs and gains are
        learnt piece by piece, and what they leave out shows only in the step as a whole: in
        a run on 2026-12-04, after one, four and sixteen streams, auto verified trees at 10% of the rounds at
        64 streams, accepted within 1% of the tokens it predicted, and ran 0.91x plain, where
        the same policy started afresh drafted at 1% and ran 0.99x (which piece was off was not
        found). Plain steps' own ratio (the host's swings, T(B) lagging behind them) is divided
        out. Measured again on 2026-12-04 it stayed at 0.98-1.00 at 16 and 64 streams, 0.91-1.00 at one."""
        band = _band(batch)
        plain = _shrunk(self._rates.get((band, False), (0.0, 0.0)), 1.0, RATE_PRIOR)
        trees = _shrunk(self._rates.get((band, True), (0.0, 0.0)), plain, RATE_PRIOR)
        return min(1.0, trees / max(plain, 1e-9))

    def tree_rates(self) -> dict[str, float]:
        """`tree_rate` of every band whose steps were seen, by its batch sizes ("1", "2-3", ...)."""
        return {_band_name(band): self.tree_rate(1 << (band - 1)) for band in sorted({b for b, _ in self._rates})}

    def probe_cost(self, batch: int) -> float:
        """The net cost of the last probe in batches of `batch`'s band: its step's seconds past
        what its tokens take at the predicted plain step's rate (0 before any, or when it paid)."""
        return self._probe_cost.get(_band(batch), 0.0)

    def _best(self, batch: int, fixed_drafting: int, fixed_nodes: int, buckets: list[int],
              gains: dict[int, dict[int, float]], context: dict[int, float] | None = None,
              floors: tuple[float, float] = (0.0, 0.0)) -> tuple[list[int], float]:
        """The sequences (keys of `gains`) whose drafting gives the highest predicted rate at
        the best Q: for each Q, the k with the largest gains, for every k; `context`: each
        one's rows for the drafter to take in (priced at `context_row_s`). `floors` (with no
        fixed budget's nodes: `node_floor` and `draft_floor`): a Q whose every gain is at most
        its Q - 1 nodes' floor and the draft's is passed over, as no set of it can beat the
        plain step (at 64 streams the plan priced ~300 sets a step to draft at ~1% of them).
        Returns the set and its predicted rate (weighed by `tree_rate`)."""
        best, best_rate = [], -1.0
        seconds = self._step_time(batch, fixed_drafting, fixed_nodes)
        context = context or {}
        trees = self.tree_rate(batch)
        node, draft = floors if buckets and buckets[0] == 1 else (0.0, 0.0)  # the plan gives none with fixed nodes
        for q in buckets:
            gain = {i: g.get(q, 0.0) for i, g in gains.items()}
            if q > 1 and (node or draft) and max(gain.values(), default=0.0) <= node * (q - 1) + draft:
                continue  # its k = 0 is plain decoding with a tree step's rest: no better than Q = 1's
            order = sorted(gain, key=lambda i: -gain[i])
            tokens, rows = float(batch), 0
            for k in range(len(order) + 1):
                if k:
                    if q == 1 or gain[order[k - 1]] <= 0:
                        break  # a root-only tree, or one that gains nothing, is not worth a draft
                    tokens += gain[order[k - 1]]
                    rows += context.get(order[k - 1], 0)
                rate = tokens / max(seconds(q, k, rows), 1e-9) * (trees if k or fixed_nodes else 1.0)
                if rate > best_rate:
                    best, best_rate = order[:k], rate
        return best, best_rate

    def node_floor(self, batch: int, most: int) -> float:
        """Packed rows: the expected accepted tokens a node must add for any set of up to `most`
        nodes to raise a step of `batch` sequences above the plain step's predicted rate (0 where
        this cannot be bounded). n nodes cost at least n c (c: the least seconds a node over up to
        `most` of them, `least_node_s`) on top of the plain step (a draft and a step with trees'
        rest only add to it) and gain at most n g, and (B + n g) / (S + n c) > B / S needs g > c B / S:
        c times the plain step's rate."""
        if self._node_floor[0] != (batch, most):  # the plan's and the lookup's of one step: computed once
            rate = self._plain_rate(batch)
            self._node_floor = (batch, most), rate * self.least_node_s(batch, most) if rate and most > 0 else 0.0
        return self._node_floor[1]

    def draft_floor(self, batch: int, most: int) -> float:
        """`node_floor`'s part for the drafter: what a drafting sequence must gain on top of its
        nodes' part, the least seconds the drafter's pass takes a sequence over up to `most` of
        them (D(k) / k: within D's segments monotone in k, so the least lies at a point or an end)
        times the plain step's rate."""
        if most <= 0 or not self.draft:
            return 0.0
        ends = {1, most} | {k for k in self.draft.points if k <= most}
        return self._plain_rate(batch) * min(self.draft.predict(k) / k for k in ends)

    def _plain_rate(self, batch: int) -> float:
        """B / (T(B) + O(B)), the plain step's predicted rate, where a step with trees' rest is no
        cheaper than a plain one's (packed rows); else 0: no floor holds."""
        if not self.packed or not self.verify or self._other(2).predict(batch) < self.other.predict(batch):
            return 0.0
        return batch / max(self.verify.predict(batch) + self.other.predict(batch), 1e-9)

    def least_node_s(self, batch: int, most: int) -> float:
        """min over n = 1 ... `most` of `node_rows_s(batch, n)` / n, exactly: within a group of
        node counts (`_size`) the row factor is one number and the calibrated shape is linear
        between its points (or its floor, a line through 0), and on a line a + b n the cost a node
        a / n + b is monotone, so the least lies where a group or a segment ends."""
        rows_s = self._rows_s(batch)
        ends = {1, most} | {p - batch for p in self.shape.points}
        for k in range(1, most.bit_length() + 1):
            ends |= {(1 << k) - 1, 1 << k}
        return min(rows_s(n) / n for n in ends if 1 <= n <= most)

    def lookup_floor(self, batch: int, most: int) -> float:
        """A step in which nothing drafts: the first-node probability at or below which no lookup
        chain verified alone can raise the step's predicted rate above the plain step's, so the
        scheduler builds and prices no such chain (0: every one). A chain's nodes gain at most p b
        each (p: its first node's probability, which no deeper node's exceeds; b: the largest rank
        correction of lookup chains, `bias`), so they pay only if p b > `node_floor`. At 64
        streams, building and pricing every sequence's chain took ~2 ms a step, for chains chosen
        at ~5% of the steps."""
        floor = self.node_floor(batch, most)
        most_bias = max(self.bias(False, 1 << g) for g in range(_size(max(most, 1))))  # ranks 1, 2, 4, ...
        return floor / max(most_bias, 1e-9)

    def curve(self, tree: Tree, estimate: SequenceEstimate, most: int, root: int | None = None) -> list[float]:
        """This step's expected accepted tokens of `tree`'s first n nodes, n = 0 ... min(its
        nodes, most). With `root` (the index of its root token in the sequence's output), the
        tree -- those nodes, all of them, whatever prefix is verified -- is kept for the factors
        and corrections to learn from once its outcome is known (`hindsight`)."""
        nodes, drafted = TreeNodes.of(tree, most), _has_drafted(tree)
        raw = tree_gains(nodes, estimate.acceptance.factors())
        if root is not None:
            kept = len(raw)
            estimate.pending.append(Hindsight(root, tree.tokens[:kept].tolist(), tree.parents[:kept].tolist(),
                                              nodes, raw, drafted))
        return self._corrected(raw, drafted)

    def hindsight(self, estimate: SequenceEstimate, output: list[int], finished: bool = False) -> None:
        """After a sequence's step: its kept drafted trees (`curve`) whose path the committed
        `output` now decides teach the factors and corrections (`_learn`), over all their nodes.
        Learned from the verified prefix alone, they learned from trees chosen because they were
        predicted to pay, and priced every other tree low: budget 4's trees, priced by auto's
        model at 4 streams, took 1.13x the tokens predicted (5.68 a step for 5.04), auto's own
        1.01x; a sequence's 4-node tree looked worth ~1.2 tokens where budget 4's took 1.37, the
        plan left ~3 of 4 sequences plain a step, and auto ran 0.93x budget 4. A finished
        sequence's undecided trees are dropped (the path past its end is not known)."""
        undecided = []
        for kept in estimate.pending:
            path = kept.resolve(output)
            if path is not None:
                self._learn(estimate, kept.nodes, kept.raw, path, kept.drafted)
            elif not finished:
                undecided.append(kept)
        estimate.pending = undecided

    def chain_curve(self, branch: Lookup, most: int) -> list[float]:
        """`curve` of the tree that is `branch`'s lookup chain alone, without growing it: the
        node at depth d reached with the product of the chain's first d probabilities
        (calibrated already: no factors)."""
        reach, expected, upto = 0.0, 0.0, [0.0]
        for logprob in branch.logprobs[:most]:
            reach += logprob
            expected += min(1.0, math.exp(reach))
            upto.append(expected)
        return self._corrected(upto, drafted=False)

    def _corrected(self, raw: list[float], drafted: bool) -> list[float]:
        """A gain curve (n = 0, 1, ...) with each node's marginal gain times the correction of
        its source at its rank (`bias`)."""
        out, correction, group = [raw[0]], 1.0, 0
        for n in range(1, len(raw)):
            if _size(n) != group:  # a new group of ranks (1, 2-3, 4-7, ...)
                group, correction = _size(n), self.bias(drafted, n)
            out.append(out[-1] + (raw[n] - raw[n - 1]) * correction)
        return out

    def bias(self, drafted: bool = True, rank: int | None = None) -> float:
        """Realized over predicted accepted tokens of the recent verified trees of one source
        (1 at first): trees with the drafter's nodes, or lookup chains alone; with `rank`, of
        their nodes of about that rank in the best-first order (`_size`; the source's ratio at
        first): how often the path took them over their marginal gains. One ratio for both
        sources let chat's lookup chains, taken alone at 0.16 accepted tokens where 0.28 were
        predicted, pull every drafted tree's gains down with them: on vicuna-bench at one
        stream it fell to 0.60, auto left 572 of ~900 steps plain and ran 0.89x budget 4, which
        drafted every step at tau 1.78. One ratio for every rank, at one stream on gsm8k-test,
        left 10-15-node trees predicted at 2.14-2.28 accepted tokens that took 1.62-1.83 (fewer
        than the 4-9-node trees took: 2.03-2.14), and auto granted them."""
        ratio = _shrunk(self._bias[drafted], 1.0, 1.0)
        if rank is None:
            return ratio
        return _shrunk(self._bias.get((drafted, _size(rank)), (0.0, 0.0)), ratio, SIZE_PRIOR)

    def choose(self, batch: int, buckets: list[int], curves: list[list[float]], draft_s: float,
               fixed_nodes: int = 0, weights: list[float] | None = None) -> Decision:
        """After drafting: each auto tree's nodes (a best-first prefix) and the step's Q, of the
        highest predicted rate, from the auto trees' gain `curves` this step (`curve`), the draft
        time already spent and the fixed budgets' nodes. Padded (B x Q rows): one Q, every auto
        tree its first Q - 1 nodes. Packed (the real rows): per tree, nodes in order of their
        marginal gain, as long as the rate rises (`_choose_nodes`). `weights`: per curve, what
        its tokens count for in the choice (`SequenceEstimate.weight`); the decision's predicted
        tokens and rate are the unweighted ones."""
        weights = weights or [1.0] * len(curves)
        if self.packed:
            decision = self._choose_nodes(batch, buckets, curves, draft_s, fixed_nodes, weights)
        else:
            best, trees = None, self.tree_rate(batch)
            for q in buckets:
                predicted = sum(c[min(q - 1, len(c) - 1)] for c in curves)
                weighed = sum(w * c[min(q - 1, len(c) - 1)] for c, w in zip(curves, weights))
                seconds = self.verify.predict(batch * q) + draft_s + self._other(q).predict(batch)
                rate = (batch + predicted) / max(seconds, 1e-9)
                corrected = (batch + weighed) / max(seconds, 1e-9) * (trees if q > 1 else 1.0)
                if best is None or corrected > best[0]:
                    best = corrected, Decision(q, predicted, rate, [q - 1] * len(curves))
            decision = best[1]
        self._foreseen = decision.rate
        return decision

    def _choose_nodes(self, batch: int, buckets: list[int], curves: list[list[float]], draft_s: float,
                      fixed_nodes: int, weights: list[float]) -> Decision:
        """Packed rows: a node costs the rows it adds wherever it is, so nodes are granted one at
        a time, the highest (weighed) marginal gain of any tree's next node first (a best-first
        tree's marginal gains fall, mostly), keeping the count of the best rate seen; it stops
        once STALE more nodes have not beaten it."""
        most = buckets[-1] - 1
        # what does not change with the nodes, once per step: T(B) and the draft, the rest
        plain = self.verify.predict(batch) + draft_s
        others = self.other.predict(batch), self._other(2).predict(batch)
        rows_s = self._rows_s(batch)

        def seconds(nodes: int) -> float:
            total = fixed_nodes + nodes
            return plain + rows_s(total) + others[1 if total else 0]

        trees = self.tree_rate(batch)

        def rate_of(tokens: float, added: int) -> float:  # the predicted rate weighed by `tree_rate`
            return tokens / max(seconds(added), 1e-9) * (trees if fixed_nodes + added else 1.0)

        def marginal(i: int, n: int) -> float:  # tree i's node n + 1, weighed
            return weights[i] * (curves[i][n + 1] - curves[i][n])

        nodes = [0] * len(curves)
        queue = [(-marginal(i, 0), i) for i, c in enumerate(curves) if len(c) > 1 and most > 0]
        heapq.heapify(queue)
        weighed, added = float(batch), 0
        best_rate, best_nodes, stale = rate_of(weighed, 0), list(nodes), 0
        while queue and stale < STALE:
            gain, i = heapq.heappop(queue)
            nodes[i] += 1
            weighed -= gain
            added += 1
            n = nodes[i]
            if n < min(len(curves[i]) - 1, most):
                heapq.heappush(queue, (-marginal(i, n), i))
            rate = rate_of(weighed, added)
            if rate > best_rate:
                best_rate, best_nodes, stale = rate, list(nodes), 0
            else:
                stale += 1
        widest = 1 + max(best_nodes, default=0)
        q = next((b for b in buckets if b >= widest), buckets[-1])
        predicted = sum(c[n] - c[0] for c, n in zip(curves, best_nodes))
        added = sum(best_nodes)
        return Decision(q, predicted, (batch + predicted) / max(seconds(added), 1e-9), best_nodes)

    def observe_round(self, estimate: SequenceEstimate, tree: Tree, gains: dict[int, float] | None,
                      path: list[int]) -> float:
        """One auto sequence's round: its tree as verified, this step's gains of its full
        tree (None when it did not draft), the target's accepted path (node indices, root
        first). Returns the round's predicted accepted tokens (what the acceptance model said
        before seeing it). A tree it did not draft (a lookup chain alone) teaches the factors and
        corrections here (`_learn`); a drafted one teaches them whole, in `hindsight`."""
        if gains is not None:  # it drafted: its gains of this step's tree, whatever Q was chosen
            # the mean of its first drafted trees, then a moving average: seeded with its first
            # tree alone (the first step of a reply, the hardest to draft), an EMA held chat
            # sequences' gains at ~0.2 accepted tokens through probe after probe
            old, estimate.drafted = estimate.gain or {}, estimate.drafted + 1
            for q, g in gains.items():  # what its recent gains foretold (`foretell`)
                if q in old:
                    self.foretold.setdefault(q, Regression(BIAS_DECAY)).observe(old[q], g)
                estimate.peak[q] = max(g, estimate.peak.get(q, g))
            weight = max(EMA, 1 / estimate.drafted)
            estimate.gain = old | {q: old[q] + weight * (g - old[q]) if q in old else g for q, g in gains.items()}
            hope = self.hope or {}
            self.hope = hope | {q: g if g >= hope.get(q, g) else hope[q] + HOPE_EASE * (g - hope[q])
                                for q, g in estimate.gain.items()}
            self.best_seen |= {q: max(g, self.best_seen.get(q, g)) for q, g in estimate.gain.items()}
        self._step_accepted += len(path) - 1
        if tree.size == 1:
            return 0.0
        nodes = TreeNodes.of(tree)
        raw = tree_gains(nodes, estimate.acceptance.factors())  # [n] the first n nodes' expected accepted tokens
        has_drafted = _has_drafted(tree)
        predicted = self._corrected(raw, has_drafted)[-1]
        if gains is None:  # a drafted tree (gains given) teaches in hindsight, whole (`hindsight`)
            self._learn(estimate, nodes, raw, path, has_drafted)
        return predicted

    def _learn(self, estimate: SequenceEstimate, nodes: TreeNodes, raw: list[float], path: list[int],
               has_drafted: bool) -> None:
        """What one tree's outcome teaches: its source's realized / predicted correction, whole and
        per group of ranks, and the factors of its drafter's nodes. `raw`: its nodes' `tree_gains`;
        `path`: the target's path through it (node indices, root first)."""
        _fade_in(self._bias[has_drafted], BIAS_DECAY, len(path) - 1, raw[-1])
        # per rank group: how many of its nodes the path took, over their marginal gains
        ranks = collections.Counter(_size(i) for i in path[1:])
        marginal = collections.defaultdict(float)
        for n in range(1, len(raw)):
            marginal[_size(n)] += raw[n] - raw[n - 1]
        for group in marginal.keys() | ranks.keys():
            _fade_in(self._bias.setdefault((has_drafted, group), [0.0, 0.0]), BIAS_DECAY, ranks[group],
                     marginal[group])
        # the factors learn the drafter's own nodes (off the chain): per bin, their probabilities
        # and how many the path took
        mass, hits, taken = [0.0] * (len(BINS) + 1), [0.0] * (len(BINS) + 1), set(path)
        for i, (p, on_chain) in enumerate(zip(nodes.p, nodes.chain), start=1):
            if not on_chain:
                b = bin_of(p)
                mass[b] += p
                hits[b] += i in taken
        estimate.acceptance.observe(mass, hits)
        self.batch.observe(mass, hits)

    def observe_step(self, batch: int, q: int, verify_s: float, drafting: int, draft_s: float, other_s: float,
                     nodes: int = 0, context: int = 0, accepted: int | None = None) -> None:
        """The step's measured times: the target's forward over its rows (batch x q; packed:
        batch + the `nodes` of its trees), the drafter's pass over `drafting` sequences taking
        in `context` rows, the rest; `accepted`: the auto trees' accepted tokens (what
        `observe_round` counted this step, unless given)."""
        if accepted is not None:
            self._step_accepted = accepted
        self._node_floor = (None, 0.0)  # what follows teaches the costs it is made of
        if not drafting and self.hope is not None:
            self.hope = {q: h + HOPE_RISE * (self.best_seen.get(q, h) - h) for q, h in self.hope.items()}
        step_s = sum(x for x in (verify_s, draft_s, other_s) if math.isfinite(x) and x > 0)
        band = _band(batch)
        plain_s = self.verify.predict(batch) + self.other.predict(batch)  # predicted before this step teaches
        foreseen, self._foreseen = self._foreseen, None
        if foreseen is None and not nodes:  # no tree to choose (a baseline step, none drafted): plain
            foreseen = batch / max(plain_s + max(draft_s, 0.0), 1e-9)
        if foreseen is not None and step_s > 0 and self.verify and self.other:
            realized = (batch + self._step_accepted) / step_s
            _fade_in(self._rates.setdefault((band, nodes > 0), [0.0, 0.0]), RATE_DECAY, realized / foreseen, 1.0)
        if self.probed:  # what the probe cost past its tokens' time as plain steps
            self._probe_cost[band] = max(0.0, step_s - plain_s * (batch + self._step_accepted) / batch)
        else:
            self._since_probe_s[band] = self._since_probe_s.get(band, 0.0) + step_s
        if math.isfinite(verify_s) and verify_s > 0:
            if self.verify:  # uncalibrated (no curve yet): nothing to contradict
                ratio = verify_s / max(self.verify_s(batch, q, nodes), 1e-12)
                self.misfits = self.misfits + 1 if not 1 / MISFIT <= ratio <= MISFIT else 0
            if not self.packed:
                self.verify.observe(batch * q, verify_s)
            elif not nodes:
                self.verify.observe(batch, verify_s)
                self._plain_seen[batch] = self._plain_seen.get(batch, 0) + 1
                self._since_plain[batch] = 0
            else:
                self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
                if self._plain_seen.get(batch, 0) >= PLAIN_SEEN:  # what the nodes' rows added to a plain step
                    extra, shape = verify_s - self.verify.predict(batch), self._shape_extra(batch, nodes)
                    for key in (_band(batch), (_band(batch), _size(nodes))):
                        _fade_in(self._extra.setdefault(key, [0.0, 0.0]), ROW_DECAY, extra, shape)
        if drafting and draft_s > 0:
            if self._cold_draft:
                self._cold_draft = False
            elif context > CONTEXT_ROWS * drafting and self.draft:  # many rows: what they cost past D(n)
                per_row = max(draft_s - self.draft.predict(drafting), 0.0) / context
                self.context_row_s += EMA * (per_row - self.context_row_s)
            else:  # a few rows a sequence (drafting step after step): D(n), their part taken out
                self.draft.observe(drafting, max(draft_s - self.context_row_s * context, 0.5 * draft_s))
        if other_s > 0:
            (self.other_trees if q > 1 else self.other).observe(batch, other_s)


def drain_weights(estimates: list[SequenceEstimate]) -> list[float]:
    """Per sequence of a draining batch, its tokens left over the mean of the batch's (1 each
    where any is unknown): the batch's last steps are its longest sequence's, and a token of a
    sequence with few left shortens nothing."""
    left = [e.remaining for e in estimates]
    if not left or any(r is None for r in left):
        return [1.0] * len(estimates)
    left = [max(r, 1) for r in left]
    mean = sum(left) / len(left)
    return [r / mean for r in left]


def _weighed(gains: dict[int, float] | None, weight: float) -> dict[int, float] | None:
    """Gains per Q, times `weight`."""
    return gains if gains is None or weight == 1.0 else {q: g * weight for q, g in gains.items()}


def _has_drafted(tree: Tree) -> bool:
    """Whether `tree` holds any node the drafter proposed (a tree without `sources` is the
    drafter's alone)."""
    return tree.size > 1 and (tree.sources is None or bool((tree.sources[1:] & DRAFTER).any()))


def _shrunk(sums, base: float, weight: float) -> float:
    """A measured ratio, faded (hits, mass), that starts from `base` as if `weight` of mass had
    been measured at it."""
    return (sums[0] + weight * base) / (sums[1] + weight)


def _fade_in(sums: list[float], decay: float, hits: float, mass: float) -> None:
    """Fades the (hits, mass) sums by `decay` and adds one observation."""
    sums[0] = decay * sums[0] + hits
    sums[1] = decay * sums[1] + mass


def _size(nodes: int) -> int:
    """The counts (a step's nodes, a node's rank in its tree) that share a correction: 1, 2-3,
    4-7, 8-15, 16-31, 32+."""
    return min(nodes.bit_length(), 6)


def _band(batch: int) -> int:
    """The batch sizes that share a row factor: 1, 2-3, 4-7, 8-15, ... (a power-of-two band)."""
    return batch.bit_length()


def _band_name(band: int) -> str:
    """The batch sizes of a band (`_band`): "1", "2-3", "4-7", ..."""
    return "1" if band == 1 else f"{1 << (band - 1)}-{(1 << band) - 1}"


def plausible(seconds: dict[int, float]) -> bool:
    """Whether a measured T(r) could be the machine's: a forward over more rows takes no less than
    1 / DIP_TOLERANCE of one over fewer, less DIP_JITTER_S (the measurement's own noise dips a
    little; a slow minute of a shared machine that fell on the small counts dips a lot: T(65)
    2488 ms, T(129) 623). The absolute slack is for forwards of a millisecond (a tiny model), where
    one descheduled moment doubles a count's median: CI saw T(5) 3.1 ms, T(9) 1.2 ms."""
    slowest = 0.0
    for _, s in sorted(seconds.items()):
        if s * DIP_TOLERANCE + DIP_JITTER_S < slowest:
            return False
        slowest = max(slowest, s)
    return True


def measurable(scheduler, counts: list[int]) -> list[int]:
    """The row counts of `counts` whose rows fit the scheduler's KV pool after the calibration
    context (a small pool cannot hold a step of max_step_tokens rows anyway; the curve goes on
    proportionally past its last point)."""
    context = calibration_context(scheduler.pool)
    fits = [r for r in counts if scheduler.pool.pages_for(context + r) <= scheduler.pool.free_pages]
    return fits or [1]


def calibration_context(pool) -> int:
    """CALIBRATION_CONTEXT, or 0 for a pool too small to hold it beside one row."""
    return CALIBRATION_CONTEXT if pool.pages_for(CALIBRATION_CONTEXT + 1) <= pool.free_pages else 0


def measure_step_cost(scheduler, counts: list[int], repeats: int = 3,
                      dense_repeats: int = DENSE_REPEATS) -> dict[int, float]:
    """Seconds of one target forward over r rows after CALIBRATION_CONTEXT committed tokens (none
    in a pool too small for them), per r in `counts` that fits the KV pool (`measurable`), through
    the scheduler's target backend and pool (its pages go back after): the least of its timings.
    What T(r) costs does not depend on the token values. Timed by the scheduler's clock.

    The counts are timed in rounds, a warm-up round and then `repeats` (the cheap counts, up to
    DENSE_COUNT rows, in at least `dense_repeats`), each round in its own shuffled order, so that a
    slow minute of a shared machine falls on different counts in each round; another process only
    ever adds time, so the least timing of a count is the machine's. One start-up curve, timed
    count after count, put T(9)/T(1) at 1.26 where four later measurements gave 1.51-1.64. One
    timed as the median of 3 rounds in rotation (neighbouring counts timed back to back in every
    round) said, on a 2-core AMD EPYC, T(3) 44 ms, T(4) 40, T(9) 49 and T(11)-T(16) 68-75 where
    T(17) took 65; nine shuffled rounds on the same machine then gave T(3) 36-38, T(4) 38-39, T(8)
    43-46, T(9) 49-50 (a tile's step), T(11) 51-53. On that shape a lone sequence's 3 nodes looked
    2 ms dear where they took 8, and 8 nodes as cheap as 7: auto verified 3- and 8-node trees at
    ~290 of ~315 steps a pass and ran 0.88x budget 4 at one stream."""
    target, pool, clock = scheduler.target, scheduler.pool, scheduler.clock
    counts = measurable(scheduler, counts)
    context = calibration_context(pool)
    capture = tuple(scheduler.drafter.target_layer_ids) if scheduler.drafter is not None else ()
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {r: [] for r in counts}
    cheap = [r for r in counts if r <= DENSE_COUNT]
    pages: list[int] = []
    pool.grow(pages, context + max(counts))  # every count's rows go to the same uncommitted slots
    try:
        tokens = torch.randint(0, 32, (1, context + max(counts)), generator=g)
        batch = lambda lo, hi: TargetBatch(  # noqa: E731 -- rows [lo, hi) after lo committed
            tokens=tokens[:, lo:hi], positions=torch.arange(lo, hi)[None],
            mask=torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()[None], tables=[pages], lengths=[lo],
            capture=capture, logits_to_keep=0, sampling=[GREEDY], seeds=[None],
            draw_positions=torch.arange(lo + 1, hi + 1)[None])
        if context:
            target.forward(batch(0, context))
        for round_ in range(max(repeats, dense_repeats if cheap else 0) + 1):  # round 0 warms up
            order = list(counts if round_ <= repeats else cheap)
            random.Random(round_).shuffle(order)
            for r in order:
                start = clock()
                target.forward(batch(context, context + r))
                if round_:
                    times[r].append(clock() - start)
    finally:
        pool.release(pages)
    return {r: min(t) for r, t in times.items()}
