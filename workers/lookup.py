"""Lookup branches: prompt lookup as a second, free source of tree candidates.

A context often repeats itself -- code quotes its prompt's names and signatures, a list repeats
its pattern, an answer restates the question. `NgramIndex` finds the latest earlier occurrence
of the context's last n tokens (n = MAX_NGRAM ... 1, the longest that occurs) and proposes the
tokens that followed it; `LookupCalibration` gives each of the chain's depths the probability
that the target takes it, from the chain's measured acceptance per (n-gram length, depth) -- per
sequence, shrunk towards the engine-wide rate while the sequence has few rounds. The chain and
those probabilities (a kernels.tree.Lookup) are merged into the drafter's best-first tree by
kernels.tree.grow_tree: a hit costs verify rows but no drafter work.

Lossless: the branch only changes which tree is verified, never the target's choice at a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..kernels.tree import Lookup, Tree
from .requests import accepted_sources

MAX_NGRAM = 3  # the longest context suffix matched
LOOKUP_TOKENS = 10  # the chain's length at most (the tree's budget cuts it further)
# Before any measurement: the probability that the target takes the chain's next token, by the
# matched n-gram's length (a longer match predicts better), and how many rounds it weighs.
PRIOR = {1: 0.2, 2: 0.35, 3: 0.5}
# A sequence's own rate leaves the engine-wide one only as its evidence nears the ~10 rounds
# SEQ_DECAY keeps: weighed less, the chains chosen to verify alone are those whose few rounds came
# out high by chance, and they are priced above what they take (a winner's curse).
PRIOR_WEIGHT = 8.0
SEQ_DECAY = 0.9  # a sequence's counts fade by this per round with a branch
BATCH_DECAY = 0.995  # the engine-wide counts fade slower
LEAST_PROBABILITY = 1e-4  # a chain depth never scores below this (log of 0 is no score)


class NgramIndex:
    """Where each n-gram (n = 1 ... max_ngram) of a growing token stream ends.

    Example: stream [5, 6, 7, 1, 5, 6]: its last 2-gram (5, 6) also ended at index 1, so
    `propose(3)` gives [7, 1, 5] (what followed it) and n-gram length 2. A continuation that runs
    into the stream's end continues with itself, so a repeating pattern is proposed whole:
    [4, 4, 4] -> (4, 4) ended at index 1 -> [4, 4, 4, ...].
    """

    def __init__(self, tokens: list[int] = (), max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> indices of its last token, ascending
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)

    def propose(self, length: int) -> tuple[list[int], int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest
        matching suffix, and that suffix's length; ([], 0) when no suffix occurred before."""
        last = len(self.tokens) - 1
        if length <= 0 or last < 1:
            return [], 0
        for n in range(min(self.max_ngram, last), 0, -1):
            ends = self.ends.get(tuple(self.tokens[last - n + 1 :]), [])
            earlier = ends[-2] if len(ends) >= 2 else None  # ends[-1] is the suffix itself
            if earlier is None:
                continue
            out: list[int] = []
            for i in range(length):
                at = earlier + 1 + i
                out.append(self.tokens[at] if at <= last else out[at - last - 1])
            return out, n
        return [], 0


