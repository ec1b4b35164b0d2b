"""Tree ops of the speculative round, as plain torch references.

Glossary (one round of one request):
- root: the bonus token of the previous round, already known to be the target's own token.
- node: a drafted token at some depth below the root; node indices are 0 (root) ... N-1.
- budget: the number of non-root nodes a tree may hold; a tree may hold fewer (`Tree.size`).
- accepted path: root plus the drafted nodes the target agrees with, in depth order.
- bonus: the target's own token after the accepted path; the root of the next round.

A tree's size is carried explicitly (tensor lengths, `VerifyBlock.num_nodes`); it is never
inferred from token values, zeros or -inf.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


_ROOT_PARTS = (torch.tensor([-1]), torch.tensor([0]), torch.tensor([0.0], dtype=torch.float64))  # parents, depths, scores


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] int64; tokens[0] is the root (bonus) token
    parents: torch.Tensor  # [N] int64; parents[0] = -1 and parents[i] < i
    depths: torch.Tensor  # [N] int64; depths[0] = 0, depths[i] = depths[parents[i]] + 1
    # [N] float64: each node's best-first score, the estimated log-probability that the target's
    # path reaches it (the drafter's path log-probability; with a lookup branch see `grow_tree`),
    # root 0; None for a tree not grown best-first
    scores: torch.Tensor | None = None
    # [N] int64: which sources proposed each node, bits DRAFTER | LOOKUP (root 0); None = the
    # drafter alone
    sources: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Real node count, root included."""
        return int(self.tokens.shape[0])

    def on_chain(self) -> torch.Tensor | None:
        """[N] bool: the nodes a lookup branch proposed (alone or with the drafter); None for a
        tree grown without one."""
        return None if self.sources is None else (self.sources & LOOKUP) != 0

    @classmethod
    def root_only(cls, root_token: int) -> "Tree":
        """The tree of a plain step: its root alone (made for every plain row of every step, so
        the parts all roots share are made once; no tree's tensors are written in place)."""
        return cls(torch.tensor([root_token]), *_ROOT_PARTS)

    def prefix(self, budget: int) -> "Tree":
        """The first `budget` non-root nodes. Of a best-first tree this is exactly the tree a
        smaller budget grows (the heap pops in the same order; the budget only stops it), and
        a valid tree of any tree (parents[i] < i)."""
        n = min(budget + 1, self.size)
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n],
                    self.scores[:n] if self.scores is not None else None,
                    self.sources[:n] if self.sources is not None else None)


@dataclass(frozen=True)
class Candidates:
    """The drafter's K best tokens per depth: all that growing a tree reads of its output, and
    small enough to cross a process boundary (a drafter actor returns these, never [D, V])."""

    logprobs: list[list[float]]  # [D][K] descending per depth; equal values ranked by token id
    tokens: list[list[int]]  # [D][K] the matching token ids

    @classmethod
    def top_k(cls, logprobs: torch.Tensor, k: int) -> "Candidates":
        """From per-depth log-probs [D, V]: the first k of a stable descending sort per row
        (equal values ranked by token id), without sorting the vocabulary. torch.topk finds the
        k best; they are ordered by (value desc, id asc); a row where a value equal to the k-th
        lies outside topk's pick (a tie at the boundary) takes the exact, slower route."""
        k = min(k, logprobs.shape[1])
        if logprobs.shape[0] == 0 or k <= 0:
            return cls([], [])
        logprobs = logprobs.double()
        # one more than k: a value outside the pick equal to the k-th is the (k+1)-th or ties it
        # (counting the k-th's equals over the whole row was a second pass over the vocabulary)
        vals, ids = logprobs.topk(min(k + 1, logprobs.shape[1]), dim=-1)
        boundary_tie = (vals[:, k] == vals[:, k - 1]).tolist() if vals.shape[1] > k else [False] * len(vals)
        vals, ids = vals[:, :k], ids[:, :k]
        kth = vals[:, -1:]
        ids, by_id = ids.sort(dim=-1)
        vals, order = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        values, tokens = vals.tolist(), ids.gather(-1, order).tolist()
        for d, tied in enumerate(boundary_tie):
            if tied:
                row = logprobs[d]
                candidates = (row >= kth[d]).nonzero().squeeze(-1)  # ascending ids
                top, at = row[candidates].sort(descending=True, stable=True)
                values[d], tokens[d] = top[:k].tolist(), candidates[at[:k]].tolist()
        return cls(values, tokens)


