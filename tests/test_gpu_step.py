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
         Request([4, 4, 2], 12, sampling=SamplingParams(temperature=0.7, seed=11), budget=0)]
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
    batch of greedy and seeded requests at budgets 0, 8 and 16; its tokens are plain decoding's
    on the CPU route.

    Regression: the step read the walk back as three reads (paths, lengths, bonus tokens) and
    then built the KV moves on the host from them (a host tensor of slots copied back each
    step): three stalls of the GPU per step where one is needed."""
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

