"""The distributed engine on a real local Ray cluster: a SchedulerActor, a Drafter actor and
TargetShard actors summing over gloo, in one placement group.

TP=2 must give TP=1's tokens: exactly on a tiny float64 model (its vocabulary of 97 splits
unevenly, 49 + 48 ids), and on SmolLM2-135M fp32 (3 key-value heads: 2 + 1) up to the tie rule
(ddtree.audit's tie rule), greedy and seeded, at budgets 0, chain and 16. A batch through the
SchedulerActor's Scheduler at TP=2 must give the in-process Scheduler's tokens for the same batch.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from ddtree.config import SamplingParams
from ddtree.workers.requests import Request
from ddtree.workers.solo import SoloLoop
from ddtree.workers.distributed import RayInstance, WorkerDiedError, WorkerSpec
from ddtree.workers.drafter import DFlashDrafter
from ddtree.workers.model import ModelConfig
from ddtree.workers.scheduler import BatchLimits, Scheduler
from ddtree.workers.tensor_parallel import ShardSpec

from .helpers import hf_greedy
from .test_batching import mixed_requests, run_schedule
from ddtree.audit import divergence

pytestmark = pytest.mark.slow  # a Ray cluster and Serve apps: minutes on 2 cores (make test runs it)

BUDGETS = [0, "chain", 16]
SEEDED = SamplingParams(temperature=0.8, top_p=0.95)


def spec_for(directory, tp: int, dtype: str = "float64", drafter_dir=None) -> WorkerSpec:
    return WorkerSpec(str(directory), drafter_dir, block_size=8, dtype=dtype, tp=tp, threads_per_worker=1)


# --- cutting the model -------------------------------------------------------------------------


def test_shard_specs_cover_every_head_column_and_id_once():
    """SmolLM2-135M's 3 key-value heads over 2 shards: 2 + 1, with their query-head groups."""
    config = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, True)
    specs = [ShardSpec.of(config, 2, r) for r in range(2)]
    assert [s.kv_heads for s in specs] == [(0, 2), (2, 3)]
    assert [s.heads for s in specs] == [(0, 6), (6, 9)]
    assert [s.intermediate for s in specs] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in specs] == [(0, 24576), (24576, 49152)]
    odd = [ShardSpec.of(config.__class__(**{**config.__dict__, "vocab_size": 97}), 3, r).vocab for r in range(3)]
    assert odd == [(0, 33), (33, 65), (65, 97)]
    with pytest.raises(ValueError, match="exceeds the target's 3 key-value heads"):
        ShardSpec.of(config, 4, 0)


# --- TP=2 == TP=1 on a tiny float64 model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engines(ray_cluster, tiny_checkpoint):
    hf, model, directory = tiny_checkpoint("llama", 97)
    engines = {tp: RayInstance(spec_for(directory, tp)) for tp in (1, 2)}
    yield hf, model, engines
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.parametrize("budget", BUDGETS)
def test_tp2_equals_tp1_exactly_on_a_tiny_float64_model(tiny_engines, budget):
    hf, model, engines = tiny_engines
    prompts = [[3, 14, 15, 92, 65], [2, 7, 1, 8, 28, 18, 28]]
    for prompt in prompts:
        greedy = Request(prompt, 24, budget=budget)
        seeded = Request(prompt, 24, sampling=SEEDED.model_copy(update={"seed": 7}), budget=budget)
        tp1, tp2 = (engines[tp].generate([greedy, seeded]) for tp in (1, 2))
        assert tp2[0].tokens == tp1[0].tokens == hf_greedy(hf, prompt, 24)
        assert tp2[1].tokens == tp1[1].tokens
        # the in-process engine, same drafter, same seed: the same tokens again
        local = SoloLoop.local(model, DFlashDrafter.untrained(model, block_size=8), budget).generate([seeded])[0]
        assert tp2[1].tokens == local.tokens


