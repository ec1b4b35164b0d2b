"""The two models' side of a Scheduler step, behind two small protocols, so that one step loop
runs over models in this process or over Ray actors (workers.distributed).

- `BatchTarget`: one target forward over a step's rows (a prefill chunk, or every tree padded
  to Q) into the paged KV storage, and every kept row's token choice, made where the logits are:
  full-vocabulary logits never cross a process boundary (a tensor-parallel shard gathers, between
  the shards, one (value, id) per greedy node and the logits of seeded rows only); then the
  moves of the accepted paths' KV rows.
- `BatchDrafter`: one drafter pass for every drafting sequence, returning each one's top-K
  candidates per depth (never [R, D, V] log-probs); it holds each sequence's context cache, by
  sequence id, between steps.

The page allocator stays with the Scheduler (workers.kv_pool.PageAllocator): a backend stores
keys and values where the block tables it is given say, and decides nothing about memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams
from ..kernels.tree import Candidates
from .kv_pool import KVStorage
from .graphs import GraphSettings, VerifyGraphs
from .model import TargetModel, TreeBits, packs_rows


@dataclass
class TargetBatch:
    """One target forward of a step, as it travels to the target's process(es)."""

    tokens: torch.Tensor  # [B, Q] int64
    positions: torch.Tensor  # [B, Q] int64 absolute positions (start + depth in a tree)
    mask: torch.Tensor | TreeBits  # [B, Q, Q] bool (a causal prefill chunk), or a tree batch's bits
    tables: list[list[int]]  # per row: its pages, covering lengths[b] + Q positions
    lengths: list[int]  # per row: committed positions in the pool; its block starts there
    capture: tuple[int, ...]  # target layers whose outputs come back as features
    logits_to_keep: int  # the last rows of each block that get a choice; 0 = every row
    sampling: list[SamplingParams]  # per row: its choice rule
    seeds: list[int | None]  # per row: the seed of its draws (None when greedy)
    draw_positions: torch.Tensor  # [B, K] int64: the position the token chosen at each kept row takes
    rows: list[int] | None = None  # per row: its tree's real rows (the rest of its Q padding), when known


@dataclass
class TargetStep:
    """What a target forward gives back."""

    choices: torch.Tensor  # [B, K] int64: the target's token after each kept row, by the row's rule
    features: torch.Tensor | None  # [B, Q, len(capture) * H] outputs of the captured layers
    forward_s: float  # the forward and the choice, in the target's process


class BatchTarget(Protocol):
    device: torch.device  # where the Scheduler builds a step's tensors (and walks)
    packs_rows: bool  # whether a step's cost follows its real rows, not B x Q (workers.model.Packing)

    def allocate(self, num_pages: int, page: int) -> None:
        """(Re)creates the KV storage: `num_pages` pages of `page` tokens."""

    def forward(self, batch: TargetBatch) -> TargetStep: ...

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies the KV rows of pool slots src [N] to dst [N] (every layer; overlaps are safe)."""


@dataclass
class DraftRows:
    """The drafting sequences of one step, as they travel to the drafter."""

    ids: list[int]  # sequence ids (whose context caches the drafter holds)
    features: list[torch.Tensor]  # per sequence [1, n, F]: target features committed since its last draft
    bonus: list[int]  # per sequence: its pending bonus token
    start: list[int]  # per sequence: the bonus's position (= its context length after the features)
    top_k: list[int]  # per sequence: candidates kept per depth
    # per sequence: the deepest drafted depth its tree can use (a tree of n drafted nodes reaches
    # depth n at most); the drafter's head and log-softmax run for each sequence's own depths only
    depths: list[int] | None = None  # None: every depth of the block


class BatchDrafter(Protocol):
    block_size: int  # B: B - 1 drafted depths
    target_layer_ids: tuple[int, ...]  # target layers whose outputs the drafter reads

    def open(self, seq_id: int, slots: int) -> None:
        """A context cache of `slots` positions for a sequence that starts drafting."""

    def propose(self, rows: DraftRows) -> list[Candidates]: ...

    def close(self, seq_id: int) -> None:
        """Drops the sequence's context cache (it finished, or was preempted)."""


