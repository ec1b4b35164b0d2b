"""The target's KV memory as one pool of fixed-size pages shared by every running sequence.

A sequence owns a list of pages (its block table); its token at position p lives in slot
`pages[p // page] * page + p % page` of the pool. Pages are taken as a sequence grows and given
back when it ends or is preempted, so memory follows what sequences really hold -- never
`prompt + max_tokens` reserved up front. A verify pass's tree block is written at positions
start ... start + Q - 1 (scratch: the walk then moves the accepted path to start ... and the
rest is overwritten by later rounds before it is read).

Two halves: the PageAllocator (block tables and free pages: the Scheduler's, wherever it runs)
and the KVStorage (the tensors: the target's, one per tensor-parallel shard holding its own
key-value heads).

Layout: k, v [L, T, Hkv, D] with T = pages x page tokens, token-major, so that one index op
writes a whole batch's block; attention reads the pages in place (on CUDA the paged
tree-attention kernel through the block tables, on the CPU ddtree_cpu.tree_attention by slot
offsets), and elsewhere one index op gathers a batch's prefixes.

Worked example (page 4): a sequence with pages [5, 2] has positions 0-3 in slots 20-23 and
positions 4-7 in slots 8-11; its position 6 is slot 2 * 4 + 2 = 10.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..kernels.batched import paged_tree_attention
from ..kernels.tree_batch import pack_bits
from .model import (ModelConfig, TreeBits, block_attention, cpu_attention, dense_block_mask, uses_kernel,
                    uses_paged_kernel)


class PoolFull(RuntimeError):
    """The pool has fewer free pages than asked for."""


def block_table(tables: list[list[int]], device=None) -> torch.Tensor:
    """The block tables as one [B, P] int64 tensor on `device` (P = the most pages a row holds,
    at least 1; a shorter row's tail is page 0, never read)."""
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), max(width, 1), dtype=torch.int64)
    for row, pages in enumerate(tables):
        table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
    return table.to(device)


def page_slots(tables: list[list[int]], positions: torch.Tensor, page: int) -> torch.Tensor:
    """positions [B, N] (each within its row's pages `tables[b]`) -> pool slots [B, N]."""
    return table_slots(block_table(tables, positions.device), positions, page)


