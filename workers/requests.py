"""What a request is and what it gets back, shared by both loops (workers.scheduler, the batch;
workers.solo, one request at a time) and by everything that drives them.

Glossary: a round's *accepted* tokens are the drafted tokens on the path the target agrees
with; its *bonus* is the target's own next token after them; its *output* tokens are
accepted + bonus (so every round emits at least one token). tau = output tokens per round.

One owner per rule here: what a budget may be (`check_budget`), how many rows its tree
has (`tree_rows`), when a request stops (`check_stop`), the phase names of a round (`PHASES`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from ..config import GREEDY, SamplingParams, parse_budget
from ..kernels.tree import DRAFTER, LOOKUP, Tree

Budget = int | Literal["chain", "auto"]

# The phases of a round, as RoundStats times them (`<phase>_s`): draft (the drafter's pass),
# tree (building it), verify (the target's forward), commit (walk, KV moves, stop checks),
# transport (calls beyond the models' own work: Ray, serialization).
PHASES = ("draft", "tree", "verify", "commit", "transport")


def check_budget(budget: Budget, has_drafter: bool, max_budget: int | None = None) -> Budget:
    """`budget` if an engine with (or without) a drafter can run it, under an optional cap;
    ValueError otherwise (config.parse_budget says what a budget may be). "auto" without a
    drafter is plain decoding."""
    budget = parse_budget(budget, max_budget)
    if budget == "auto" and not has_drafter:
        return 0
    if budget != 0 and not has_drafter:
        raise ValueError(f"budget {budget!r} needs a drafter; use budget 0 for plain decoding")
    return budget


def tree_rows(budget: Budget, block_size: int) -> int:
    """Rows of a budget's largest tree, root included: budget + 1, or a chain's one node per
    drafted depth (block_size - 1) + 1. The verify pass pads to this (solo) or its bucket (batch)."""
    return block_size if budget == "chain" else budget + 1


@dataclass
class Request:
    prompt: list[int]  # prompt token ids (chat template already applied)
    max_tokens: int = 64
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded completion
    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = GREEDY
    budget: Budget | None = None  # overrides the engine's budget for this request
    lookup: bool | None = None  # lookup branches in its trees (workers.lookup); None = the engine's default
    topk: int | None = None  # the most children a tree node may have; None = the engine's default


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
    predicted: float | None = None  # budget "auto": the accepted tokens the policy expected of this round
    probe: bool = False  # budget "auto": it drafted the sequence's first tree, its acceptance still unknown
    # accepted drafted tokens proposed by (the drafter alone, the lookup branch alone, both)
    accepted_sources: tuple[int, int, int] = (0, 0, 0)
    verify_rows: int = 0  # the rows its verify pass held for it: the tree padded to the step's Q


@dataclass
class Result:
    tokens: list[int]  # completion token ids (an EOS token that ended it is included)
    text: str | None  # decoded completion, cut before a matched stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    seed: int | None  # the seed the draws used (the request's, or a random one); None if greedy
    prefill_s: float
    decode_s: float
    rounds: list[RoundStats] = field(default_factory=list)
    # a recording scheduler's (training data): [len(prompt) + len(tokens) - 1, layers x H] the
    # target's captured layer outputs at every token but the last
    features: torch.Tensor | None = None

    @property
    def tau(self) -> float:
        """Mean output tokens per round (the prefill's first token is not a round's)."""
        return (len(self.tokens) - 1) / len(self.rounds) if self.rounds else 0.0

    def phase_s(self) -> dict[str, float]:
        """Seconds per phase (PHASES), summed over the rounds."""
        return {p: sum(getattr(r, f"{p}_s") for r in self.rounds) for p in PHASES}


@dataclass
class Update:
    """What one step of a request emitted: the prefill's first token, then each round's."""

    new_tokens: list[int]  # completion tokens emitted since the previous update
    round: RoundStats | None = None  # the round that emitted them (None for the prefill's)
    result: Result | None = None  # set on the request's last update only


def accepted_sources(tree: Tree, path) -> tuple[int, int, int]:
    """RoundStats.accepted_sources of a round: the accepted path's nodes (root first) by the
    sources that proposed them (Tree.sources; a tree without them is the drafter's alone)."""
    accepted = len(path) - 1
    if tree.sources is None or accepted <= 0:
        return (accepted, 0, 0)
    bits = tree.sources[torch.as_tensor(path[1:], dtype=torch.long)]
    both = int((bits == DRAFTER | LOOKUP).sum())
    lookup_only = int((bits == LOOKUP).sum())
    return (accepted - both - lookup_only, lookup_only, both)


def check_request(request: Request) -> None:
    """ValueError for a request no engine can run."""
    if not request.prompt:
        raise ValueError("the prompt is empty")
    if request.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if request.topk is not None and request.topk < 1:
        raise ValueError("topk must be at least 1 (or None: as many children as the budget)")


def kept_per_depth(budget: Budget, nodes: int, topk: int | None) -> int:
    """The drafter's candidates a tree keeps per depth -- the most children a node may have: one
    for a chain, else the nodes it may grow, at most `topk`."""
    if budget == "chain":
        return 1
    return nodes if topk is None else min(nodes, topk)


def check_stop(request: Request, out: list[int], decode: Callable[[list[int]], str] | None) -> tuple[str | None, str | None]:
    """Cuts `out` (in place) at the first EOS, stop string or max_tokens; returns
    (finish_reason or None, the decoded text cut before a stop string, or None without `decode`).
    Without stop strings the text is decoded only once the request ends (None before): only the
    result reads it, and decoding a whole output every step cost each sequence ~30-50 us a step
    (at 64 streams ~2 ms of a ~150 ms step)."""
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
    if decode is None or (finish_reason is None and not request.stop):
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