def build_tree(root_token: int, logprobs: torch.Tensor, budget: int, top_k: int | None = None) -> Tree:
    """Best-first DDTree over the drafter's per-depth distributions.

    logprobs [D, V]: log-probabilities for depths 1..D below the root. A prefix (r1, ..., rd) of
    per-depth ranks scores sum_i logprobs_sorted[i-1, ri]; the tree holds the `budget` best
    prefixes (fewer if there are not that many), K = min(top_k or budget, V) candidates per depth.
    Children score at most their parent (log-probs are <= 0), so a parent always pops before its
    children and gets a smaller index. Ties between equal scores pop in insertion order; equal
    log-probs within a depth rank by token id (a stable sort), so the tree is deterministic.

    Worked example: root 7, D = 2, V = 3, budget 3,
        logprobs = log([[.6, .3, .1],     depth 1: tokens 0 (.6), 1 (.3), 2 (.1)
                        [.1, .8, .1]])    depth 2: tokens 1 (.8), 0 (.1), 2 (.1)
    prefix scores: (0)=.6, (0,1)=.48, (1)=.3, (1,1)=.24, ... -> the 3 best are (0), (0,1), (1):
        tokens  [7, 0, 1, 1]
        parents [-1, 0, 1, 0]
        depths  [0, 1, 2, 1]
    """
    k = min(top_k if top_k is not None else budget, logprobs.shape[1])
    return grow_tree(root_token, Candidates.top_k(logprobs, k), budget)


# Tree.sources bits: the drafter's top-K at the node's depth holds its token; the lookup branch
# (prompt lookup) holds it at this place.
DRAFTER, LOOKUP = 1, 2


@dataclass(frozen=True)
class Lookup:
    """A lookup branch: the tokens that followed an earlier occurrence of the context's last
    n-gram (workers.lookup), as a chain below the root, with per depth the estimated
    log-probability that the target, having reached the chain's node at depth d - 1, takes the
    chain's token at depth d (calibrated from the chain's measured acceptance)."""

    tokens: list[int]  # [L] the chain's tokens, depth 1 ... L
    logprobs: list[float]  # [L] log P(the target takes tokens[d - 1] | it reached depth d - 1), <= 0
    ngram: int = 0  # length of the matched n-gram (what the calibration is keyed by)


def grow_tree(root_token: int, candidates: Candidates | None, budget: int, lookup: Lookup | None = None,
              max_children: int | None = None) -> Tree:
    """The best-first heap of `build_tree`, over the drafter's top-K candidates per depth and,
    when given, a lookup branch merged into the same tree.

    Every node's score estimates the log-probability that the target's path reaches it: a
    child scores its parent's score plus its source's log-probability -- the drafter's at the
    child's depth, or the lookup chain's at that depth. A node both sources propose (the chain's
    token is also one of the drafter's candidates under the same parent) is one node with the
    higher of the two scores: the heap pops it first, and the later pop of the same (parent,
    token) is dropped. Scores never rise along a path, so parents pop before their children and
    the first n nodes are the best-first tree of budget n (`Tree.prefix`). Without a lookup
    branch this is exactly the drafter's DDTree (the same pops in the same order).
    `max_children` (a request's topk): a node keeps its best children up to that many, whichever
    source proposed them; later pops under a full parent are dropped (None: no bound but K).

    Worked example: root 7; drafter depth 1: 4 (.6), 5 (.3); depth 2: 9 (.8), 4 (.1) (as
    probabilities); lookup chain [5, 6] with probabilities [.9, .5]; budget 3:
        pops: lookup 5 (.9, depth 1), then 5 -> 9 (.9 x .8 = .72), then 4 (.6); the budget ends
        before lookup 5 -> 6 (.45) and before the drafter's own 5 (.3), which, a duplicate of
        the first pop, would be dropped
        tokens  [7, 5, 9, 4]      sources [0, DRAFTER | LOOKUP, DRAFTER, DRAFTER]
        parents [-1, 0, 1, 0]
    """
    lp, tok = (candidates.logprobs, candidates.tokens) if candidates is not None else ([], [])
    depth_count = len(lp) if lp and lp[0] else 0
    chain = lookup.tokens if lookup is not None else []
    if budget <= 0 or (depth_count == 0 and not chain):
        return Tree.root_only(root_token)
    k = len(lp[0]) if depth_count else 0
    drafted = [set(ts) for ts in tok] if lookup is not None else []  # per depth: the drafter's candidate tokens

    tokens, parents, depths, scores, sources = [root_token], [-1], [0], [0.0], [0]
    placed: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    children = [0]  # per node: its children so far
    on_chain = {0: 0}  # node -> its depth on the lookup chain (the root is the chain's start)
    # heap entry: (-score, insertion order, parent node, depth (1-based), rank at that depth or
    # -1 for the lookup chain's node at that depth)
    heap, order = [], 0

    def push(score: float, parent: int, depth: int, rank: int) -> None:
        nonlocal order
        heapq.heappush(heap, (-score, order, parent, depth, rank))
        order += 1

    def expand(node: int) -> None:
        """The new node's best children: the drafter's best at the next depth, the chain's next."""
        depth = depths[node]
        if depth < depth_count:
            push(scores[node] + lp[depth][0], node, depth + 1, 0)
        if node in on_chain and depth < len(chain):
            push(scores[node] + lookup.logprobs[depth], node, depth + 1, -1)

    expand(0)
    while heap and len(tokens) - 1 < budget:
        neg_score, _, parent, depth, rank = heapq.heappop(heap)
        token = chain[depth - 1] if rank < 0 else tok[depth - 1][rank]
        if rank >= 0 and rank + 1 < k:  # the next sibling: same parent, next rank at this depth
            push(scores[parent] + lp[depth - 1][rank + 1], parent, depth, rank + 1)
        if (parent, token) in placed:  # proposed by both sources: it popped already, scored higher
            continue
        if max_children is not None and children[parent] >= max_children:
            continue
        children[parent] += 1
        children.append(0)
        node = len(tokens)
        placed[parent, token] = node
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg_score)
        if lookup is not None:
            if parent in on_chain and depth <= len(chain) and chain[depth - 1] == token:
                on_chain[node] = depth
            sources.append((DRAFTER if depth <= depth_count and token in drafted[depth - 1] else 0)
                           | (LOOKUP if node in on_chain else 0))
        expand(node)
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.tensor(scores, dtype=torch.float64),
                torch.tensor(sources) if lookup is not None else None)


