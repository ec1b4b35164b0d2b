"""One request's side of each model, for the solo loop (workers.solo): the two backend
protocols and their in-process implementations.

A backend opens *sessions*; a session owns one request's caches on one model. The target
session prefills, then verifies a tree per round -- forward, the target's choice at every node,
the walk, and the KV compaction of the accepted path -- and returns only the accepted path, its
tokens and its features. The draft session turns the target's features and the bonus into the
drafter's top-K candidates per depth. (The batched step loop's backends, one forward over every
sequence, are workers.batch_backends.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from typing import Protocol

from ..config import SamplingParams
from ..kernels.batched import compact_kv_batch, top_k_candidates, tree_metadata, walk_batch
from ..kernels.tree import Candidates, Tree, VerifyBlock, compact_kv, walk_tree, verify_block
from ..kernels.tree_batch import TreeBatch
from ..kernels.triton_support import use_triton
from .drafter import Proposer
from .model import TargetModel, TreeBits


@dataclass
class Step:
    """What a prefill or a verify committed on the target."""

    tokens: list[int]  # output tokens: the accepted drafted tokens, then the bonus
    path: list[int]  # accepted node indices, root first (empty for a prefill)
    features: torch.Tensor | None  # [1, n, F]: features of the committed rows (prompt, or path)
    forward_s: float  # the target's forward pass
    walk_s: float  # token choice, walk and KV compaction


@dataclass
class Proposal:
    candidates: Candidates  # the drafter's top-K per depth
    draft_s: float  # the drafter's forward pass and top-K


class TargetBackend(Protocol):
    """Where the solo loop's target runs: this process (LocalTarget) or elsewhere."""

    def open(self, slots: int, capture: tuple[int, ...], q_len: int, static_shapes: bool) -> "TargetSessionLike":
        """A session whose KV cache holds `slots` positions; its passes return the outputs of
        the target layers `capture` as features; with static_shapes every verify pass has q_len rows."""


class TargetSessionLike(Protocol):
    start: int  # committed positions in the cache (the pending bonus's position)

    def prefill(self, prompt: list[int], sampling: SamplingParams, seed: int | None) -> "Step":
        """The prompt's KV rows; tokens = [the first completion token]; features [1, len(prompt), F]."""

    def verify(self, tree: Tree, sampling: SamplingParams, seed: int | None) -> "Step":
        """One pass over the tree's N nodes; tokens = accepted drafted tokens + the bonus;
        features [1, len(path), F] of the accepted path."""

    def close(self) -> None: ...


class DraftBackend(Protocol):
    """Where the solo loop's drafter runs: this process (LocalDrafter) or elsewhere."""

    block_size: int  # B: B - 1 drafted depths
    target_layer_ids: tuple[int, ...]  # target layers whose outputs the drafter reads

    def open(self, slots: int) -> "DraftSessionLike": ...


class DraftSessionLike(Protocol):
    def propose(self, features: torch.Tensor, bonus: int, start: int, top_k: int) -> "Proposal":
        """features [1, n, F] committed since the last call; bonus at position `start` ->
        the top-K candidates of each of the B - 1 drafted depths."""

    def close(self) -> None: ...