class LocalBatchTarget:
    """A TargetModel (the whole model, or one tensor-parallel shard of it) and its KV storage
    in this process.

    `packs_rows`: whether a verify step computes its trees' real rows only (workers.model.Packing);
    None takes the device's choice (workers.model.packs_rows: the CPU packs, a GPU does not).
    False on the CPU runs the padded forward a GPU runs: every tree padded to the step's Q, every
    padding row computed and its keys and values written to the pool.

    `graphs`: the padded verify forwards captured per (batch bucket, row bucket) at `allocate`
    (workers.graphs; on CUDA as CUDA graphs), the steps outside them eager."""

    def __init__(self, model: TargetModel, packs_rows: bool | None = None, graphs: GraphSettings | None = None):
        self.model = model
        self.storage: KVStorage | None = None
        self._packs_rows = packs_rows
        self.graph_settings = graphs  # None: every verify eager
        self.graphs: VerifyGraphs | None = None  # captured at `allocate`, over its storage

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def packs_rows(self) -> bool:
        return packs_rows(self.model.device) if self._packs_rows is None else self._packs_rows

    def allocate(self, num_pages: int, page: int) -> None:
        """With graphs: one page more than the allocator hands out, the graphs' scratch page
        (workers.graphs), and every bucket captured over the new storage."""
        self.storage = self.graphs = None  # the old ones go first
        scratch = self.graph_settings is not None
        self.storage = KVStorage(self.model.config, num_pages + scratch, page, self.model.dtype, self.model.device)
        if scratch:
            pages = min(num_pages, -(-self.graph_settings.max_context // page))
            self.graphs = VerifyGraphs(self.model, self.storage, num_pages, pages, self.graph_settings)
            self.graphs.capture()

    def forward(self, batch: TargetBatch) -> TargetStep:
        t0 = time.perf_counter()
        dev = self.model.device
        q_len = batch.tokens.shape[1]
        rows = None  # a verify step whose trees leave padding rows: those are not computed
        if self.packs_rows and batch.rows is not None and not batch.logits_to_keep and sum(batch.rows) < len(batch.rows) * q_len:
            rows = torch.tensor(batch.rows, dtype=torch.int64, device=dev)
        out = None
        if self.graphs is not None and rows is None and isinstance(batch.mask, TreeBits) and not batch.logits_to_keep:
            mask = batch.mask.to(dev)
            if mask.rows is None:
                mask = TreeBits(mask.bits, torch.full((q_len,), q_len, dtype=torch.int64, device=dev).expand(len(batch.tables)))
            paged = self.storage.batch(batch.tables, batch.lengths)
            out = self.graphs.forward(batch.tokens.to(dev), batch.positions.to(dev), mask, paged.table, paged.lengths,
                                      batch.capture)
        if out is None:
            out = self.model(batch.tokens.to(dev), batch.positions.to(dev), batch.mask.to(dev),
                             self.storage.batch(batch.tables, batch.lengths), batch.capture, batch.logits_to_keep, rows)
        choices = self.model.parallel.choose_rows(out.logits, batch.sampling, batch.seeds, batch.draw_positions,
                                                  out.packing)
        if dev.type == "cuda":
            # CUDA launches return before the GPU is done, and the budget policy learns T(r) from
            # this time (at start-up and from every step): without the wait it saw launch time
            # alone, and the GPU's work was charged to the walk that reads the choices next
            torch.cuda.synchronize(dev)
        return TargetStep(choices, out.features, time.perf_counter() - t0)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.storage.move(src, dst)


class LocalBatchDrafter:
    """A drafter (any workers.drafter.Proposer) in this process, with its sequences' caches."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.block_size = proposer.block_size
        self.target_layer_ids = tuple(proposer.target_layer_ids)
        self.caches: dict[int, object] = {}

    def open(self, seq_id: int, slots: int) -> None:
        self.caches[seq_id] = self.proposer.new_cache(1, slots)

    def propose(self, rows: DraftRows) -> list[Candidates]:
        depths = rows.depths or [self.block_size - 1] * len(rows.ids)
        return self.proposer.candidates([self.caches[i] for i in rows.ids], rows.features, torch.tensor(rows.bonus),
                                        torch.tensor(rows.start), depths, rows.top_k)

    def close(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)