def test_a_tp2_batch_gives_the_in_process_batchs_tokens(ray_cluster, tiny_checkpoint):
    """The same arrival schedule through the SchedulerActor's Scheduler (two shards, the
    drafter in its own actor, steps driven one remote call at a time as the Serve deployment
    drives them) and through the in-process Scheduler: the same tokens for every request. The
    batch mixes budgets 0 / chain / 1 / 8 / 16 / 64, greedy and seeded rows, prompts of 1 to 39
    tokens in prefill chunks of 8, and a pool of 160 tokens small enough to force preemptions."""
    _, model, directory = tiny_checkpoint("llama", 97)
    limits = BatchLimits(max_num_seqs=5, max_prefill_tokens=8, max_step_tokens=160, kv_cache_tokens=160, kv_page_tokens=4)
    requests = mixed_requests(97, 9, seed=97)
    arrivals = [0, 0, 0, 1, 2, 2, 5, 9, 14]
    local = Scheduler.local(model, DFlashDrafter.untrained(model, block_size=8), 0, limits)
    expected = run_schedule(local, requests, arrivals)
    assert local.preemptions > 0, "the small pool forced a preemption"
    engine = RayInstance(spec_for(directory, 2), limits=limits)
    try:
        got = run_schedule(engine.scheduler, requests, arrivals)
        stats = engine.scheduler.stats()
        assert got == expected
        assert stats["preemptions"] == local.preemptions and stats["free_pages"] == stats["pages"]
        assert not engine.scheduler.has_work and engine.scheduler.running == []
        # the batch API in one call: the same tokens again
        assert [r.tokens for r in engine.generate(requests[:4])] == [r.tokens for r in local.generate(requests[:4])]
        # a cancelled sequence leaves at the next step and its pages come back
        remote = engine.scheduler
        gone, stays = remote.add(Request([1, 2, 3], 50, budget=8)), remote.add(Request([4, 5], 5))
        remote.step()
        remote.cancel(gone)
        assert remote.has_work
        emitted = remote.step()
        assert remote.running == [stays] and gone not in [i for i, _ in emitted]
        while remote.has_work:
            remote.step()
        assert remote.stats()["free_pages"] == remote.stats()["pages"]
    finally:
        engine.shutdown()


def test_the_configs_placement_is_the_placement_group_the_engine_makes(ray_cluster, tiny_chat_model):
    """`ddtree plan` printed bundles and STRICT_PACK that nothing used: the engine always made one
    1-CPU bundle per shard, PACK. A config's `placement` must be the placement group
    Engine.from_config makes, and the actors must run inside its bundles: shard r takes all of
    bundle r, bundle 0 also the coordinator and the drafter, so none of the group is left free."""
    from ddtree.config import ModelPairConfig
    from ddtree.engine import Engine

    placement = {"bundles": [{"CPU": 2}, {"CPU": 1}], "strategy": "STRICT_PACK"}
    config = ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4, tp=2, threads=1, placement=placement)
    distributed = Engine.from_config(config).instance
    try:
        table = ray.util.placement_group_table(distributed.group)
        assert table["strategy"] == "STRICT_PACK"
        assert [table["bundles"][i] for i in range(2)] == [{"CPU": 2.0}, {"CPU": 1.0}]
        assert len(distributed.generate([Request([1, 2, 3], 4)])[0].tokens) == 4
        group, free = distributed.group.id.hex(), ray.available_resources()
        assert [free.get(f"CPU_group_{i}_{group}", 0) for i in range(2)] == [0, 0]
    finally:
        distributed.shutdown()


def test_a_tp2_engine_with_device_cuda_starts_on_a_replica_without_a_gpu(ray_cluster, tiny_chat_model):
    """`device: cuda` at tp 2 (the shipped NVLink RayService): the engine replica holds no GPU,
    and it failed at start-up asking torch.cuda for the free memory of one. Here the replica's
    process has no GPU at all; the engine starts, its pool is sized by what its shards report
    (the least of them), and it serves."""
    from ddtree.config import ModelPairConfig
    from ddtree.engine import Engine

    config = ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4, tp=2, threads=1, device="cuda",
                             max_num_seqs=2)
    engine = Engine.from_config(config)
    try:
        assert len(engine.generate([Request([1, 2, 3], 4)])[0].tokens) == 4
        shards = [h for name, h in ray.get(engine.instance.actor.worker_handles.remote()).items() if "shard" in name]
        assert len(shards) == 2 and min(ray.get([s.pool_memory.remote() for s in shards])) > 0
        # the pool holds what the config allows (2 contexts of 256) when the shards' memory has room
        assert ray.get(engine.instance.actor.stats.remote())["pages"] == 2 * 256 // config.kv_page_tokens
    finally:
        engine.shutdown()


def test_a_killed_shard_ends_its_request_with_a_clear_error_and_the_next_one_succeeds(tiny_engines):
    """A TargetShard dying mid-generation must not hang the request (its peer waits in a
    collective that will never complete) nor poison the next one: the request fails with
    WorkerDiedError naming the dead shard, and the SchedulerActor starts fresh workers."""
    hf, _, engines = tiny_engines
    engine = engines[2]
    prompt = [5, 6, 7]
    long = Request(prompt, 400, budget=16)
    engine.generate([Request(prompt, 2)])  # workers up
    shard = ray.get(engine.actor.worker_handles.remote())["target shard 1"]

    def kill_soon():
        time.sleep(1.0)
        ray.kill(shard, no_restart=True)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    # Shard 1's death is reported, not shard 0's collective timing out waiting for it (which is
    # what a SchedulerActor that waited on every shard in turn would report, minutes later).
    with pytest.raises(WorkerDiedError, match="target shard 1"):
        engine.generate([long])
    killer.join()
    again = engine.generate([Request(prompt, 12)])[0]
    assert again.tokens == hf_greedy(hf, prompt, 12)