@dataclass
class LookupCalibration:
    """How often the target took the chain's token at each depth, having reached the depth
    above it: faded counts per matched n-gram length, shrunk towards `prior` (the engine-wide
    calibration, or PRIOR) by PRIOR_WEIGHT rounds."""

    decay: float
    prior: "LookupCalibration | None" = None
    hits: dict[int, list[float]] = field(default_factory=dict)  # n-gram -> [depth - 1] taken
    trials: dict[int, list[float]] = field(default_factory=dict)  # n-gram -> [depth - 1] reached the parent

    def probability(self, ngram: int, depth: int) -> float:
        return self.probabilities(ngram, depth)[-1]

    def probabilities(self, ngram: int, depths: int) -> list[float]:
        """`probability` at depths 1 ... `depths`, the priors' in one pass each (a chain asked
        for its depths one at a time walked the priors once a depth: ~60k calls a pass at 64
        streams)."""
        if self.prior is not None:
            bases = self.prior.probabilities(ngram, depths)
        else:
            bases = [PRIOR[min(ngram, MAX_NGRAM)]] * depths
        hits, trials = self.hits.get(ngram, ()), self.trials.get(ngram, ())
        seen = len(trials)
        return [((hits[i] if i < seen else 0.0) + PRIOR_WEIGHT * base)
                / ((trials[i] if i < seen else 0.0) + PRIOR_WEIGHT) for i, base in enumerate(bases)]

    def branch(self, tokens: list[int], ngram: int) -> Lookup:
        probabilities = self.probabilities(ngram, len(tokens))
        return Lookup(tokens, [math.log(max(p, LEAST_PROBABILITY)) for p in probabilities], ngram)

    def observe(self, ngram: int, offered: int, followed: int) -> None:
        """One round: the chain's nodes at depths 1 ... `offered` were in the tree and the
        target's path followed the chain `followed` deep (0 ... offered)."""
        hits, trials = self.hits.setdefault(ngram, []), self.trials.setdefault(ngram, [])
        if offered > len(trials):
            hits += [0.0] * (offered - len(hits))
            trials += [0.0] * (offered - len(trials))
        for i in range(len(trials)):
            hits[i] *= self.decay
            trials[i] *= self.decay
        for i in range(min(offered, followed + 1)):  # depth i + 1 was tried once depth i was reached
            trials[i] += 1.0
            hits[i] += 1.0 if followed > i else 0.0
        if self.prior is not None:
            self.prior.observe(ngram, offered, followed)


def chain_outcome(tree: Tree, path: list[int]) -> tuple[int, int]:
    """(chain nodes in `tree`, how many of them the accepted `path` holds): the chain is one
    path from the root, so the accepted path follows it from the root and leaves it at most once."""
    chain = tree.on_chain()
    if chain is None:
        return 0, 0
    _, lookup_only, both = accepted_sources(tree, path)
    return int(chain.sum()), lookup_only + both


class SequenceLookup:
    """One sequence's lookup state: the index over its prompt and output and its calibration."""

    def __init__(self, prompt: list[int], engine_wide: LookupCalibration):
        self.prompt = prompt
        # built at the first branch asked for: at 64 streams, where a busy batch asks for none,
        # indexing every new sequence's prompt on arrival took ~90 ms of a 20 s pass
        self.index: NgramIndex | None = None
        self.calibration = LookupCalibration(SEQ_DECAY, prior=engine_wide)
        self.last: Lookup | None = None  # the branch proposed for the round in flight

    def propose(self, output: list[int], length: int = LOOKUP_TOKENS, floor: float = 0.0) -> Lookup | None:
        """The branch below the pending bonus output[-1]; the index first takes the output
        tokens it has not seen. None as well where the branch's first node would be no more
        probable than `floor` (no deeper node of a chain is more probable than its first)."""
        first = {n: self.calibration.probability(n, 1) for n in range(1, MAX_NGRAM + 1)} if floor else {}
        if floor and max(first.values()) <= floor:
            self.last = None  # no match could pass: the index need not catch up yet
            return None
        if self.index is None:
            self.index = NgramIndex(self.prompt)
        self.index.extend(output[len(self.index.tokens) - len(self.prompt) :])
        tokens, ngram = self.index.propose(length)
        if tokens and floor and first[ngram] <= floor:
            tokens = []
        self.last = self.calibration.branch(tokens, ngram) if tokens else None
        return self.last

    def observe(self, tree: Tree, path: list[int]) -> None:
        """The round's verified tree and accepted path (node indices, root first)."""
        if self.last is not None:
            offered, followed = chain_outcome(tree, path)
            if offered:
                self.calibration.observe(self.last.ngram, offered, followed)
        self.last = None
