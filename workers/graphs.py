"""CUDA graphs of the target's verify forward, one per (batch bucket, row bucket).

Captured once at start-up over static buffers (`StepBuffers`: tokens, positions, mask bits,
real rows per block, block tables, lengths), a graph replays every kernel of the padded verify
forward (`verify_forward`) in one launch, so the host's time per step no longer grows with the
target's layers. A step of B sequences x Q rows (Q is a verify bucket already) runs the graph of
the smallest batch bucket >= B at row bucket Q: its inputs are copied into that graph's
buffers, and the buffer rows past B are padding sequences -- length 0, no real row (each of its
rows sees only itself), every block-table entry the scratch page: a page of the pool that the
allocator never hands out, so what they write lands where no sequence reads. Within a sequence
the padding rows of its tree write to its own pages past its length (the scheduler reserves
length + Q positions), which later rounds overwrite before they read them.

A step outside the captured set -- more sequences than the largest batch bucket, a row count
not captured, a block table wider than the buffers, other captured layers -- runs the forward
eagerly, logged once per shape. Capture stops at the allowance (`GraphSettings.max_bytes` of
graph memory, `max_s` seconds; the largest buckets are captured first, so the smaller ones
share their memory pool); the buckets left out run eagerly. `GraphStats` holds the count, the
seconds and the bytes: the start-up log line and the metric.

Off CUDA there is nothing to capture: a bucket's `Replay` runs the forward over the same
buffers whenever it is replayed, so the bucket choice, the padding, the buffers' reuse and
the fallback are the GPU's, with the real forward (tests/test_gpu_step.py).

Example: batch buckets (1, 2, 4), row buckets (1, 17), a step of 3 sequences x 17 rows -> the
(4, 17) graph; its buffers' row 3 is a padding sequence; logits [4, 17, V] come back as [3, 17, V].
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..kernels.tree_batch import pack_bits, words
from .kv_pool import KVStorage, PagedBatch
from .model import ATTENTION_MAX_ROWS, ForwardOutput, TargetModel, TreeBits

logger = logging.getLogger("ddtree")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sequences a captured step holds


@dataclass(frozen=True)
class GraphSettings:
    """Which verify forwards are captured, and the allowance capturing them may take."""

    batch_buckets: tuple[int, ...] = BATCH_BUCKETS  # sequences per step, cut at the scheduler's max_num_seqs
    row_buckets: tuple[int, ...] = (1, 2, 3, 5, 9, 17, 33, 65)  # verify rows per sequence (VERIFY_BUCKETS entries)
    max_bytes: int = 2 << 30  # graph memory in all; buckets past it run eagerly
    max_s: float = 60.0  # capture time in all; buckets past it run eagerly
    max_rows: int = 1024  # sequences x rows of the largest captured step (the scheduler's max_step_tokens)
    max_context: int = 4096  # positions a captured step's sequences hold (their block tables' width); longer: eager
    capture_layers: tuple[int, ...] = ()  # target layers whose features the graphs return (the drafter's)


@dataclass
class GraphStats:
    captured: int = 0  # graphs captured
    seconds: float = 0.0  # capturing them, warm-ups included
    bytes: int = 0  # the graphs' memory (what the caching allocator reserved while capturing)
    left_out: list[tuple[int, int]] = field(default_factory=list)  # (batch, rows) buckets the allowance left out
    eager_steps: int = 0  # verify steps that ran eagerly (outside the captured set)
    replays: int = 0


@dataclass
class StepBuffers:
    """The static inputs of one captured bucket, at fixed addresses: a step's inputs are copied
    in (`fill`), the rows past its sequences are padding sequences."""

    tokens: torch.Tensor  # [B, Q] int64
    positions: torch.Tensor  # [B, Q] int64 (start + depth; padding sequences: 0)
    bits: torch.Tensor  # [B, Q, W] int32 tree mask bits (kernels.tree_batch)
    rows: torch.Tensor  # [B] int64 real rows per block (rows past it see only themselves; padding sequences: 0)
    table: torch.Tensor  # [B, P] int64 page ids (padding sequences, and past a row's pages: the scratch page)
    lengths: torch.Tensor  # [B] int64 committed positions (padding sequences: 0)
    scratch: int  # the page no sequence owns
    pad_bits: torch.Tensor  # [Q, W] int32: a padding sequence's rows, each seeing only itself

    @classmethod
    def allocate(cls, batch: int, q_len: int, pages: int, scratch: int, device) -> "StepBuffers":
        new = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        buffers = cls(new(batch, q_len), new(batch, q_len), new(batch, q_len, words(q_len), dtype=torch.int32),
                      new(batch), new(batch, pages), new(batch), scratch,
                      pack_bits(torch.eye(q_len, dtype=torch.bool, device=device)))
        buffers.pad(0)
        return buffers

    @property
    def shape(self) -> tuple[int, int, int]:
        """(sequences, rows per sequence, pages per sequence) the buffers hold."""
        return self.tokens.shape[0], self.tokens.shape[1], self.table.shape[1]

    def pad(self, first: int) -> None:
        """Rows `first` ... of the buffers become padding sequences."""
        self.tokens[first:] = 0
        self.positions[first:] = 0
        self.bits[first:] = self.pad_bits
        self.rows[first:] = 0
        self.table[first:] = self.scratch
        self.lengths[first:] = 0

    def fill(self, tokens: torch.Tensor, positions: torch.Tensor, mask: TreeBits, table: torch.Tensor,
             lengths: torch.Tensor) -> None:
        """A step's inputs (tokens, positions [b, Q]; mask bits [b, Q, W] with each block's
        real rows; table [b, p], p <= P; lengths [b]) into rows [0, b); the rest padding."""
        b, p = tokens.shape[0], table.shape[1]
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)
        self.bits[:b].copy_(mask.bits)
        self.rows[:b].copy_(mask.rows)
        self.table[:b, :p].copy_(table)
        self.table[:b, p:] = self.scratch  # never read: a row's positions stay inside its pages
        self.lengths[:b].copy_(lengths)
        if b < self.tokens.shape[0]:
            self.pad(b)


def verify_forward(model: TargetModel, pool: KVStorage, buffers: StepBuffers,
                   capture_layers: tuple[int, ...] = ()) -> ForwardOutput:
    """The padded verify forward over a bucket's buffers (what a graph captures): every input
    a tensor, nothing read back to the host, no branch on a value."""
    return model(buffers.tokens, buffers.positions, TreeBits(buffers.bits, buffers.rows),
                 PagedBatch(pool, buffers.table, buffers.lengths), capture_layers)


class Replay:
    """Off CUDA, a bucket's stand-in for its graph: `replay` runs the forward over the buffers."""

    def __init__(self, run):
        self.run, self.out = run, run()

    def replay(self) -> None:
        self.out = self.run()


