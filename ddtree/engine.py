"""The engine: a model pair loaded from its config and the batched step loop over it
(workers.scheduler), plus the tokenizer's side of a request (chat template, EOS, decoding).

`Engine.generate` / `Engine.stream` are the API of callers that own the engine (the CLI, bench,
calibration, tests): they run the step loop on the calling thread. A server drives
`Engine.scheduler` from one thread instead (serve.engine_server.BatchDriver). At tp > 1 the
models and the step loop live in Ray actors (workers.distributed) behind the same API."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Iterator

import torch

from .config import GenerateConfig, ModelPairConfig, SamplingParams
from .workers.drafter import DFlashDrafter
from .workers.graphs import BATCH_BUCKETS, GraphSettings, GraphStats
from .workers.kv_pool import KVStorage, pool_memory
from .workers.loading import LoadedTarget, load_target, load_tokenizer, target_directory
from .workers.model import KernelBackends, ModelConfig, kernel_backends
from .workers.requests import Budget, Request, Result, Update, check_budget, tree_rows
from .workers.scheduler import BatchLimits, Scheduler, bucket


logger = logging.getLogger("ddtree")

SHIPPED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"

# The chat template's variables by target family when the config names none. Qwen3's template
# opens a <think> block unless enable_thinking is false; z-lab's DFlash drafters for Qwen3 were
# trained on non-thinking answers (and their benchmark turns thinking off), so thinking output
# would cost most of their acceptance. The rule is the target's family, not the drafter, so a
# prompt renders the same with any drafter and at any budget.
CHAT_TEMPLATE_DEFAULTS = {"qwen3": {"enable_thinking": False}}
# apply_chat_template's own arguments: not template variables.
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def default_chat_template_kwargs(directory: Path) -> dict:
    """CHAT_TEMPLATE_DEFAULTS for the target in `directory` (by its config.json's model_type);
    training renders its prompts with the same, so a drafter learns what it will be served."""
    family = json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    return dict(CHAT_TEMPLATE_DEFAULTS.get(family, {}))


def shipped_drafter() -> Path | None:
    """The trained drafter this package ships for the default target, if any."""
    return SHIPPED_DRAFTER if (SHIPPED_DRAFTER / "model.safetensors").is_file() else None


def device(config: ModelPairConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def engine_threads(config: ModelPairConfig) -> tuple[int, str]:
    """How many intra-op threads this engine process uses, and why: `threads` when set, else
    the CPUs Ray reserved for this actor (so replicas on one machine never oversubscribe its
    cores: two processes with 2 OpenMP threads each on 2 cores slow a GEMM 10-30x), at most the
    cores this process may run on (a cluster may declare more CPUs than the machine has), else
    those cores."""
    if config.threads is not None:
        return config.threads, "threads in the config"
    ray = sys.modules.get("ray")  # a process that never imported Ray is no Ray actor
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        cores = len(os.sched_getaffinity(0))
        if cpus > cores:
            return cores, f"Ray reserved {cpus:g} CPUs for this actor, on {cores} cores"
        return max(1, int(cpus)), f"Ray reserved {cpus:g} CPUs for this actor"
    return len(os.sched_getaffinity(0)), "the cores this process may run on"


def batch_limits(config: ModelPairConfig, model: ModelConfig, dtype: torch.dtype, memory: int) -> BatchLimits:
    """The scheduler's limits. The KV pool: `kv_cache_tokens` when the config sets it, else
    what `memory` bytes hold (workers.kv_pool.pool_memory of the device that holds the pool; at
    tp > 1 the least any shard reports, each shard holding 1/tp of a token's keys and values),
    at most `max_num_seqs` full contexts and at least four pages.

    Example: memory 8 MiB, 4 KiB of keys and values a token over 2 shards -> 4096 tokens."""
    tokens = config.kv_cache_tokens
    if tokens is None:
        per_token = max(1, KVStorage.bytes_per_token(model, dtype) // config.tp)
        tokens = min(memory // per_token, config.max_num_seqs * model.max_position_embeddings)
        tokens = max(tokens, config.kv_page_tokens * 4)
    return BatchLimits(config.max_num_seqs, config.max_waiting, config.max_prefill_tokens, config.max_step_tokens,
                       tokens, config.kv_page_tokens)


def check_graphs(config: ModelPairConfig, dev: torch.device) -> None:
    """ValueError when `cuda_graphs: on` cannot be kept: the engine would run on `dev`, not CUDA
    (the config refuses a CPU device and tp > 1 itself; `device: auto` resolves only here)."""
    if config.cuda_graphs == "on" and dev.type != "cuda":
        raise ValueError(f"cuda_graphs 'on' needs the in-process engine on CUDA; it runs on {dev.type}: set "
                         "cuda_graphs 'auto' or 'off'")


def graph_settings(config: ModelPairConfig, dev: torch.device, limits: BatchLimits,
                   capture_layers: tuple[int, ...]) -> GraphSettings | None:
    """What the engine captures as CUDA graphs (workers.graphs), from `cuda_graphs` and the
    device the target runs on: None when it captures nothing ('off'; 'auto' off CUDA or at
    tp > 1), ValueError for 'on' where graphs cannot run. The batch buckets stop at the first
    one that holds max_num_seqs sequences, the largest step at max_step_tokens rows; the graphs
    return the drafter's layers (`capture_layers`).

    Example: cuda_graphs 'auto', CUDA, max_num_seqs 12 -> batch buckets (1, 2, 4, 8, 16)."""
    check_graphs(config, dev)
    if config.cuda_graphs == "off" or dev.type != "cuda" or config.tp > 1:
        return None
    held = [b for b in BATCH_BUCKETS if b >= limits.max_num_seqs][:1]
    return GraphSettings(batch_buckets=tuple(b for b in BATCH_BUCKETS if b < limits.max_num_seqs) + tuple(held),
                         max_bytes=config.cuda_graphs_max_bytes, max_s=config.cuda_graphs_max_s,
                         max_rows=limits.max_step_tokens, max_context=config.cuda_graphs_max_context,
                         capture_layers=tuple(capture_layers))


class KernelsUnavailable(RuntimeError):
    """`deterministic: true` and no batch-invariant kernels can run the target here."""


def check_kernels(config: ModelPairConfig) -> KernelBackends:
    """The backends this process runs the target's linears and attention through, said in the
    log: the bitwise kernels, or the fallback and why. KernelsUnavailable instead of a fallback
    when the config asks for `deterministic`. On CUDA, `deterministic` selects the batch-invariant
    Triton kernels (tp 1 only: the TargetShard actors do not take them). (At tp > 1 on the CPU
    the TargetShard actors load the build of their own machine; this checks the engine's.)"""
    on_cuda = device(config).type == "cuda"
    if config.deterministic and on_cuda and config.tp > 1:
        raise KernelsUnavailable(
            "deterministic: true on CUDA runs the batch-invariant Triton kernels in the in-process engine (tp 1); "
            "the tensor-parallel shards do not take them. Set tp: 1, or deterministic: false (docs/gpu.md)")
    backends = kernel_backends(getattr(torch, config.dtype), device(config), config.weights,
                               batch_invariant=config.deterministic)
    if backends.bitwise:
        logger.info("ddtree engine: linears %s, attention %s (%s: bitwise, batch-invariant)", backends.linear,
                    backends.attention, "Triton" if backends.triton_invariant else "ddtree_cpu")
    elif config.deterministic:
        raise KernelsUnavailable(
            f"deterministic: true needs batch-invariant kernels for the target's linears and attention (ddtree's "
            f"bitwise CPU kernels, or on CUDA the batch-invariant Triton kernels); here "
            f"they would run through {backends.linear} and {backends.attention}: {backends.reason}. Or set "
            f"deterministic: false to serve through that fallback (docs/cpu-kernels.md, docs/gpu.md)")
    else:  # a warning where the kernels would serve (fp32 on the CPU) but cannot
        fp32_cpu = config.dtype == "float32" and device(config).type == "cpu"
        logger.log(logging.WARNING if fp32_cpu else logging.INFO,
                   "ddtree engine: linears %s, attention %s, not ddtree's bitwise CPU kernels (%s): rows move with "
                   "the row count, so near-ties can break unlike plain decoding (docs/cpu-kernels.md)",
                   backends.linear, backends.attention, backends.reason)
    return backends


def freeze_startup() -> None:
    """For a process that holds one engine for its life (a Serve replica, a benchmark): every
    object alive now -- the imports, the models' modules, the tokenizer: ~370k objects the cycle
    collector tracks for SmolLM2 -- leaves the collector's reach (`gc.freeze`), so a full
    collection scans only what the step loop made since. Scanned whole, a full collection took
    144 ms, a stall of every stream, about once in two 18 s passes at 64 streams under `budget:
    auto` (whose step loop makes more objects than plain decoding's). Not for a process that
    makes and drops engines: an engine is a reference cycle (its scheduler holds its `decode`),
    and a dropped frozen one is never collected."""
    gc.collect()
    gc.freeze()


@dataclass
class Engine:
    config: ModelPairConfig
    target: LoadedTarget  # its model is None when the target lives in TargetShard actors (tp > 1)
    scheduler: Scheduler  # the step loop (tp > 1: a workers.distributed.RemoteScheduler, the same API)
    block_size: int  # the drafter's block: a chain drafts block_size - 1 tokens
    instance: object | None = None  # tp > 1: the workers.distributed.RayInstance holding the actors
    backends: KernelBackends | None = None  # what runs the target's linears and attention (check_kernels)

    @classmethod
    def from_config(cls, config: ModelPairConfig) -> "Engine":
        dtype = getattr(torch, config.dtype)
        check_graphs(config, device(config))  # before minutes of loading
        backends = check_kernels(config)
        threads, why = engine_threads(config)
        torch.set_num_threads(threads)
        logger.info("ddtree engine: %d intra-op threads (%s)", threads, why)
        # The drafter is loaded even at budget 0, so that a request may ask for another budget.
        drafter_path = config.drafter or (shipped_drafter() if config.model is None else None)
        if config.tp > 1:
            from .workers.distributed import RayInstance, WorkerSpec

            directory = target_directory(config.model)
            target = LoadedTarget(None, load_tokenizer(directory), directory)  # the weights live in the shards
            threads = max(1, torch.get_num_threads() // config.tp)
            spec = WorkerSpec(str(directory), str(drafter_path) if drafter_path else None, config.block_size,
                              config.dtype, config.tp, threads, config.lookup, config.topk)
            model_config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
            # this process holds no GPU (serve.app gives a tp > 1 replica none): the pool's size
            # comes from the memory the shards report once they are up
            limits = partial(batch_limits, config, model_config, dtype)
            instance = RayInstance(spec, config.budget, config.placement, limits)
            engine = cls(config, target, instance.scheduler, instance.block_size, instance, backends)
        else:
            if config.weights == "native" and device(config).type != "cpu":
                raise ValueError("weights='native' runs on CPU: set device 'cpu', or weights 'float' for the GPU")
            target = load_target(config.model, dtype, config.weights)
            target.model.to(device(config))
            if backends.triton_invariant:
                target.model.use_batch_invariant_kernels()
            drafter = (
                DFlashDrafter.load(drafter_path, target.model)
                if drafter_path
                else DFlashDrafter.untrained(target.model, block_size=config.block_size)
            ).to(device(config))
            engine = cls(config, target, None, drafter.block_size, backends=backends)
            limits = batch_limits(config, target.model.config, dtype, pool_memory(target.model.device))
            graphs = graph_settings(config, target.model.device, limits, tuple(drafter.target_layer_ids))
            engine.scheduler = Scheduler.local(target.model, drafter, config.budget, limits, engine.decode,
                                               lookup=config.lookup, topk=config.topk, graphs=graphs)
            # the budget policy's T(r), for the deployment's budget or any request's "auto" (tp > 1:
            # the SchedulerActor measures it)
            from .calibrate import step_costs

            engine.scheduler.policy.calibrate(step_costs(engine))
        return engine

    @property
    def graph_stats(self) -> GraphStats | None:
        """The captured verify graphs' count, seconds and bytes (workers.graphs), and the steps that
        ran eagerly since; None when the engine captures none (`cuda_graphs`)."""
        graphs = getattr(self.scheduler.target, "graphs", None) if isinstance(self.scheduler, Scheduler) else None
        return graphs.stats if graphs is not None else None

    @property
    def budget(self) -> Budget:
        """The budget requests run at unless they ask for another (auto resolved)."""
        return self.scheduler.budget

    @budget.setter
    def budget(self, budget: Budget) -> None:
        self.scheduler.budget = self.check_budget(budget)

    def check_budget(self, budget: Budget, max_budget: int | None = None) -> Budget:
        """`budget` if this engine can run it (under `max_budget`), else ValueError. Every
        engine holds a drafter (an untrained one when none is named)."""
        return check_budget(budget, has_drafter=True, max_budget=max_budget)

    def generate(self, requests: list[Request]) -> list[Result]:
        """The requests as one batch, to the end; results in request order."""
        return self.scheduler.generate(requests)

    def stream(self, request: Request) -> Iterator[Update]:
        """One request's updates as the step loop produces them (the loop runs here, so the
        engine must not be driven by another thread meanwhile)."""
        seq_id, done = self.scheduler.add(request), False
        try:
            while not done:
                for sid, update in self.scheduler.step():
                    if sid == seq_id:
                        done = update.result is not None
                        yield update
        finally:
            if not done:  # a consumer that stopped early: the sequence leaves, its pages come back
                self.scheduler.cancel(seq_id)

    def verify_len(self, budget: Budget) -> int | None:
        """Q: the verify rows a lone request at `budget` runs (its tree's rows, bucketed); None
        for "auto", whose Q the policy chooses every step."""
        return None if budget == "auto" else bucket(tree_rows(budget, self.block_size))

    def shutdown(self) -> None:
        """Releases the Ray actors of a tp > 1 engine (nothing to do in process)."""
        if self.instance is not None:
            self.instance.shutdown()

    @cached_property
    def context_length(self) -> int:
        config = json.loads((self.target.directory / "config.json").read_text())
        return ModelConfig.from_hf(config).max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.target.tokenizer.eos_token_id
        return (eos,) if eos is not None else ()

    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    @cached_property
    def chat_template_kwargs(self) -> dict:
        """The chat template's extra variables for this pair: the config's, else the default
        for the target's family (CHAT_TEMPLATE_DEFAULTS)."""
        if self.config.chat_template_kwargs is not None:
            return dict(self.config.chat_template_kwargs)
        return default_chat_template_kwargs(self.target.directory)

    def render_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
        """Messages rendered with the model's own chat template, ready for the assistant's turn;
        `chat_template_kwargs` (a request's) are merged over the pair's. ValueError names a key
        that is apply_chat_template's own argument rather than a template variable."""
        kwargs = {**self.chat_template_kwargs, **(chat_template_kwargs or {})}
        reserved = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        tok = self.target.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.target.tokenizer.encode(text)

    def request(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        budget: Budget | None = None,
        lookup: bool | None = None,
        topk: int | None = None,
    ) -> Request:
        return Request(prompt, max_tokens, tuple(stop), self.eos_token_ids, sampling, budget, lookup, topk)

    def chat_requests(self, user_messages: list[str], config: GenerateConfig) -> list[Request]:
        """`ddtree generate`'s requests: each message is one user turn."""
        return [
            self.request(self.render_chat([{"role": "user", "content": m}]), config.max_tokens, config.sampling,
                         tuple(config.stop))
            for m in user_messages
        ]