class TargetSession:
    """One request's KV cache on a (possibly sharded) target. Invariant between calls: the
    cache holds every committed token except the pending bonus, which sits at slot `start`."""

    def __init__(self, model: TargetModel, slots: int, capture: tuple[int, ...], q_len: int, static_shapes: bool):
        self.model = model
        self.capture = capture
        self.cache = model.new_cache(1, slots)
        self.q_len = q_len if static_shapes else None  # None: each pass is as long as its tree
        self.block = VerifyBlock.allocate(q_len) if static_shapes and not use_triton(self.cache.k) else None

    @property
    def start(self) -> int:
        return int(self.cache.lengths[0])

    def prefill(self, prompt: list[int], sampling: SamplingParams, seed: int | None) -> Step:
        t0 = time.perf_counter()
        tokens = torch.tensor([prompt], device=self.model.device)
        n = tokens.shape[1]
        positions = torch.arange(n, device=tokens.device)[None]
        out = self.model(tokens, positions, self.model.prefill_mask(n), self.cache, self.capture, logits_to_keep=1)
        self.cache.lengths += n
        t1 = time.perf_counter()
        first = int(self.model.parallel.choose(out.logits[0, -1:], sampling, seed, [n])[0])
        return Step([first], [], out.features, t1 - t0, time.perf_counter() - t1)

    def verify(self, tree: Tree, sampling: SamplingParams, seed: int | None) -> Step:
        if use_triton(self.cache.k):
            return self._verify_on_device(tree, sampling, seed)
        # Verify: one target pass over the whole tree, padded to the static length.
        t0 = time.perf_counter()
        start = self.start
        vb = self.block.fill(tree, start) if self.block is not None else verify_block(tree, start)
        dev = self.model.device
        out = self.model(vb.tokens[None].to(dev), vb.positions[None].to(dev), vb.mask[None].to(dev), self.cache, self.capture)
        t1 = time.perf_counter()

        # Walk: the target chooses a token at every node (argmax, or the seeded draw for the
        # position after the node); follow the path it agrees with, then its bonus token.
        after = (start + tree.depths + 1).tolist()
        choices = self.model.parallel.choose(out.logits[0, : vb.num_nodes], sampling, seed, after)
        walk = walk_tree(tree, choices)

        # Commit on the target: keep the path's KV rows (their RoPE positions are already right).
        compact_kv(self.cache.k, self.cache.v, 0, start, walk.path)
        self.cache.lengths += len(walk.path)
        features = out.features[:, walk.path] if out.features is not None else None
        tokens = tree.tokens[walk.path[1:]].tolist() + [walk.bonus]
        return Step(tokens, walk.path, features, t1 - t0, time.perf_counter() - t1)

    def _verify_on_device(self, tree: Tree, sampling: SamplingParams, seed: int | None) -> Step:
        """The same step on CUDA with the Triton kernels: mask metadata built on the device from
        the parent array, tree attention over compact bits, the choice at every node, the walk
        and the KV compaction without a host round-trip per node; the host reads the path once."""
        t0 = time.perf_counter()
        dev = self.cache.k.device
        batch = TreeBatch.of([tree], self.q_len or tree.size, dev)
        meta = tree_metadata(batch, self.cache.lengths)
        out = self.model(batch.tokens, meta.positions, TreeBits(meta.bits), self.cache, self.capture)
        t1 = time.perf_counter()
        choices = self.model.parallel.choose_rows(out.logits, [sampling], [seed], meta.positions + 1)
        walk = walk_batch(batch, choices)
        compact_kv_batch(self.cache.k, self.cache.v, self.cache.lengths, walk)
        n = int(walk.length[0])
        path = walk.path[0, :n].tolist()
        self.cache.lengths += n
        features = out.features[:, path] if out.features is not None else None
        tokens = tree.tokens[path[1:]].tolist() + [int(walk.bonus[0])]
        return Step(tokens, path, features, t1 - t0, time.perf_counter() - t1)

    def close(self) -> None:
        self.cache = self.block = None


class DraftSession:
    """One request's context cache on the drafter; it holds exactly the committed tokens."""

    def __init__(self, drafter: Proposer, slots: int):
        self.drafter = drafter
        self.cache = drafter.new_cache(1, slots)

    def propose(self, features: torch.Tensor, bonus: int, start: int, top_k: int) -> Proposal:
        t0 = time.perf_counter()
        logprobs = self.drafter.draft(self.cache, features, torch.tensor([bonus]), torch.tensor([start]))[0]
        return Proposal(top_k_candidates(logprobs, top_k), time.perf_counter() - t0)

    def close(self) -> None:
        self.cache = None


@dataclass
class LocalTarget:
    """The target in this process: sessions are plain objects."""

    model: TargetModel

    def open(self, slots: int, capture: tuple[int, ...], q_len: int, static_shapes: bool) -> TargetSession:
        return TargetSession(self.model, slots, capture, q_len, static_shapes)


@dataclass
class LocalDrafter:
    """A drafter (any Proposer) in this process."""

    proposer: Proposer

    @property
    def block_size(self) -> int:
        return self.proposer.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.proposer.target_layer_ids)

    def open(self, slots: int) -> DraftSession:
        return DraftSession(self.proposer, slots)