def chain_tree(root_token: int, logprobs: torch.Tensor) -> Tree:
    """Vanilla DFlash: the top-1 token at every depth, one path of length D."""
    return build_tree(root_token, logprobs, budget=logprobs.shape[0], top_k=1)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: mask[i, j] is True when j is i or an ancestor of i.

    Example: parents [-1, 0, 1, 0] ->
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 1, 1, 0],
         [1, 0, 0, 1]]
    """
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


@dataclass
class VerifyBlock:
    """The target's input for one verify pass, possibly padded to a fixed length Q.

    Rows [0, num_nodes) are the tree; rows [num_nodes, Q) are padding: a valid position, a mask
    that sees only the row itself, and logits that are never read.
    """

    tokens: torch.Tensor  # [Q] int64
    positions: torch.Tensor  # [Q] int64, start + depth (padding: start)
    mask: torch.Tensor  # [Q, Q] bool, ancestor-or-self inside the tree, self only for padding
    num_nodes: int  # real tree size N <= Q

    @classmethod
    def allocate(cls, length: int) -> "VerifyBlock":
        return cls(
            torch.zeros(length, dtype=torch.int64),
            torch.zeros(length, dtype=torch.int64),
            torch.zeros(length, length, dtype=torch.bool),
            0,
        )

    def fill(self, tree: Tree, start: int) -> "VerifyBlock":
        """Overwrites every row of this (reused) block with `tree` at cache offset `start`;
        nothing of an earlier round survives."""
        n, length = tree.size, self.tokens.shape[0]
        if n > length:
            raise ValueError(f"tree of {n} nodes does not fit a verify block of {length}")
        self.tokens[:n] = tree.tokens
        self.tokens[n:] = tree.tokens[0]
        self.positions[:n] = start + tree.depths
        self.positions[n:] = start
        self.mask.zero_()
        self.mask[:n, :n] = ancestor_mask(tree.parents)
        self.mask[n:, n:].fill_diagonal_(True)
        self.num_nodes = n
        return self


def verify_block(tree: Tree, start: int, pad_to: int | None = None) -> VerifyBlock:
    """A fresh block for `tree`, padded to `pad_to` rows when given."""
    return VerifyBlock.allocate(pad_to or tree.size).fill(tree, start)


@dataclass(frozen=True)
class Walk:
    path: list[int]  # accepted node indices, root first; len(path) - 1 drafted tokens accepted
    bonus: int  # the target's token after the path


def walk_tree(tree: Tree, target_tokens: torch.Tensor) -> Walk:
    """target_tokens [N]: the target's choice at each node -- its argmax when greedy, or its
    seeded draw for the position after the node when sampling (one walk for both). From the root, follow the child whose token equals the target's choice at the
    current node; stop when none does; the choice there is the bonus.

    Example: tokens [7, 0, 1, 1], parents [-1, 0, 1, 0], target_tokens [0, 5, 9, 9]
    -> at root the target says 0 = node 1's token -> at node 1 it says 5, no child holds 5
    -> path [0, 1], bonus 5.
    """
    children: dict[tuple[int, int], int] = {}
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        if parent >= 0:
            children.setdefault((parent, token), node)
    choice = target_tokens.tolist()
    path = [0]
    while (nxt := children.get((path[-1], choice[path[-1]]))) is not None:
        path.append(nxt)
    return Walk(path=path, bonus=choice[path[-1]])


def compact_kv(k: torch.Tensor, v: torch.Tensor, row: int, start: int, path: list[int]) -> None:
    """Moves the accepted path's key/value slots start + path[i] to start + i (in place).

    k, v [L, B, Hkv, S, D]. Their RoPE positions (start + depth = start + i) are already right.
    Example: start 10, path [0, 2, 5] -> slots 10, 12, 15 are copied to 10, 11, 12.
    """
    src = torch.tensor(path, device=k.device) + start
    n = len(path)
    k[:, row, :, start : start + n] = k[:, row, :, src]  # advanced indexing copies first
    v[:, row, :, start : start + n] = v[:, row, :, src]
