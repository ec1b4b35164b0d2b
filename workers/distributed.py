"""The distributed engine: the Scheduler's step loop in a Ray actor, driving a Drafter actor
and TargetShard actors (tensor parallelism over torch.distributed), all in one placement group.

    driver ── RayInstance ──> SchedulerActor (actor, bundle 0)
                                ├── DrafterWorker (actor, bundle 0)
                                └── TargetShardWorker × TP (actor r in bundle r),
                                    summing over gloo (CPU) or NCCL (GPU)

The SchedulerActor runs workers.scheduler.Scheduler -- the same step loop as in process -- over
a ShardedBatchTarget and a RemoteBatchDrafter, whose calls go to the actors (`generate`, and
`add` / `cancel` / `step` for the Serve deployment through `RemoteScheduler`). Per step that is
one drafter call for every drafting sequence (returning Candidates, not [R, D, V] log-probs),
one forward call per shard over every sequence's tree (each shard holds the KV storage of its
own heads; the page allocator stays in the SchedulerActor; the choices come back, made on the
shards; the previous step's KV moves of the accepted paths travel with it). Full-vocabulary
logits never leave the shards.

If a worker dies, the requests of the batch end with WorkerDiedError, and the next request
runs on fresh workers (the SchedulerActor kills and recreates all of them: a process group
cannot lose a member and go on).
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import Placement
from ..kernels.tree import Candidates
from .batch_backends import DraftRows, LocalBatchDrafter, LocalBatchTarget, TargetBatch, TargetStep
from .requests import Budget, Request, Result, Update, check_budget
from .drafter import DFlashConfig, DFlashDrafter
from .kv_pool import pool_memory
from .loading import load_target_heads, load_target_weights, load_tokenizer
from .model import ModelConfig, packs_rows
from .calibration import measure_step_cost
from .policy import CostCurve
from .scheduler import BatchLimits, Scheduler, row_counts
from .tensor_parallel import ShardSpec, TensorParallel

PROCESS_GROUP_TIMEOUT_S = 120  # a collective waiting longer than this for a dead peer fails
PLACEMENT_TIMEOUT_S = 120  # how long a model instance waits for its placement group
SCHEDULER_CPUS = 0.25  # of bundle 0 (shard 0 takes the rest of it)
DRAFTER_CPUS = 0.25  # of bundle 0
DRAFTER_GPU_SHARE = 0.1  # of bundle 0's GPUs (the drafter shares shard 0's GPU)
ARRIVALS = "arrivals"  # the SchedulerActor's concurrency group of `add` and `cancel` (one thread)


# The Scheduler's limits as a function of the bytes the KV pool may take on each shard's device
# (the least any shard reports, workers.kv_pool.pool_memory): the process that makes a model
# instance holds no GPU at tp > 1, so only the shards can say how much memory their pool has.
LimitsOfMemory = Callable[[int], BatchLimits]


class WorkerDiedError(RuntimeError):
    """A drafter or target-shard actor died while serving a request."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to load its part of the model pair (sent to each actor)."""

    target_dir: str  # Hugging Face directory of the target
    drafter_dir: str | None  # DFlash checkpoint; None = the seeded untrained drafter
    block_size: int  # block size of the untrained drafter
    dtype: str  # "float32", "float64" or "bfloat16"
    tp: int  # tensor-parallel shards
    threads_per_worker: int  # torch threads of each shard (CPU)
    lookup: bool = False  # the scheduler's default for lookup branches (workers.lookup)
    topk: int | None = None  # the scheduler's default for the most children a tree node may have