def table_slots(table: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """positions [B, N] (each within its row's pages) -> pool slots [B, N], through the block
    tables as one [B, P] tensor on the positions' device (nothing read back)."""
    return table.gather(1, positions // page) * page + positions % page


class PageAllocator:
    """Which pages are free and which each sequence holds (its block table): the pool's
    bookkeeping, without its tensors. It lives with the Scheduler; the storage lives with the
    target (in this process, or one KVStorage per tensor-parallel shard)."""

    def __init__(self, tokens: int, page: int):
        if page < 1 or tokens < page:
            raise ValueError(f"a KV pool of {tokens} tokens cannot hold one page of {page}")
        self.page = page
        self.num_pages = tokens // page
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, positions: int) -> int:
        """Pages that hold positions [0, positions)."""
        return -(-positions // self.page)

    def grow(self, pages: list[int], positions: int) -> None:
        """Extends the block table `pages` (in place) to hold positions [0, positions)."""
        need = self.pages_for(positions) - len(pages)
        if need > len(self._free):
            raise PoolFull(f"{need} pages needed, {len(self._free)} free")
        for _ in range(max(need, 0)):
            pages.append(self._free.pop())

    def shrink(self, pages: list[int], positions: int) -> None:
        """Gives back the pages of `pages` beyond those holding positions [0, positions)."""
        keep = self.pages_for(positions)
        while len(pages) > keep:
            self._free.append(pages.pop())

    def release(self, pages: list[int]) -> None:
        self.shrink(pages, 0)

    def slots(self, tables: list[list[int]], positions: torch.Tensor) -> torch.Tensor:
        """positions [B, N] (each within its row's pages) -> pool slots [B, N]."""
        return page_slots(tables, positions, self.page)

    def slots_of(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`slots` through the block tables as one [B, P] tensor (kv_pool.block_table)."""
        return table_slots(table, positions, self.page)


def pool_memory(device: torch.device) -> int:
    """The bytes a KV pool may take on `device`: a quarter of its free memory on a GPU, an
    eighth of the machine's available memory on the CPU. Asked where the pool lives: in the
    process that holds the model, or in each tensor-parallel shard (workers.distributed)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8


class KVStorage:
    """The pool's keys and values, k, v [L, T, Hkv, D] (T = pages x page tokens); a
    tensor-parallel shard holds the storage of its own key-value heads."""

    def __init__(self, config: ModelConfig, num_pages: int, page: int, dtype, device="cpu"):
        self.page = page
        shape = (config.num_hidden_layers, num_pages * page, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element

    def slots(self, tables: list[list[int]], positions: torch.Tensor) -> torch.Tensor:
        return page_slots(tables, positions, self.page)

    def batch(self, tables: list[list[int]], lengths: list[int]) -> "PagedBatch":
        """The rows of one forward: row b's committed prefix is positions [0, lengths[b])."""
        dev = self.k.device
        return PagedBatch(self, block_table(tables, dev), torch.tensor(lengths, dtype=torch.int64, device=dev))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies slots src [N] to dst [N] in every layer (gathered first, so overlaps are safe)."""
        if src.numel():
            src, dst = src.to(self.k.device), dst.to(self.k.device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]


@dataclass
class PagedBatch:
    """A forward's rows in the pool (TargetModel.forward's `cache`)."""

    pool: KVStorage
    table: torch.Tensor  # [B, P] int64 page ids (block_table): row b's pages cover lengths[b] + Q positions
    lengths: torch.Tensor  # [B] int64, committed positions per row; the block starts there

    def bind(self, block_mask, q_len: int, rows: torch.Tensor | None = None,
             batch_invariant: bool = False) -> "PagedView":
        return PagedView(self, block_mask, q_len, rows, batch_invariant)


class PagedView:
    """A PagedBatch bound to one forward. The block's keys and values go to the pool at
    positions lengths[b] ... + Q - 1; then each row attends over its context and block, by one
    of three routes:
    - on CUDA (blocks of up to ATTENTION_MAX_ROWS rows, or any block when `batch_invariant`;
      head widths the kernel tiles), the paged tree-attention kernel reads the pool in place through the block tables, with the
      lengths and the mask bits on the device: no gathered copy, nothing read back to the host;
    - on the CPU in fp32, ddtree_cpu.tree_attention reads the pool in place by slot offsets;
    - otherwise each row reads positions [0, span) back from the pool (span = the longest row's
      lengths + Q; a shorter row's tail is masked), the layout of a dense cache row, and the
      dense attention runs over it under a [B, 1, Q, span] mask (kernels' `slot_mask`)."""

    def __init__(self, batch: PagedBatch, block_mask, q_len: int, rows: torch.Tensor | None = None,
                 batch_invariant: bool = False):
        pool, lengths = batch.pool, batch.lengths
        self.rows = rows  # [B] real block rows per sequence (workers.model.Packing), or None
        # the kernel's tiles and splits fixed whatever the batch; every block on the kernel route
        self.batch_invariant = batch_invariant
        dev = lengths.device
        self.pool, self.lengths = pool, lengths
        self.table = batch.table.to(dev)  # [B, P] page ids
        block = lengths[:, None] + torch.arange(q_len, device=dev)  # [B, Q] the block's positions
        self.write_slots = (self.table.gather(1, block // pool.page) * pool.page + block % pool.page).view(-1)
        self.kernel = uses_paged_kernel(pool.k, q_len, batch_invariant)
        self.cpu = not self.kernel and cpu_attention(pool.k, q_len)
        # the CPU kernel attends the real rows of a packed forward as they are (`attend_rows`)
        self.packs = self.cpu and rows is not None
        self._row_slots: torch.Tensor | None = None  # the real rows' write slots, at the first layer
        if self.kernel:
            tree = isinstance(block_mask, TreeBits)
            self.bits = (block_mask.bits.to(dev) if tree
                         else pack_bits(dense_block_mask(block_mask.to(dev), len(self.table))))  # [B, Q, W] int32
            # [B] real rows: a packed forward's, else the tree sizes the mask carries (or None: all real)
            self.kernel_rows = rows if rows is not None or not tree else block_mask.rows
            return
        self.span = int(lengths.max()) + q_len
        cols = torch.arange(self.span, device=dev)[None, :]
        valid = cols < (lengths[:, None] + q_len)
        cols = torch.where(valid, cols, 0)
        self.read_slots = (self.table.gather(1, cols // pool.page) * pool.page + cols % pool.page).view(-1)  # [B * span]
        if self.cpu:  # in place: key (slot, head 0) sits at slot * Hkv * D
            self.offsets = self.read_slots.view(len(self.table), self.span) * (pool.k.shape[2] * pool.k.shape[3])
            self.mask = dense_block_mask(block_mask, len(self.table))
        else:
            self.attention = block_attention(block_mask, lengths, self.span, uses_kernel(block_mask, pool.k))

    def attend(self, layer: int, q, k, v):
        """q [B, Hq, Q, D]; k, v [B, Hkv, Q, D] of the block -> [B, Hq, Q, D]."""
        b, kv_heads, _, head_dim = k.shape
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]
        pool_k.index_copy_(0, self.write_slots, k.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(pool_k.dtype))
        pool_v.index_copy_(0, self.write_slots, v.transpose(1, 2).reshape(-1, kv_heads, head_dim).to(pool_v.dtype))
        if self.kernel:
            return paged_tree_attention(q, pool_k, pool_v, self.table, self.lengths, self.bits, self.pool.page,
                                        self.kernel_rows, self.batch_invariant)
        if self.cpu:
            return torch.ops.ddtree_cpu.tree_attention(q, pool_k, pool_v, self.offsets, kv_heads, head_dim, self.lengths,
                                                       self.mask, 1.0 / math.sqrt(head_dim), self.rows)
        keys = pool_k.index_select(0, self.read_slots).view(b, self.span, kv_heads, head_dim).transpose(1, 2)
        values = pool_v.index_select(0, self.read_slots).view(b, self.span, kv_heads, head_dim).transpose(1, 2)
        return self.attention(q, keys, values)

    def attend_rows(self, layer: int, q, k, v, packing) -> torch.Tensor:
        """`attend` of a packed forward's real rows (workers.model.Packing), where `packs`: q
        [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq, D], each row computed as in the padded layout
        (the padding rows' slots are left as they were: no row reads them)."""
        if self._row_slots is None:
            self._row_slots = self.write_slots.index_select(0, packing.index)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        pool_k, pool_v = self.pool.k[layer], self.pool.v[layer]
        pool_k.index_copy_(0, self._row_slots, k.to(pool_k.dtype))
        pool_v.index_copy_(0, self._row_slots, v.to(pool_v.dtype))
        return torch.ops.ddtree_cpu.tree_attention(q, pool_k, pool_v, self.offsets, kv_heads, head_dim,
                                                   self.lengths, self.mask, 1.0 / math.sqrt(head_dim), self.rows, True)
