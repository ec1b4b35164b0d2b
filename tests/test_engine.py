"""ddtree.engine.Engine, the API the CLI, bench and calibration call: generate and stream run
the step loop on the caller's thread; the budget rules have one owner (workers.requests)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from ddtree.config import ModelPairConfig, SamplingParams
from ddtree.engine import Engine

from .helpers import hf_greedy


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    return Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=0, block_size=4, dtype="float64"))


def test_stream_emits_the_tokens_generate_gives_and_ends_with_the_result(engine, tiny_chat_model):
    """Greedy at budget 4: the streamed updates concatenate to generate's tokens, which are the
    target's own greedy tokens (transformers, float64); only the last update carries a result."""
    prompt = engine.render_chat([{"role": "user", "content": "Tell me about trees."}])
    request = engine.request(prompt, 12, SamplingParams(), budget=4)
    updates = list(engine.stream(request))
    streamed = [t for u in updates for t in u.new_tokens]
    assert [u.result is not None for u in updates] == [False] * (len(updates) - 1) + [True]
    assert streamed == updates[-1].result.tokens == engine.generate([request])[0].tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype="float64").eval()
    reference = hf_greedy(hf, prompt, 12)
    cut = next((i + 1 for i, t in enumerate(reference) if t in engine.eos_token_ids), len(reference))
    assert streamed == reference[:cut]


def test_a_stream_left_early_frees_its_sequence(engine):
    """A consumer that stops reading after the first update: its sequence is cancelled and
    leaves at the next step, and every KV page comes back."""
    prompt = engine.render_chat([{"role": "user", "content": "What is a cache?"}])
    updates = engine.stream(engine.request(prompt, 50, SamplingParams(), budget=4))
    next(updates)
    assert len(engine.scheduler.running) == 1
    updates.close()
    engine.scheduler.step()
    stats = engine.scheduler.stats()
    assert engine.scheduler.running == [] and stats["free_pages"] == stats["pages"]
    assert stats["cancelled"] >= 1


@pytest.mark.parametrize("budget, rows", [(0, 1), (1, 2), ("chain", 5), (4, 5), (16, 17), (20, 33)])
def test_verify_len_is_the_tree_rows_bucketed(engine, budget, rows):
    """Root + budget nodes (a chain: one per drafted depth of block 4 = 3), padded up to the
    next verify bucket 1, 2, 3, 5, 9, 17, 33, ..."""
    assert engine.verify_len(budget) == rows


def test_budgets_are_checked_by_one_rule_with_the_servers_cap(engine):
    assert engine.check_budget("7") == 7 and engine.check_budget("chain") == "chain"
    assert engine.check_budget(64, max_budget=64) == 64
    with pytest.raises(ValueError, match="exceeds this server's max_budget of 64"):
        engine.check_budget(65, max_budget=64)
    for bad in (-1, True, 2.5, "many"):
        with pytest.raises(ValueError, match="budget must be"):
            engine.check_budget(bad)


def test_the_busy_window_leaves_out_the_drain_of_a_closed_loop(engine):
    """benchmarks/budget_policy.py at 4 streams, 3 requests a stream: plain decoding's streams
    all finished at the same step, a tree budget's one by one, and its last ~30 of ~220 steps
    decoded one or two sequences -- ~7% of the pass that was not 4 concurrent streams. The busy
    window counts only the steps that began with every stream holding a request: with streams
    of unequal lengths it leaves out the drain's steps and their tokens, with equal ones it is
    the whole run."""
    from ddtree import load_bench

    short = engine.render_chat([{"role": "user", "content": "Hi."}])
    equal = load_bench.run_inprocess(engine, [short], 0, 2, 2, 8)
    assert equal.busy_tokens == equal.tokens
    assert equal.busy_seconds == pytest.approx(equal.seconds, rel=0.05)
    # 3 requests on 2 streams: the third (greedy, the same prompt: as many tokens as each of the
    # first two) runs alone once they finish
    uneven = load_bench.run_inprocess(engine, [short], 0, 2, 3, 8)
    assert uneven.requests == 3 and uneven.busy_tokens * 3 == uneven.tokens * 2
    assert 0 < uneven.busy_seconds < uneven.seconds