def _device(spec: WorkerSpec, rank: int = 0) -> torch.device:
    """The GPU Ray assigned to this actor (CUDA_VISIBLE_DEVICES holds only it), else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


# --- the workers (plain classes, made Ray actors by RayInstance) -----------------------


class TargetShardWorker:
    """Shard `rank` of the target and its part of the KV storage (its heads)."""

    def __init__(self, spec: WorkerSpec, rank: int):
        torch.set_num_threads(spec.threads_per_worker)
        self.spec, self.rank = spec, rank
        self.device = _device(spec, rank)
        self.model = None
        self.batch: LocalBatchTarget | None = None  # the Scheduler's side: this shard's KV storage

    def ready(self) -> bool:
        return True

    def pool_memory(self) -> int:
        """The bytes this shard's part of the KV pool may take on its device (workers.kv_pool)."""
        return pool_memory(self.device)

    def packs_rows(self) -> bool:
        """Whether this shard computes a padded step's real rows only (workers.model.Packing)."""
        return packs_rows(self.device)

    def address(self) -> tuple[str, int]:
        """Where shard 0 hosts the process group's rendezvous: this node's IP and a free port."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def join(self, host: str, port: int) -> None:
        """Joins the process group (all shards call this together), then loads the shard."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.spec.tp,
            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
        directory = Path(self.spec.target_dir)
        config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
        parallel = TensorParallel(ShardSpec.of(config, self.spec.tp, self.rank))
        self.model = load_target_weights(directory, getattr(torch, self.spec.dtype), parallel).to(self.device)

    # workers.batch_backends.BatchTarget, this shard's part of it

    def allocate(self, num_pages: int, page: int) -> None:
        self.batch = LocalBatchTarget(self.model)
        self.batch.allocate(num_pages, page)

    def forward(self, batch: TargetBatch, moves: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> TargetStep:
        """`moves` (src, dst slot pairs of the previous step) are applied first."""
        for src, dst in moves:
            self.batch.move(src, dst)
        step = self.batch.forward(batch)
        step.choices = step.choices.cpu()
        # every shard has the same features; shard 0 sends them
        step.features = step.features.cpu() if self.rank == 0 and step.features is not None else None
        return step

class DrafterWorker:
    """The DFlash drafter with the target's embedding and LM head (not its layers)."""

    def __init__(self, spec: WorkerSpec):
        torch.set_num_threads(spec.threads_per_worker)
        heads = load_target_heads(Path(spec.target_dir), getattr(torch, spec.dtype)).to(_device(spec))
        self.drafter = (
            DFlashDrafter.load(spec.drafter_dir, heads)
            if spec.drafter_dir
            else DFlashDrafter.untrained(heads, block_size=spec.block_size)
        )
        self.rows = LocalBatchDrafter(self.drafter)  # the Scheduler's sequences' caches

    def ready(self) -> bool:
        return True

    def shape(self) -> tuple[int, tuple[int, ...]]:
        return self.drafter.block_size, tuple(self.drafter.target_layer_ids)

    # workers.batch_backends.BatchDrafter

    def open_row(self, seq_id: int, slots: int) -> None:
        self.rows.open(seq_id, slots)

    def propose_rows(self, rows: DraftRows) -> list[Candidates]:
        return self.rows.propose(rows)

    def close_row(self, seq_id: int) -> None:
        self.rows.close(seq_id)


def _get(refs: list, who: list[str]):
    """ray.get that fails fast: the first dead worker raises WorkerDiedError at once, without
    waiting for its peers (which may be stuck in a collective with it)."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except (RayActorError, RayTaskError) as e:
            name = who[refs.index(done[0])]
            raise WorkerDiedError(f"{name} failed during the request: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return ray.get(refs)


# --- backends: the Scheduler's view of the actors ----------------------------------------------


class ShardedBatchTarget:
    """workers.batch_backends.BatchTarget over the TargetShard actors: each runs the same
    forward over its own heads and KV storage, all choose the same tokens (gathered between
    them), shard 0 returns the features. The step's tensors live on this process's CPU.

    A step's KV moves travel with the next forward (the shards apply them first): only a
    forward reads the pool, so they land in time, and a step costs one call per shard."""

    device = torch.device("cpu")

    def __init__(self, shards: list, packs_rows: bool = False):
        self.shards = shards
        self.packs_rows = packs_rows  # the shards' (their device's) choice, see workers.model.Packing
        self.names = [f"target shard {r}" for r in range(len(shards))]
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] = []  # not yet sent

    def allocate(self, num_pages: int, page: int) -> None:
        self.moves = []
        _get([s.allocate.remote(num_pages, page) for s in self.shards], self.names)

    def forward(self, batch: TargetBatch) -> TargetStep:
        moves, self.moves = self.moves, []
        sent = ray.put(batch)  # serialized once for all shards
        steps = _get([s.forward.remote(sent, moves) for s in self.shards], self.names)
        if any(not torch.equal(s.choices, steps[0].choices) for s in steps):
            raise RuntimeError(f"target shards disagree: {[s.choices.tolist() for s in steps]}")
        step = steps[0]
        step.forward_s = max(s.forward_s for s in steps)  # the call waited for the slowest
        return step

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.numel():
            self.moves.append((src, dst))


class RemoteBatchDrafter:
    """workers.batch_backends.BatchDrafter over the Drafter actor. Opening and closing a
    sequence's cache are sent without waiting: an actor runs one caller's calls in order."""

    def __init__(self, actor, block_size: int, target_layer_ids: tuple[int, ...]):
        self.actor, self.block_size, self.target_layer_ids = actor, block_size, target_layer_ids

    def open(self, seq_id: int, slots: int) -> None:
        self.actor.open_row.remote(seq_id, slots)

    def propose(self, rows: DraftRows) -> list[Candidates]:
        return _get([self.actor.propose_rows.remote(rows)], ["drafter"])[0]

    def close(self, seq_id: int) -> None:
        self.actor.close_row.remote(seq_id)


# --- the step loop's actor --------------------------------------------------------------------


class SchedulerActor:
    """Owns the drafter and shard actors of one model instance (inside its placement group) and
    runs the Scheduler's step loop over them.

    `add` and `cancel` run in their own concurrency group (ARRIVALS), so that a request joins
    or leaves while a step runs, as the Scheduler allows; everything else runs one call at a time."""

    def __init__(self, spec: WorkerSpec, budget: Budget, group: PlacementGroup,
                 placement: Placement, limits: BatchLimits | LimitsOfMemory = BatchLimits()):
        self.spec, self.budget, self.group = spec, budget, group
        self.placement = placement  # `group` was made from it: shard r in bundle r
        self.limits = limits  # a LimitsOfMemory becomes the BatchLimits once the shards are up
        directory = Path(spec.target_dir)
        has_tokenizer = any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = load_tokenizer(directory) if has_tokenizer else None  # None: no stop strings
        self.workers: list = []
        self.scheduler: Scheduler | None = None  # made at the batch's first request (its KV pool then)
        self._starting = threading.Lock()  # `add` (the arrivals' thread) and `step` may both start it

    def _start_workers(self) -> None:
        def on(bundle: int, num_cpus: float, num_gpus: float):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)
            return dict(scheduling_strategy=strategy, num_cpus=num_cpus, num_gpus=num_gpus)

        # Shard r takes all of bundle r's CPUs and GPUs, but in bundle 0 the SchedulerActor (this
        # actor) and the drafter take their share first.
        bundles = self.placement.bundles
        gpus0 = bundles[0].get("GPU", 0)
        shards = [
            ray.remote(TargetShardWorker)
            .options(**(
                on(0, bundles[0]["CPU"] - SCHEDULER_CPUS - DRAFTER_CPUS, gpus0 * (1 - DRAFTER_GPU_SHARE))
                if r == 0
                else on(r, bundles[r]["CPU"], bundles[r].get("GPU", 0))
            ))
            .remote(self.spec, r)
            for r in range(self.spec.tp)
        ]
        drafter = ray.remote(DrafterWorker).options(**on(0, DRAFTER_CPUS, gpus0 * DRAFTER_GPU_SHARE)).remote(self.spec)
        self.workers = [drafter, *shards]
        names = ["drafter", *(f"target shard {r}" for r in range(len(shards)))]
        try:
            # every worker up first (a busy machine can take minutes to start processes), so that
            # the process group's timeout only covers the rendezvous itself
            _get([w.ready.remote() for w in self.workers], names)
            host, port = _get([shards[0].address.remote()], ["target shard 0"])[0]
            _get([s.join.remote(host, port) for s in shards], [f"target shard {r}" for r in range(len(shards))])
            block_size, layer_ids = _get([drafter.shape.remote()], ["drafter"])[0]
            packs = _get([shards[0].packs_rows.remote()], ["target shard 0"])[0]
            if not isinstance(self.limits, BatchLimits):  # sized by the shard with the least memory
                self.limits = self.limits(min(_get([s.pool_memory.remote() for s in shards], names[1:])))
        except WorkerDiedError:
            self._stop_workers()
            raise
        self.scheduler = Scheduler(
            ShardedBatchTarget(shards, packs),
            RemoteBatchDrafter(drafter, block_size, layer_ids),
            self.budget,
            self.limits,
            decode=self.decode if self.tokenizer is not None else None,
            lookup=self.spec.lookup,
            topk=self.spec.topk,
        )
        if self.scheduler.drafter is not None:  # the budget policy's step cost over these shards (not cached)
            counts = row_counts(self.limits.max_step_tokens)
            self.scheduler.policy.calibrate(CostCurve(measure_step_cost(self.scheduler, counts)))

    def _stop_workers(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers, self.scheduler = [], None

    def _batch(self) -> Scheduler:
        """The Scheduler, made (and the workers started) on first use."""
        with self._starting:
            if self.scheduler is None:
                self._start_workers()
            return self.scheduler

    def block_size(self) -> int:
        """The drafter's block size (read from its checkpoint without starting the workers)."""
        if self.spec.drafter_dir is None:
            return self.spec.block_size
        return DFlashConfig.from_hf(json.loads((Path(self.spec.drafter_dir) / "config.json").read_text())).block_size

    def worker_handles(self) -> dict:
        """The live workers by name (for operators and tests)."""
        names = ["drafter", *(f"target shard {r}" for r in range(self.spec.tp))]
        return dict(zip(names, self.workers))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def get_budget(self) -> Budget:
        return self.budget

    def set_budget(self, budget: Budget) -> None:
        self.budget = check_budget(budget, has_drafter=True)  # the drafter actor is always there
        if self.scheduler is not None:
            self.scheduler.budget = self.scheduler.check_budget(budget)

    def generate(self, requests: list[Request]) -> list[Result]:
        """`requests` as one batch through the Scheduler; results in request order."""
        return self._on_workers(lambda: self._batch().generate(requests))

    # the batch, one step per call (RemoteScheduler, for the Serve engine deployment)

    def add(self, request: Request) -> int:
        return self._batch().add(request)

    def cancel(self, seq_id: int) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel(seq_id)

    def step(self) -> "BatchStep":
        """One step of the batch, and the batch after it."""
        if self.scheduler is None:
            return BatchStep([], False, [], [], {})
        updates = self._on_workers(self.scheduler.step)
        s = self.scheduler
        return BatchStep(updates, s.has_work, [q.id for q in s.running], [q.id for q in s.waiting], s.stats())

    def abort_all(self) -> None:
        if self.scheduler is not None:
            self.scheduler.abort_all()

    def stats(self) -> dict:
        """Scheduler.stats() of the batch now ({} before its first request)."""
        return self.scheduler.stats() if self.scheduler is not None else {}

    def _on_workers(self, call):
        try:
            return call()
        except WorkerDiedError:
            self._stop_workers()  # the batch ends; the next request starts on fresh workers
            raise


class RayInstance:
    """Driver-side handle of one model instance on the Ray cluster (started locally if none is
    running): its placement group and its SchedulerActor; `scheduler` is the step loop's API
    there (RemoteScheduler), which ddtree.engine.Engine drives like an in-process Scheduler."""

    def __init__(self, spec: WorkerSpec, budget: Budget = 0,
                 placement: Placement | None = None, limits: BatchLimits | LimitsOfMemory = BatchLimits()):
        """`placement`: the placement group to make (config.Placement, one bundle per shard, e.g.
        `ddtree plan`'s); None = default_placement. `limits`: the Scheduler's, or a function of
        the shards' KV memory that gives them (ddtree.engine.batch_limits with its config bound)."""
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self.spec = spec
        check_budget(budget, has_drafter=True)  # the drafter actor is always there
        placement = placement or default_placement(spec.tp, gpu=bool(ray.cluster_resources().get("GPU")))
        if len(placement.bundles) != spec.tp:
            raise ValueError(f"placement has {len(placement.bundles)} bundles for tp {spec.tp}: give one per shard")
        self.placement = placement
        self.group = placement_group(placement.bundles, strategy=placement.strategy)
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"the model instance's placement group {placement.bundles} ({placement.strategy}) could not be "
                f"placed within {PLACEMENT_TIMEOUT_S} s; the cluster has {ray.available_resources()} available"
            ) from None
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=0)
        self.actor = (
            ray.remote(concurrency_groups={ARRIVALS: 1})(SchedulerActor)
            .options(num_cpus=SCHEDULER_CPUS, scheduling_strategy=strategy)
            .remote(spec, budget, self.group, placement, limits)
        )
        self.block_size = ray.get(self.actor.block_size.remote())
        self.scheduler = RemoteScheduler(self.actor)

    def generate(self, requests: list[Request]) -> list[Result]:
        """The requests as one batch (the Scheduler in the SchedulerActor)."""
        return ray.get(self.actor.generate.remote(requests))

    def shutdown(self) -> None:
        ray.kill(self.actor)
        remove_placement_group(self.group)


