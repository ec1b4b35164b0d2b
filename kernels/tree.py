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


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] int64; tokens[0] is the root (bonus) token
    parents: torch.Tensor  # [N] int64; parents[0] = -1 and parents[i] < i
    depths: torch.Tensor  # [N] int64; depths[0] = 0, depths[i] = depths[parents[i]] + 1
    # [N] float64: each node's best-first score, the drafter's log-probability of the path from
    # the root to it (root 0); None for a tree not grown best-first
    scores: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Real node count, root included."""
        return int(self.tokens.shape[0])

    @classmethod
    def root_only(cls, root_token: int) -> "Tree":
        one = torch.tensor
        return cls(one([root_token]), one([-1]), one([0]), one([0.0], dtype=torch.float64))

    def prefix(self, budget: int) -> "Tree":
        """The first `budget` non-root nodes. Of a best-first tree this is exactly the tree a
        smaller budget grows (the heap pops in the same order; the budget only stops it), and
        a valid tree of any tree (parents[i] < i)."""
        n = min(budget + 1, self.size)
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n],
                    self.scores[:n] if self.scores is not None else None)


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
        vals, ids = logprobs.topk(k, dim=-1)
        kth = vals[:, -1:]
        boundary_tie = ((logprobs == kth).sum(-1) != (vals == kth).sum(-1)).tolist()
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


def grow_tree(root_token: int, candidates: Candidates, budget: int) -> Tree:
    """The best-first heap of `build_tree`, over the drafter's top-K candidates per depth."""
    lp, tok = candidates.logprobs, candidates.tokens
    depth_count = len(lp)
    if budget <= 0 or depth_count == 0 or not lp[0]:
        return Tree.root_only(root_token)
    k = len(lp[0])

    tokens, parents, depths, scores = [root_token], [-1], [0], [0.0]
    # heap entry: (-score, insertion order, parent node, depth (1-based), rank at that depth)
    heap = [(-lp[0][0], 0, 0, 1, 0)]
    order = 1
    while heap and len(tokens) - 1 < budget:
        neg_score, _, parent, depth, rank = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg_score)
        if rank + 1 < k:  # the next sibling: same parent, next rank at this depth
            heapq.heappush(heap, (-(scores[parent] + lp[depth - 1][rank + 1]), order, parent, depth, rank + 1))
            order += 1
        if depth < depth_count:  # the best child of the new node
            heapq.heappush(heap, (-(scores[node] + lp[depth][0]), order, node, depth + 1, 0))
            order += 1
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.tensor(scores, dtype=torch.float64))


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