class CudaGraph:
    """A bucket's CUDA graph: warmed up on a side stream, then captured into the shared pool."""

    def __init__(self, run, pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # Triton's JIT and the libraries' handles, outside the capture
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run()

    def replay(self) -> None:
        self.graph.replay()


class VerifyGraphs:
    """The captured verify forwards of one target over one KV pool (`scratch`: the pool's page
    no sequence owns)."""

    def __init__(self, model: TargetModel, pool: KVStorage, scratch: int, pages: int, settings: GraphSettings):
        self.model, self.pool, self.scratch, self.pages = model, pool, scratch, pages
        self.settings, self.capture_layers = settings, tuple(settings.capture_layers)
        self.graphs: dict[tuple[int, int], tuple[StepBuffers, Replay | CudaGraph]] = {}
        self.stats = GraphStats()
        self._logged: set[tuple] = set()

    def buckets(self) -> list[tuple[int, int]]:
        """(batch, rows) to capture, largest first: the row counts the paged attention kernel
        serves in place (a longer block gathers its contexts after a host read)."""
        s = self.settings
        return sorted(((b, q) for b in s.batch_buckets for q in s.row_buckets
                       if b * q <= s.max_rows and q <= ATTENTION_MAX_ROWS), reverse=True)

    def capture(self) -> GraphStats:
        """Captures every bucket the allowance holds; logs and returns the stats."""
        dev = self.model.device
        cuda = dev.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(dev) if cuda else 0
        for bucket in self.buckets():
            spent = time.perf_counter() - t0
            used = (torch.cuda.memory_reserved(dev) - reserved) if cuda else 0
            if spent > self.settings.max_s or used > self.settings.max_bytes:
                self.stats.left_out.append(bucket)
                continue
            buffers = StepBuffers.allocate(bucket[0], bucket[1], self.pages, self.scratch, dev)
            run = lambda buffers=buffers: verify_forward(self.model, self.pool, buffers, self.capture_layers)  # noqa: E731
            try:
                self.graphs[bucket] = (buffers, CudaGraph(run, pool) if cuda else Replay(run))
            except Exception as err:  # a capture that fails leaves its bucket eager, and says why
                logger.warning("verify graphs: capturing %d sequences x %d rows failed, it runs eagerly: %r",
                               *bucket, err)
                self.stats.left_out.append(bucket)
        if cuda:
            torch.cuda.synchronize(dev)
        self.stats.captured = len(self.graphs)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.bytes = (torch.cuda.memory_reserved(dev) - reserved) if cuda else 0
        logger.info("verify graphs: %d captured (%s) in %.1f s, %.1f MiB%s", self.stats.captured,
                    "CUDA graphs" if cuda else "replayed eagerly off CUDA", self.stats.seconds,
                    self.stats.bytes / 2**20,
                    f"; left out by the allowance: {self.stats.left_out}" if self.stats.left_out else "")
        return self.stats

    def bucket(self, batch: int, q_len: int, pages: int, capture: tuple[int, ...]) -> tuple[int, int] | None:
        """The captured bucket a step runs in, or None (it runs eagerly)."""
        if capture and tuple(capture) != self.capture_layers or pages > self.pages:
            return None
        fits = [b for (b, q) in self.graphs if q == q_len and b >= batch]
        return (min(fits), q_len) if fits else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: TreeBits, table: torch.Tensor,
                lengths: torch.Tensor, capture: tuple[int, ...] = ()) -> ForwardOutput | None:
        """The step's forward through its bucket's graph: logits [b, Q, V] (and the captured
        layers' features [b, Q, F] when `capture` asks for them), views of the graph's outputs
        that the next replay overwrites; None where no captured bucket holds the step."""
        b, q_len = tokens.shape
        key = self.bucket(b, q_len, table.shape[1], capture)
        if key is None:
            self.stats.eager_steps += 1
            shape = (b, q_len, tuple(capture))  # logged once, whatever pages it holds
            if shape not in self._logged:
                self._logged.add(shape)
                logger.info("verify graphs: %d sequences x %d rows (%d pages, layers %s) is outside the captured "
                            "set: eager", b, q_len, table.shape[1], shape[2])
            return None
        buffers, graph = self.graphs[key]
        buffers.fill(tokens, positions, mask, table, lengths)
        graph.replay()
        self.stats.replays += 1
        out = graph.out
        features = out.features[:b] if capture and out.features is not None else None
        return ForwardOutput(out.logits[:b], features)
