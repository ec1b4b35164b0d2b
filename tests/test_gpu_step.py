"""The GPU's step, checked on the CPU: the engine's device path (the padded forward, the paged
attention, the seeded draws, the walk and the KV moves as Triton kernels: here under the
interpreter, `triton_support.KERNELS_ON_CPU`) reads the device once per step, and each verify
bucket's forward is capturable as a graph."""

from __future__ import annotations

import pytest
import torch

from ddtree.config import SamplingParams
from ddtree.kernels import triton_support
from ddtree.workers.batch_backends import LocalBatchDrafter, LocalBatchTarget
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.loading import load_target_weights
from ddtree.workers.requests import Request
from ddtree.workers.scheduler import BatchLimits, Scheduler

from .helpers import make_hf_model
from .host_reads import DeviceReads


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny qwen3 target (head width 16: a kernel tile's) in fp32 and an untrained drafter."""
    directory = tmp_path_factory.mktemp("qwen3-d16")
    make_hf_model("qwen3", 97, head_dim=16).save_pretrained(directory)
    target = load_target_weights(directory, torch.float32)
    return target, DFlashDrafter.untrained(target, block_size=4)


MIXED = [Request([5, 6, 7, 8, 9], 12, budget=16),
         Request([1, 2, 3], 12, sampling=SamplingParams(temperature=0.9, top_k=20, seed=4), budget=8),
         Request([9, 3], 12, budget=0),
         Request([4, 4, 2], 12, sampling=SamplingParams(temperature=0.7, top_p=0.8, seed=11), budget=0)]
LIMITS = BatchLimits(max_num_seqs=4, kv_cache_tokens=256, kv_page_tokens=4)


class CountedScheduler(Scheduler):
    """The scheduler, its execute phase counted: `reads` holds each decode step's device reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: list[int] = []
        self.where: list[list[str]] = []

    def _execute(self, plan):
        model = self.target.model
        on_device = [*model.parameters(), self.target.storage.k, self.target.storage.v]
        with DeviceReads(on_device) as reads:
            outcome = super()._execute(plan)
        self.reads.append(reads.count)
        self.where.append(reads.where)
        return outcome


def test_a_device_step_reads_the_device_once(pair, monkeypatch):
    """The device path's execute phase -- the padded forward over every tree, greedy and seeded
    choices, the walks, the moves of the accepted paths' KV rows, the step's outcome -- reads
    the device once (the packed paths, lengths and bonus tokens), at every decode step of a
    batch of greedy and seeded requests (one with top_p) at budgets 0, 8 and 16; its tokens are
    plain decoding's on the CPU route.

    Regression: the step read the walk back as three reads (paths, lengths, bonus tokens) and
    then built the KV moves on the host from them (a host tensor of slots copied back each
    step): three stalls of the GPU per step where one is needed. And a seeded request with
    top_p read the device once more: the nucleus's rows that its candidates could not decide
    were found with `nonzero`."""
    target, drafter = pair
    plain = Scheduler.local(target, drafter, 0, LIMITS).generate([Request(r.prompt, r.max_tokens, sampling=r.sampling)
                                                                  for r in MIXED])
    monkeypatch.setattr(triton_support, "KERNELS_ON_CPU", True)
    scheduler = CountedScheduler(LocalBatchTarget(target, packs_rows=False), LocalBatchDrafter(drafter), 0, LIMITS)
    results = scheduler.generate(MIXED)
    assert [r.tokens for r in results] == [r.tokens for r in plain]
    assert any(r.tree_size > 1 for res in results for r in res.rounds)  # trees were verified, paths moved
    assert len(scheduler.reads) >= 10
    worst = max(range(len(scheduler.reads)), key=scheduler.reads.__getitem__)
    assert scheduler.reads[worst] <= 1, "".join(scheduler.where[worst])
    assert set(scheduler.reads) == {1}


@pytest.fixture
def device_path(monkeypatch):
    """The GPU's forward on the CPU: the kernels for CPU tensors (the paged attention as an op of
    its own, which dynamo traces as one call: on a GPU it traces Triton's launches itself, the
    interpreter's host copies it cannot) and the linears through F.linear (a GPU's route, not
    ddtree_cpu's)."""
    from ddtree.kernels import triton_kernels as tk
    from ddtree.workers import kv_pool, model as model_module

    @torch.library.custom_op("ddtree_test::paged_tree_attention", mutates_args=())
    def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                  lengths: torch.Tensor, bits: torch.Tensor, page: int, rows: torch.Tensor | None,
                  batch_invariant: bool = False) -> torch.Tensor:
        return tk.paged_tree_attention_triton(q, k_pool, v_pool, table, lengths, bits, page, rows,
                                              batch_invariant=batch_invariant)

    attention.register_fake(lambda q, *args: torch.empty_like(q))
    monkeypatch.setattr(triton_support, "KERNELS_ON_CPU", True)
    monkeypatch.setattr(model_module, "LINEAR_BACKEND", "torch")
    monkeypatch.setattr(kv_pool, "paged_tree_attention", attention)