@dataclass
class BatchStep:
    """What one remote step returns: its updates and the batch after it."""

    updates: list[tuple[int, Update]]  # (sequence id, update) for every sequence that emitted or finished
    has_work: bool  # sequences left running, waiting, arriving or to cancel
    running: list[int]  # ids of the running sequences
    waiting: list[int]  # ids of the waiting sequences
    stats: dict  # Scheduler.stats()


class RemoteScheduler:
    """The SchedulerActor's Scheduler with the Scheduler's own API (add, cancel, step,
    has_work, abort_all, running, waiting, stats, generate), as serve's BatchDriver and the
    load bench drive one: `add` and `cancel` may be called from any thread (they reach the actor
    while a step runs), `step` from one. Each call is one actor call; `running`, `waiting` and
    `stats()` are the batch as the last step left it.

    has_work: the last step's answer, or True when a request arrived or was cancelled since
    that step began (its answer may predate the arrival)."""

    def __init__(self, actor):
        self.actor = actor
        self._last = BatchStep([], False, [], [], {})
        self._calls = 0  # adds and cancels so far
        self._calls_lock = threading.Lock()
        self._calls_at_step = 0

    def add(self, request: Request) -> int:
        """ValueError for a request that can never run, QueueFull when the queue is full (the
        actor's exception, re-raised as an instance of its type)."""
        seq_id = ray.get(self.actor.add.options(concurrency_group=ARRIVALS).remote(request))
        self._called()
        return seq_id

    def cancel(self, seq_id: int) -> None:
        ray.get(self.actor.cancel.options(concurrency_group=ARRIVALS).remote(seq_id))
        self._called()

    @property
    def budget(self) -> Budget:
        return ray.get(self.actor.get_budget.remote())

    @budget.setter
    def budget(self, budget: Budget) -> None:
        ray.get(self.actor.set_budget.remote(budget))

    def _called(self) -> None:
        with self._calls_lock:
            self._calls += 1

    @property
    def has_work(self) -> bool:
        return self._last.has_work or self._calls != self._calls_at_step

    @property
    def running(self) -> list[int]:
        return self._last.running

    @property
    def waiting(self) -> list[int]:
        return self._last.waiting

    def stats(self) -> dict:
        return dict(self._last.stats)

    def step(self) -> list[tuple[int, Update]]:
        with self._calls_lock:
            calls = self._calls
        self._last = ray.get(self.actor.step.remote())
        self._calls_at_step = calls
        return self._last.updates

    def abort_all(self) -> None:
        ray.get(self.actor.abort_all.remote())
        with self._calls_lock:
            self._calls_at_step = self._calls
        self._last = BatchStep([], False, [], [], {})

    def generate(self, requests: list[Request]) -> list[Result]:
        return ray.get(self.actor.generate.remote(requests))


def default_placement(tp: int, gpu: bool = False) -> Placement:
    """Without a plan: one bundle per shard, 1 CPU (and 1 GPU on a cluster with GPUs), PACK
    (one node where it fits, else spread). Bundle 0 also holds the SchedulerActor and the drafter."""
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    return Placement(bundles=[dict(bundle) for _ in range(tp)], strategy="PACK")