def test_workers_dying_under_a_stepped_batch_end_it_with_an_error_and_the_next_batch_runs(tiny_engines):
    """The Serve deployment's path: a RemoteScheduler stepped one call at a time. A shard that
    dies between steps makes the next step raise WorkerDiedError (it must not answer "no work":
    a request waiting in the batch would never end); after abort_all the batch is empty and
    the next request runs on fresh workers, with the target's own tokens."""
    hf, _, engines = tiny_engines
    engine = engines[2]
    prompt = [5, 6, 7]
    remote = engine.scheduler
    remote.add(Request(prompt, 400, budget=16))
    remote.step()  # workers up, the request prefilled
    shard = ray.get(engine.actor.worker_handles.remote())["target shard 0"]
    ray.kill(shard, no_restart=True)
    with pytest.raises(WorkerDiedError, match="target shard"):
        for _ in range(500):  # the 400-token request needs fewer steps; a missed death fails, not hangs
            remote.step()
    remote.abort_all()
    assert not remote.has_work
    assert engine.generate([Request(prompt, 6)])[0].tokens == hf_greedy(hf, prompt, 6)


# --- TP=2 == TP=1 on SmolLM2-135M fp32, up to the tie rule ---------------------------------------


@pytest.mark.smollm2
def test_tp2_equals_tp1_on_smollm2(ray_cluster, smollm2):
    from ddtree.engine import shipped_drafter

    drafter_dir = shipped_drafter()
    local = SoloLoop.local(smollm2.model, DFlashDrafter.load(drafter_dir, smollm2.model))
    engine = RayInstance(spec_for(smollm2.directory, 2, "float32", str(drafter_dir)))
    tok = smollm2.tokenizer
    # one prompt greedy, another seeded; every budget
    cases = [("What is 17 times 23? Think step by step.", SamplingParams()),
             ("Write a haiku about the sea.", SEEDED.model_copy(update={"seed": 41}))]
    failures, checked = [], 0
    try:
        for text, sampling in cases:
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            ids = tok.encode(rendered, add_special_tokens=False)
            for budget in BUDGETS:
                req = Request(ids, 20, eos_token_ids=(tok.eos_token_id,), sampling=sampling, budget=budget)
                ref = local.generate([req])[0]
                got = engine.generate([req])[0]
                checked += 1
                d = divergence(smollm2.model, req, ref.seed, ref.tokens, got.tokens)
                if d is not None:
                    print(f"budget {budget} seed {ref.seed}: token {d[0]} differs, gap {d[1]:.2e}")
                    if not d[2]:
                        failures.append((text, budget, ref.seed, d))
    finally:
        engine.shutdown()
    assert checked == len(cases) * len(BUDGETS)
    assert not failures, f"TP=2 diverged from TP=1 beyond a near-tie: {failures}"


def test_an_engine_in_a_ray_actor_runs_as_many_threads_as_cpus_ray_reserved_it(ray_cluster):
    """A replica's intra-op threads are the CPUs Ray reserved for its actor (two processes with 2
    OpenMP threads each on 2 cores slow a GEMM 10-30x); outside an actor, the cores this process
    may run on, and never more than those cores (the test cluster declares 8 CPUs on this
    machine's 2). The check reads Ray from the modules already imported (a process that never
    imported Ray is no actor; gpu-check's machine has no Ray at all), so it must still see the
    actor from inside one."""
    from ddtree.config import ModelPairConfig
    from ddtree.engine import engine_threads

    @ray.remote
    class Replica:
        def threads(self):
            return engine_threads(ModelPairConfig())

    cores = len(os.sched_getaffinity(0))
    for cpus in (1, cores + 1):
        actor = Replica.options(num_cpus=cpus).remote()
        threads, why = ray.get(actor.threads.remote())
        ray.kill(actor)
        assert threads == min(cpus, cores) and f"Ray reserved {cpus} CPUs" in why, (cpus, threads, why)
    assert engine_threads(ModelPairConfig()) == (len(os.sched_getaffinity(0)), "the cores this process may run on")
    assert engine_threads(ModelPairConfig(threads=5)) == (5, "threads in the config")