def test_each_bucket_forward_is_capturable(pair, device_path):
    """The verify forward of each captured bucket (workers.graphs.verify_forward over a
    (batch, rows) bucket's static buffers) traces as one graph -- torch.compile with
    fullgraph=True and dynamic=False fails at a host read or a branch on a value -- and the
    traced forward gives the eager forward's logits over the same buffers, refilled between
    calls; its buffers keep their addresses. Buckets (1 x 1), (4 x 17) and (2 x 33: two mask
    words a row), the padding sequences on the scratch page.

    Regression: the fused q/k/v and gate/up weights were checked at every call by comparing data
    pointers, which a traced graph cannot hold: the forward did not trace whole."""
    from ddtree.kernels.batched import tree_metadata
    from ddtree.kernels.tree import Tree
    from ddtree.kernels.tree_batch import TreeBatch
    from ddtree.workers.graphs import StepBuffers, verify_forward
    from ddtree.workers.kv_pool import KVStorage, block_table
    from ddtree.workers.model import TreeBits

    target, _ = pair
    page, pages, per_row = 4, 64, 16  # a row's 16 pages hold its 19 + 33 positions at most
    pool = KVStorage(target.config, pages + 1, page, torch.float32)  # the last page: the scratch page
    g = torch.Generator().manual_seed(0)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    for batch, q_len in ((1, 1), (4, 17), (2, 33)):
        torch._dynamo.reset()
        buffers = StepBuffers.allocate(batch, q_len, per_row, scratch=pages, device="cpu")
        addresses = [t.data_ptr() for t in (buffers.tokens, buffers.positions, buffers.bits, buffers.table)]
        compiled = torch.compile(lambda: verify_forward(target, pool, buffers), fullgraph=True, dynamic=False,
                                 backend="eager")
        for step in range(2):  # two steps through the same buffers, one sequence short of the bucket
            b = max(batch - step, 1)
            trees = [Tree(torch.randint(97, (n,), generator=g), torch.arange(n) - 1, torch.arange(n))
                     for n in torch.randint(1, q_len + 1, (b,), generator=g).tolist()]
            tree_batch = TreeBatch.of(trees, q_len)
            lengths = torch.randint(0, 20, (b,), generator=g)
            meta = tree_metadata(tree_batch, lengths)
            table = block_table([list(range(per_row * r, per_row * (r + 1))) for r in range(b)])
            buffers.fill(tree_batch.tokens, meta.positions, TreeBits(meta.bits, tree_batch.sizes), table, lengths)
            want = verify_forward(target, pool, buffers).logits
            got = compiled().logits
            for r, tree in enumerate(trees):
                torch.testing.assert_close(got[r, : tree.size], want[r, : tree.size], atol=1e-5, rtol=1e-5)
        assert [t.data_ptr() for t in (buffers.tokens, buffers.positions, buffers.bits, buffers.table)] == addresses


def test_graphed_steps_give_plain_decoding_and_fall_back_outside_the_captured_set(pair, caplog):
    """The verify graphs (workers.graphs over the padded forward; off CUDA each bucket replays
    the forward over its buffers) in the scheduler's steps: 3 sequences run in the 4-sequence
    bucket, the 4th a padding sequence on the scratch page (had it written to page 0, the first
    sequence's prefix, the tokens would change); a step whose trees need 33 rows, a bucket not
    captured, runs eagerly and says so once. Every output is plain decoding's."""
    import logging

    from ddtree.workers.graphs import GraphSettings

    target, drafter = pair
    requests = [Request([5, 6, 7, 8, 9], 10, budget=16), Request([9, 3], 10, budget=0),
                Request([1, 2, 3], 10, sampling=SamplingParams(temperature=0.9, top_k=20, seed=4), budget=8)]
    plain = Scheduler.local(target, drafter, 0, LIMITS).generate([Request(r.prompt, r.max_tokens, sampling=r.sampling)
                                                                  for r in requests])
    settings = GraphSettings(batch_buckets=(1, 2, 4), row_buckets=(1, 9, 17), max_context=64,
                             capture_layers=tuple(drafter.target_layer_ids))
    graphed = LocalBatchTarget(target, packs_rows=False, graphs=settings)
    scheduler = Scheduler(graphed, LocalBatchDrafter(drafter), 0, LIMITS)
    runner = graphed.graphs
    assert runner.stats.captured == 9 and runner.scratch == scheduler.pool.num_pages
    assert graphed.storage.k.shape[1] == (scheduler.pool.num_pages + 1) * LIMITS.kv_page_tokens
    addresses = {key: buffers.tokens.data_ptr() for key, (buffers, _) in runner.graphs.items()}
    assert runner.bucket(3, 17, 4, settings.capture_layers) == (4, 17)
    assert runner.bucket(3, 17, 4, ()) == (4, 17)  # a plain step: no features asked
    assert runner.bucket(5, 17, 4, ()) is None and runner.bucket(1, 33, 4, ()) is None
    assert runner.bucket(1, 1, runner.pages + 1, ()) is None  # a context past max_context
    with caplog.at_level(logging.INFO, logger="ddtree"):
        results = scheduler.generate(requests)
        wide = scheduler.generate([Request([4, 4, 2], 6, budget=32)])[0]
    assert [r.tokens for r in results] == [r.tokens for r in plain]
    assert wide.tokens == Scheduler.local(target, drafter, 0, LIMITS).generate([Request([4, 4, 2], 6)])[0].tokens
    assert runner.stats.replays >= 5 and runner.stats.eager_steps >= 1
    assert sum("outside the captured set" in m for m in caplog.messages) == 1
    assert {key: buffers.tokens.data_ptr() for key, (buffers, _) in runner.graphs.items()} == addresses