def test_a_closed_loop_gives_each_request_its_own_length(engine):
    """With one length for every request, plain decoding's streams finish in lockstep and its
    batch never drains: at 16 streams on the mixed prompts plain ran 203.5 tokens/s with 64
    tokens a request and 173.9 with lengths drawn from 32-96 (auto 191.0 and 181.4). The
    benchmark can give request i its own max tokens (the list's i-th, modulo its length), and
    the greedy tokens each request emits stop there."""
    from ddtree import load_bench

    short = engine.render_chat([{"role": "user", "content": "Hi."}])
    row = load_bench.run_inprocess(engine, [short], 0, 2, 3, [3, 5])
    # requests 0, 1, 2 get 3, 5, 3 tokens (unless the model stops first: never more)
    assert row.requests == 3 and row.tokens <= 11
    fixed = load_bench.run_inprocess(engine, [short], 0, 2, 3, 5)
    assert row.tokens == min(fixed.tokens // 3, 3) * 2 + min(fixed.tokens // 3, 5)


def test_a_tp2_cuda_engines_kv_pool_is_sized_by_its_shards_memory(tiny_checkpoint):
    """serve.app gives a tp > 1 engine replica no GPU (its shards hold them), yet the replica
    sized the KV pool by torch.cuda.mem_get_info of a GPU it did not have: the shipped NVLink
    RayService could not start. The limits are a function of the memory a shard reports (its
    own device's: workers.kv_pool.pool_memory), here a real tiny shard on this machine's CPU,
    each shard holding half of a token's keys and values."""
    import json

    import torch

    from ddtree.engine import batch_limits
    from ddtree.workers.distributed import TargetShardWorker, WorkerSpec
    from ddtree.workers.kv_pool import KVStorage
    from ddtree.workers.model import ModelConfig

    _, _, directory = tiny_checkpoint("llama", 97)
    config = ModelPairConfig(model=str(directory), tp=2, device="cuda", dtype="float64", max_num_seqs=4)
    model = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    per_shard = KVStorage.bytes_per_token(model, torch.float64) // 2
    assert batch_limits(config, model, torch.float64, 300 * per_shard).kv_cache_tokens == 300
    assert batch_limits(config, model, torch.float64, 10**15).kv_cache_tokens == 4 * model.max_position_embeddings
    assert batch_limits(config, model, torch.float64, 0).kv_cache_tokens == 4 * config.kv_page_tokens  # four pages
    shard = TargetShardWorker(WorkerSpec(str(directory), None, 8, "float64", 2, 1), rank=1)
    memory = shard.pool_memory()
    assert memory > 0
    expected = min(memory // per_shard, 4 * model.max_position_embeddings)
    assert batch_limits(config, model, torch.float64, memory).kv_cache_tokens == expected


def test_cuda_graphs_auto_captures_on_cuda_only_and_on_refuses_elsewhere():
    """`cuda_graphs` maps onto workers.graphs.GraphSettings: 'auto' captures on CUDA at tp 1
    (batch buckets up to the first holding max_num_seqs, steps up to max_step_tokens rows, the
    drafter's layers, the configured allowance) and nothing elsewhere; 'on' where graphs cannot
    run is an error that names the field, from the config when its device says so, else from
    the engine once the device is known; 'off' captures nothing."""
    import torch
    from pydantic import ValidationError

    from ddtree.engine import graph_settings
    from ddtree.workers.scheduler import BatchLimits

    limits = BatchLimits(max_num_seqs=12, max_step_tokens=512)
    auto = ModelPairConfig(cuda_graphs_max_bytes=1 << 20, cuda_graphs_max_s=5.0, cuda_graphs_max_context=1024)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    settings = graph_settings(auto, cuda, limits, (1, 3))
    assert settings.batch_buckets == (1, 2, 4, 8, 16) and settings.max_rows == 512
    assert (settings.max_bytes, settings.max_s, settings.max_context) == (1 << 20, 5.0, 1024)
    assert settings.capture_layers == (1, 3)
    assert graph_settings(auto, cpu, limits, (1, 3)) is None
    assert graph_settings(ModelPairConfig(cuda_graphs="off"), cuda, limits, ()) is None
    assert graph_settings(ModelPairConfig(device="cuda", tp=2), cuda, limits, ()) is None
    assert graph_settings(ModelPairConfig(cuda_graphs="on"), cuda, BatchLimits(max_num_seqs=64), ()).batch_buckets[-1] == 64
    with pytest.raises(ValueError, match="cuda_graphs 'on' needs the in-process engine on CUDA"):
        graph_settings(ModelPairConfig(cuda_graphs="on"), cpu, limits, ())  # device auto, no GPU here
    if not torch.cuda.is_available():  # the engine says it before loading a model (none is at this path)
        with pytest.raises(ValueError, match="cuda_graphs 'on' needs the in-process engine on CUDA"):
            Engine.from_config(ModelPairConfig(model="/no/such/model", cuda_graphs="on"))
    for bad in (dict(device="cpu"), dict(device="cuda", tp=2)):
        with pytest.raises(ValidationError, match="cuda_graphs 'on'"):
            ModelPairConfig(cuda_graphs="on", **bad)


def test_an_engine_on_the_cpu_captures_no_graphs(engine):
    """`cuda_graphs: auto` (the default) on the CPU: the target runs every verify eagerly and
    packed, and the engine reports no graphs."""
    assert engine.config.cuda_graphs == "auto"
    assert engine.scheduler.target.graph_settings is None and engine.scheduler.target.graphs is None
    assert engine.scheduler.target.packs_rows and engine.graph_stats is None


def test_a_graphed_engine_gives_plain_decoding(engine, tiny_chat_model, monkeypatch):
    """The engine with its verify forwards captured: the settings `cuda_graphs` gives on CUDA
    reach the engine's LocalBatchTarget (here the device is told to be CUDA, so the graphs are
    workers.graphs' CPU stand-in, each bucket replaying the padded forward over its static
    buffers), which pads every verify step instead of packing it; a greedy and a seeded request
    at budget 8 give the tokens plain decoding gives, through replayed buckets."""
    import torch

    from ddtree import engine as engine_module

    real = engine_module.graph_settings
    monkeypatch.setattr(engine_module, "graph_settings", lambda config, dev, *args: real(config, torch.device("cuda"), *args))
    graphed = Engine.from_config(ModelPairConfig(model=str(tiny_chat_model), budget=8, block_size=4, dtype="float64",
                                                 max_num_seqs=2, max_step_tokens=34, cuda_graphs_max_context=64))
    target = graphed.scheduler.target
    assert target.graph_settings.batch_buckets == (1, 2) and target.graph_settings.max_rows == 34
    assert target.graph_settings.capture_layers == tuple(graphed.scheduler.drafter.target_layer_ids)
    assert not target.packs_rows and graphed.graph_stats is target.graphs.stats
    assert graphed.graph_stats.captured == 13  # (1, 1 ... 33) and (2, 1 ... 17): 7 + 6 row buckets
    prompt = engine.render_chat([{"role": "user", "content": "Tell me about trees."}])
    requests = [engine.request(prompt, 10, SamplingParams()),
                engine.request(prompt, 10, SamplingParams(temperature=0.8, top_p=0.9, seed=5))]
    replays = graphed.graph_stats.replays
    got = graphed.generate(requests)
    assert [r.tokens for r in got] == [r.tokens for r in engine.generate([engine.request(prompt, 10, r.sampling, budget=0)
                                                                          for r in requests])]
    assert any(r.tree_size > 1 for res in got for r in res.rounds) and graphed.graph_stats.replays > replays


def test_a_graphed_replica_counts_the_steps_it_serves_eagerly(tiny_chat_model, monkeypatch):
    """The eager-steps metric of a graphed replica: verify steps whose context outgrows every
    captured graph (`cuda_graphs_max_context` 64 here) run eagerly, and after a request that
    passes that length the replica's gauge shows those served steps and only those (start-up's
    own forwards left out), as its /health details do. The graphs are workers.graphs' CPU
    stand-in, the device told to be CUDA as above."""
    import asyncio

    import torch

    from ddtree import engine as engine_module
    from ddtree.serve.engine_server import EngineServer

    real = engine_module.graph_settings
    monkeypatch.setattr(engine_module, "graph_settings", lambda config, dev, *args: real(config, torch.device("cuda"), *args))
    server = EngineServer({"model": str(tiny_chat_model), "budget": 0, "block_size": 4, "dtype": "float64",
                           "max_num_seqs": 1, "max_step_tokens": 34, "cuda_graphs_max_context": 64})
    stats = server.engine.graph_stats
    before = stats.eager_steps
    assert server.metrics.eager_total == 0

    async def run():
        body = {"kind": "chat", "messages": [{"role": "user", "content": "Tell me about trees."}], "max_tokens": 60,
                "temperature": 0}
        return [event async for event in server.stream(body)]

    events = asyncio.run(run())
    assert events[-1]["type"] == "end" and events[-1]["usage"]["prompt_tokens"] + 60 > 64
    assert stats.eager_steps > before, "the steps past a context of 64 ran outside the graphs"
    assert server.metrics.eager_total == stats.eager_steps - before == server.graph_info()["eager_steps"] - before
