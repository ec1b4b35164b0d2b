"""A compact llama / qwen3 decoder with an explicit KV cache and a tree-verify forward.

One forward serves every phase of the speculative round: the prompt prefill (a causal block),
plain decoding (a block of one), and tree verification (a block whose attention mask is the
ancestor relation of the tree). The block always sees the whole committed prefix in the cache;
inside the block it sees what `block_mask` allows. Hugging Face module names are kept so that
checkpoints load with `load_state_dict` as they are.

Shapes: B = batch, Q = block length, P = cache prefix length read, H = hidden size,
Hq / Hkv = query / key-value heads, D = head dim, V = vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GREEDY
from ..kernels.batched import sampled_choices, tree_attention
from ..kernels.sampling import RowSampling, choose_tokens, is_greedy, processed_probs_rows
from ..kernels.tree_batch import unpack_bits
from ..kernels.triton_support import ATTENTION_HEAD_DIMS, triton_available, use_triton
from . import cpu_kernels

FAMILIES = ("llama", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" (SmolLM2, Llama-3.x) or "qwen3" (adds q/k RMSNorm per head)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None  # resolved by read_rope: {"rope_type": "llama3" | "linear" | "yarn", ...}
    max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Reads a Hugging Face config.json dict (transformers 4.x or 5.x spelling). Refuses what
        this model code would run differently from transformers (see read_rope, require_full_attention)."""
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise ValueError(
                f"model_type {family!r} is not supported; ddtree implements {', '.join(FAMILIES)}"
            )
        require_full_attention(hf, "target")
        theta, scaling = read_rope(hf, "target")
        heads = hf["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        )


def require_full_attention(hf: dict, what: str) -> None:
    """Refuses sliding-window layers: every layer here attends to the whole prefix, so running a
    sliding-window layer as a full one would silently change the output past the window.

    The layer kinds are `layer_types` when the config names them (transformers >= 4.54 writes
    it; all "full_attention" loads), else what transformers derives for qwen3 from the older
    fields: `use_sliding_window` with a `sliding_window` makes layers >= `max_window_layers`
    sliding."""
    layers = hf.get("num_hidden_layers", 0)
    kinds = hf.get("layer_types")
    if kinds is None and hf.get("use_sliding_window") and hf.get("sliding_window"):
        first = hf.get("max_window_layers", 28)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    other = sorted({k for k in kinds or () if k != "full_attention"})
    if other:
        raise ValueError(
            f"{what} config: layer_types {other} are not supported: ddtree implements full-attention layers "
            f"only and refuses to run {other[0]!r} layers as full attention (the output would differ)"
        )


# --- rotary position embedding --------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def read_rope(hf: dict, what: str) -> tuple[float, dict | None]:
    """(theta, scaling) of a config.json: `rope_theta` and `rope_scaling` (transformers 4.x) or
    `rope_parameters` (5.x). scaling is None for plain RoPE, else a dict with its `rope_type` and
    `original_max_position_embeddings` filled in as transformers fills them. Types other than
    ROPE_TYPES are refused: `dynamic` rescales with the sequence length (a prefix's keys would
    change as it grows), `longrope` switches frequencies by length."""
    rope = dict(hf.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{what} config: rope_parameters per layer type are not supported")
    scaling = {**(hf.get("rope_scaling") or {}), **rope}
    theta = float(hf.get("rope_theta", scaling.pop("rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{what} config: rope_type {rope_type!r} is not supported; ddtree implements {', '.join(ROPE_TYPES)}"
        )
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{what} config: partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
    if rope_type == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return theta, scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float):
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled), 1.0


def _linear_inv_freq(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float):
    """Position interpolation: every position divided by `factor`."""
    return inv_freq / s["factor"], 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float):
    """YaRN (Peng et al. 2023): dimensions that turn more than `beta_fast` times over the original
    context keep their frequency, those turning fewer than `beta_slow` times are interpolated
    (divided by `factor`), a linear ramp blends the ones between; cos and sin are multiplied by
    the attention factor 0.1 ln(factor) + 1 (or the ratio of the `mscale` / `mscale_all_dim`
    versions, or `attention_factor` as given).

    Example: head_dim 8, theta 10000, factor 4, original context 16 -> the dimension that turns
    r times over 16 positions is 8 ln(16 / (2 pi r)) / (2 ln 10000); r = 32 gives < 0 (so 0) and
    r = 1 gives 0.41, ceil 1: pair 0 keeps its frequency, pairs 1-3 are divided by 4."""
    factor, old_ctx = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turning_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_ctx
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turning_dim(s.get("beta_fast") or 32), turning_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention)


ROPE_SCALINGS = {"llama3": _llama3_inv_freq, "linear": _linear_inv_freq, "yarn": _yarn_inv_freq}


@dataclass(frozen=True)
class Rope:
    """What a forward needs to rotate queries and keys."""

    inv_freq: torch.Tensor  # [D/2] float64
    attention_factor: float = 1.0  # cos and sin are multiplied by it (YaRN); 1 otherwise

    def to(self, device) -> "Rope":
        return Rope(self.inv_freq.to(device), self.attention_factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Rope:
    """The rotary frequencies of a config (read_rope's theta and scaling), in float64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if not scaling:
        return Rope(inv_freq)
    return Rope(*ROPE_SCALINGS[scaling["rope_type"]](inv_freq, scaling, head_dim, theta))


def rope_cos_sin(positions: torch.Tensor, rope: Rope, dtype: torch.dtype):
    """positions [B, Q] int64 -> cos, sin [B, 1, Q, D] (broadcast over heads)."""
    freqs = positions.to(torch.float64)[..., None] * rope.inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = rope.attention_factor
    return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with cos, sin broadcast to it (e.g. x [B, heads, Q, D], cos [B, 1, Q, D]);
    rotate-half convention of Hugging Face llama / qwen3."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [*rows, Hq, D] and k [*rows, Hkv, D] rotated (apply_rope; cos, sin [*rows, 1, D]): one
    op where `row_ops` serves, else one set of torch ops for both."""
    if row_ops(q, k, cos, sin):
        both = torch.ops.ddtree_cpu.rope_qk(q, k, cos, sin)
    else:
        both = apply_rope(torch.cat([q, k], dim=-2), cos, sin)
    return both.split([q.shape[-2], k.shape[-2]], dim=-2)


# --- building blocks ------------------------------------------------------------------------


class RMSNorm(nn.Module):
    batch_invariant = False  # the batch-invariant Triton norm where Triton serves (TargetModel.use_batch_invariant_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant_route(self.batch_invariant, x):
            from ..kernels.batch_invariant import invariant_rms_norm

            return invariant_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        if dtype in (torch.float16, torch.bfloat16):  # normalise in fp32, as the reference does
            return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(dtype)
        if row_ops(x, self.weight):
            return torch.ops.ddtree_cpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, this norm of it): a residual add and the norm after it, one op where
        `row_ops` serves."""
        if row_ops(x, r, self.weight) and not invariant_route(self.batch_invariant, x):
            return torch.ops.ddtree_cpu.add_rms_norm(x, r, self.weight, self.eps)
        x = x + r
        return x, self(x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, one op where `row_ops` serves."""
    if row_ops(gate, up):
        return torch.ops.ddtree_cpu.silu_mul(gate, up)
    return F.silu(gate) * up


def row_ops(*tensors: torch.Tensor) -> bool:
    """Whether the row-wise steps between a layer's GEMMs (norms, the residual add before the
    MLP's norm, the MLP's gating, the rotation) run as ddtree_cpu's one-op kernels: for fp32 on the CPU where
    `linear` takes float_mm, without gradients (the kernels have no backward). At the few rows of
    decoding each torch op's first call after a GEMM costs tens of microseconds whatever its size
    (workers/cpu_kernels/rowops.cpp): SmolLM2's plain decoding at one stream ran 1.06-1.2x
    as fast with the norm alone as one op."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return not torch.is_grad_enabled() and fp32_route() == "float_mm"


def invariant_route(batch_invariant: bool, x: torch.Tensor) -> bool:
    """Whether a layer set `batch_invariant` (`deterministic: true` on the GPU) computes `x`
    through the batch-invariant Triton kernels (kernels.batch_invariant): where the Triton route
    serves (`use_triton`: CUDA tensors), without gradients (the kernels have no backward)."""
    return batch_invariant and use_triton(x) and not torch.is_grad_enabled()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """F.linear; with `batch_invariant` where `invariant_route` serves, the fixed-tile Triton
    GEMM (kernels.batch_invariant.invariant_linear: no split-K, a row's result whatever the row
    count). For float32 on the CPU, ddtree's own GEMM (workers/cpu_kernels/gemm.cpp, float_mm), else
    oneDNN where the kernel cannot be built. Measured on this 2-core AVX2 machine over SmolLM2's
    matrices: the kernel takes 0.6x oneDNN's time at 1 row and ~0.5x at 9-17 (oneDNN: 0.73x
    MKL's F.linear, whose small-row GEMMs are slow here; benchmarks/verify_cost.py --linear), and
    it is batch-invariant: a row's output is bitwise the same whichever rows come with it, so a
    tree's verify rows compute exactly what plain decoding computes. With gradients on
    (training a drafter through the target's head) it is F.linear."""
    if invariant_route(batch_invariant, x):
        from ..kernels.batch_invariant import invariant_linear

        return invariant_linear(x, weight, bias)
    if (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.float32
            and not torch.is_grad_enabled()):  # the C++ and oneDNN ops have no backward
        route = fp32_route()
        if route == "float_mm":
            out = torch.ops.ddtree_cpu.float_mm(x.reshape(-1, x.shape[-1]), weight)
            out = out.view(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out.add_(bias)
        if route == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


LINEAR_BACKEND = "ddtree"  # "ddtree": float_mm (oneDNN if it cannot be built); "onednn"; "torch": F.linear


def fp32_route() -> str:
    """The GEMM that `linear` takes for fp32 on the CPU under LINEAR_BACKEND, as this process
    can run it: "float_mm", "onednn" or "torch"."""
    if LINEAR_BACKEND == "ddtree" and cpu_kernels.float_kernel():
        return "float_mm"
    return "onednn" if LINEAR_BACKEND in ("ddtree", "onednn") and torch.backends.mkldnn.is_available() else "torch"


def linear_route() -> str:
    """fp32_route named down to the kernel's build (and the attention's route), so that timings
    measured through one route are never reused for another (ddtree.calibrate)."""
    route = fp32_route()
    named = f"{route}:{cpu_kernels.kernel_key()}" if route == "float_mm" else route
    return named + ("" if ATTENTION_BACKEND == "ddtree" else f"+{ATTENTION_BACKEND}-attention")


ATTENTION_BACKEND = "ddtree"  # "ddtree": ddtree_cpu.tree_attention where it serves (below); "torch": SDPA
ATTENTION_MAX_ROWS = 65  # query rows per sequence up to which that holds: decode and verify steps, not long prefill chunks


def cpu_attention(keys: torch.Tensor, q_len: int) -> bool:
    """Whether a block of `q_len` rows per sequence over fp32 CPU storage `keys` attends through
    ddtree_cpu.tree_attention (workers/cpu_kernels/attention.cpp): keys and values read in place from the
    cache by offset, no gathered copy or dense mask, and every row's arithmetic its own, in the
    order plain decoding sees the same keys -- with float_mm's linears a verify row is bitwise
    plain decoding's. Prefill chunks longer than ATTENTION_MAX_ROWS, and head dimensions that are
    not a multiple of 8 (the kernel's lanes), take SDPA."""
    return (ATTENTION_BACKEND == "ddtree" and keys.dtype == torch.float32 and keys.device.type == "cpu"
            and q_len <= ATTENTION_MAX_ROWS and keys.shape[-1] % 8 == 0 and cpu_kernels.float_kernel())


INVARIANT_LINEAR = "invariant_mm"  # kernels.batch_invariant's Triton GEMM (`deterministic: true` on CUDA)
INVARIANT_ATTENTION = "paged_invariant"  # the paged tree-attention kernel with its tiles and splits fixed
BITWISE_LINEARS = ("float_mm", "blocks_mm", INVARIANT_LINEAR)  # a row's output whatever rows come with it
BITWISE_ATTENTION = ("tree_attention", INVARIANT_ATTENTION)


@dataclass(frozen=True)
class KernelBackends:
    """Which ops run a target's linears and its attention over the cache in this process (the
    engine says it at start-up, in /health and in the ddtree_kernel_backend_info metric). With
    ddtree_cpu's GEMMs and tree attention (or, on CUDA with `deterministic: true`, the
    batch-invariant Triton kernels) a tree node's logits are bitwise plain decoding's; any other
    backend moves rows with the row count, so near-ties can break differently
    (docs/cpu-kernels.md, "Numerics")."""

    # "float_mm" / "blocks_mm" (ddtree_cpu), "invariant_mm" (Triton, CUDA), "onednn" (fp32 fallback) or "torch" (F.linear)
    linear: str
    # "tree_attention" (ddtree_cpu), "paged_invariant" (Triton, CUDA) or "sdpa" (torch's; Triton's kernel on CUDA)
    attention: str
    reason: str | None  # why batch-invariant kernels do not run both, None when they do

    @property
    def bitwise(self) -> bool:
        return self.linear in BITWISE_LINEARS and self.attention in BITWISE_ATTENTION

    @property
    def triton_invariant(self) -> bool:
        """Whether the target runs kernels.batch_invariant's Triton kernels
        (TargetModel.use_batch_invariant_kernels)."""
        return self.linear == INVARIANT_LINEAR

    def as_dict(self) -> dict:
        return {"linear": self.linear, "attention": self.attention, "bitwise": self.bitwise, "reason": self.reason}


INVARIANT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the batch-invariant Triton kernels take


def kernel_backends(dtype: torch.dtype, device: torch.device | str, weights: str = "float",
                    batch_invariant: bool = False) -> KernelBackends:
    """The backends a target of `dtype` on `device` runs here (weights "native": GGUF blocks
    through blocks_mm). ddtree_cpu serves fp32 on the CPU when its library is built and loads
    (workers.cpu_kernels), under LINEAR_BACKEND and ATTENTION_BACKEND "ddtree". On CUDA with
    `batch_invariant` (`deterministic: true`), the batch-invariant Triton kernels serve fp32,
    fp16 and bf16 where Triton is installed."""
    if torch.device(device).type == "cuda" and batch_invariant:
        if not triton_available():
            return KernelBackends("torch", "sdpa", "Triton is not installed: the batch-invariant GPU kernels are Triton's")
        if dtype not in INVARIANT_DTYPES:
            return KernelBackends("torch", "sdpa", f"the target is {str(dtype).removeprefix('torch.')}: the "
                                  "batch-invariant GPU kernels take float32, float16 and bfloat16")
        return KernelBackends(INVARIANT_LINEAR, INVARIANT_ATTENTION, None)
    if torch.device(device).type != "cpu":
        return KernelBackends("torch", "sdpa", f"the target runs on {torch.device(device).type}: ddtree_cpu serves the CPU")
    if dtype != torch.float32:
        return KernelBackends("torch", "sdpa", f"the target is {str(dtype).removeprefix('torch.')}: ddtree_cpu serves float32")
    route = fp32_route()
    linear = "blocks_mm" if weights == "native" and route == "float_mm" else route
    attention = "tree_attention" if ATTENTION_BACKEND == "ddtree" and cpu_kernels.float_kernel() else "sdpa"
    reason = cpu_kernels.unavailable_reason()
    if reason is None and (linear not in BITWISE_LINEARS or attention not in BITWISE_ATTENTION):
        reason = f"LINEAR_BACKEND {LINEAR_BACKEND!r}, ATTENTION_BACKEND {ATTENTION_BACKEND!r}"
    return KernelBackends(linear, attention, reason)


def dense_block_mask(block_mask, batch: int) -> torch.Tensor:
    """[B, Q, Q] bool of a block mask given as TreeBits or a [B or 1, Q, Q] bool tensor."""
    dense = block_mask.dense() if isinstance(block_mask, TreeBits) else block_mask
    return dense.to(torch.bool).expand(batch, -1, -1).contiguous()


@dataclass
class Packing:
    """The real rows of a block padded to Q rows per sequence: `index` [N] (ascending) of the
    B x Q rows that are not padding. A step pads every tree to one Q; on the CPU, where a
    GEMM's time grows with its rows, the linears, norms and LM head run over the N real rows
    only, and attention skips the padding rows (`rows`): the paged pool's takes the real rows as
    they are (`PagedView.attend_rows`), a dense cache's lays them out padded per sequence.
    float_mm and tree_attention compute each row by itself, so a real row's result is bitwise
    the padded forward's.

    Example: sizes [3, 1], Q = 3 -> index [0, 1, 2, 3], rows [3, 1]: sequence 1's rows 1 and 2
    are padding."""

    index: torch.Tensor  # [N] int64 into the flattened [B * Q] rows
    rows: torch.Tensor  # [B] int64 real rows per sequence (the first rows[b] of its block)
    batch: int
    q_len: int

    @classmethod
    def of(cls, rows: torch.Tensor, q_len: int) -> "Packing":
        real = torch.arange(q_len, device=rows.device)[None, :] < rows[:, None]
        return cls(real.view(-1).nonzero().view(-1), rows, rows.shape[0], q_len)

    @property
    def sequences(self) -> torch.Tensor:
        """[N] each real row's sequence b"""
        return self.index // self.q_len

    @property
    def positions(self) -> torch.Tensor:
        """[N] each real row's place in its block"""
        return self.index % self.q_len

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> [N, ...]"""
        return x.reshape(self.batch * self.q_len, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, Q, ...], zeros in the padding rows"""
        out = x.new_zeros(self.batch * self.q_len, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.batch, self.q_len, *x.shape[1:])


def packs_rows(device: torch.device) -> bool:
    """Whether a forward on `device` computes a padded block's real rows only (Packing): on
    the CPU, yes; on a GPU a verify's rows are nearly free and static shapes serve its graphs."""
    return torch.device(device).type == "cpu"


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) computing through `linear`."""

    batch_invariant = False  # the batch-invariant Triton GEMM where Triton serves (TargetModel.use_batch_invariant_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant)

    def select_rows(self, rows: torch.Tensor) -> "Linear":
        """A copy holding output rows `rows` only (a draft vocabulary's slice of an LM head)."""
        weight = self.weight.detach()
        out = Linear(self.in_features, len(rows), bias=self.bias is not None, device="meta")
        out.weight = nn.Parameter(weight[rows.to(weight.device)], requires_grad=False)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.detach()[rows.to(weight.device)], requires_grad=False)
        return out


class FusedLinears:
    """Linear layers that read the same input, computed by one GEMM: their weights (and biases)
    are stored as one matrix, each layer's own weight a view of its rows, so nothing is held
    twice and checkpoints load through the layers as they are. Fused at the first call, and
    again whenever a layer's weight was replaced (a load with assign=True, a .to() that copied).

    Example: q_proj [576, 576], k_proj [192, 576], v_proj [192, 576] -> one [960, 576] weight;
    calling it on x [B, Q, 576] gives the three outputs [B, Q, 576], [B, Q, 192], [B, Q, 192]."""

    def __init__(self, *layers: nn.Linear):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if torch.is_grad_enabled() and any(p.requires_grad for layer in self.layers for p in layer.parameters()):
            # training: each layer through its own parameters, or no gradient would reach them
            # (the fused matrix is a plain tensor; the shipped drafter was once trained for three runs
            # with its MLPs' gate and up projections frozen at their start)
            return tuple(layer(x) for layer in self.layers)
        # a traced forward (torch.compile) takes the weight fused at an eager call before it: the
        # check compares data pointers, which a graph cannot hold
        if self.weight is None or (not torch.compiler.is_compiling() and not self._fused()):
            self._fuse()
        return linear(x, self.weight, self.bias, self.layers[0].batch_invariant).split(self.sizes, dim=-1)

    def _fused(self) -> bool:
        """Whether every layer's weight is still the view of `weight` it was made."""
        if self.weight is None:
            return False
        row = self.weight.stride(0) * self.weight.element_size()
        at = self.weight.data_ptr()
        for layer, size in zip(self.layers, self.sizes):
            if layer.weight.data_ptr() != at or layer.weight.dtype != self.weight.dtype:
                return False
            at += size * row
        return True

    def _fuse(self) -> None:
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, as the layers' own were
            self.weight = torch.cat([layer.weight for layer in self.layers])
            for layer, part in zip(self.layers, self.weight.split(self.sizes)):
                layer.weight.data = part
            self.bias = None
            if self.layers[0].bias is not None:
                self.bias = torch.cat([layer.bias for layer in self.layers])
                for layer, part in zip(self.layers, self.bias.split(self.sizes)):
                    layer.bias.data = part


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(silu_mul(gate, up))


def attend(q, k, v, mask):
    """q [B, Hq, Q, D]; k, v [B, Hkv, K, D]; mask [B, 1, Q, K] bool (True = visible), or the
    same as an additive 0 / -inf mask in q's dtype.
    Grouped-query attention without copying k, v per query head."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@dataclass
class TreeBits:
    """The block mask as compact metadata (kernels.batched): bit j of bits[b, i] says whether
    block row i sees block column j. On CUDA the tree-attention kernels read it directly.
    With `rows` (each tree's size), the paged kernel lets a padding row see only itself, so a
    tile of padding rows skips the context; without, padding rows read the context too (their
    outputs are never read either way)."""

    bits: torch.Tensor  # [B, Q, ceil(Q / 32)] int32
    rows: torch.Tensor | None = None  # [B] int64 real rows per block (the rest padding), or None

    def dense(self) -> torch.Tensor:
        """[B, Q, Q] bool, for the reference path."""
        return unpack_bits(self.bits, self.bits.shape[1])

    def to(self, device) -> "TreeBits":
        return TreeBits(self.bits.to(device), None if self.rows is None else self.rows.to(device))


@dataclass
class KVCache:
    """Preallocated key/value slots. Slots [0, lengths[b]) of row b hold committed tokens;
    slots past it may hold stale rows of an earlier round and are never read."""

    k: torch.Tensor  # [L, B, Hkv, S, D]
    v: torch.Tensor  # [L, B, Hkv, S, D]
    lengths: torch.Tensor  # [B] int64, committed slots per row

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, slots: int, dtype, device="cpu"):
        shape = (config.num_hidden_layers, batch, config.num_key_value_heads, slots, config.head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(batch, dtype=torch.int64, device=device),
        )

    @property
    def slots(self) -> int:
        return self.k.shape[3]

    def bind(self, block_mask, q_len: int, rows: torch.Tensor | None = None,
             batch_invariant: bool = False) -> "DenseView":
        """(`batch_invariant` changes nothing here: the dense tree-attention kernel's tiles are
        fixed and it does not split; a bool mask on CUDA runs SDPA.)"""
        return DenseView(self, block_mask, q_len, rows)


def slot_mask(lengths: torch.Tensor, block_mask: torch.Tensor, span: int) -> torch.Tensor:
    """[B, Q, span] bool over cache slots: row b's block sits at slots lengths[b] ... + Q - 1.
    Query i sees every committed slot (< lengths[b]) and block slot lengths[b] + j where
    block_mask[b, i, j]; slots between a shorter row's block and `span` are never seen.

    Example: lengths [2], block_mask [[1, 0], [1, 1]], span 4 ->
        [[1, 1, 1, 0],
         [1, 1, 1, 1]]
    """
    b, q_len, _ = block_mask.shape
    rel = torch.arange(span, device=block_mask.device)[None, :] - lengths.to(block_mask.device)[:, None]  # [B, span]
    in_block = (rel >= 0) & (rel < q_len)
    columns = rel.clamp(0, q_len - 1)[:, None, :].expand(b, q_len, span)
    return (rel < 0)[:, None, :] | (in_block[:, None, :] & block_mask.gather(2, columns))


class DenseView:
    """A KVCache bound to one forward: row b's block goes to slots lengths[b] ... + Q - 1 and
    attends over slots [0, span) under `mask` [B, 1, Q, span] bool -- or, on the device path,
    under TreeBits read by the Triton tree-attention kernel (no host read of the lengths)."""

    def __init__(self, cache: KVCache, block_mask, q_len: int, rows: torch.Tensor | None = None):
        self.cache, self.rows = cache, rows  # rows: [B] real block rows per sequence (Packing), or None
        self.packs = False  # a packed forward's rows are laid out padded for `attend` (PagedView's may not be)
        kernel = uses_kernel(block_mask, cache.k)
        # the kernel bounds each row by its length; the reference reads [0, longest + Q)
        self.span = cache.slots if kernel else int(cache.lengths.max()) + q_len
        if self.span > cache.slots:
            raise ValueError(f"KV cache has {cache.slots} slots; this block needs {self.span}")
        self.cpu = cpu_attention(cache.k, q_len)
        if self.cpu:  # in place: key (b, head 0, slot p) sits at b * Hkv * S * D + p * D
            batch, kv_heads, slots, head_dim = cache.k.shape[1:]
            rows = torch.arange(batch, device=cache.k.device)[:, None] * (kv_heads * slots * head_dim)
            self.offsets = rows + torch.arange(slots, device=cache.k.device)[None, :] * head_dim
            self.mask = dense_block_mask(block_mask, batch)
        else:
            self.attention = block_attention(block_mask, cache.lengths, self.span, kernel)

    def attend(self, layer: int, q, k, v):
        """q [B, Hq, Q, D]; k, v [B, Hkv, Q, D] of the block -> [B, Hq, Q, D]."""
        cache, (b, kv_heads, q_len, head_dim) = self.cache, k.shape
        if cache.k.device.type == "cpu":  # a slice copy per sequence: 3-4x cheaper than scatter_ here
            for i, start in enumerate(cache.lengths.tolist()):
                cache.k[layer, i, :, start : start + q_len] = k[i]
                cache.v[layer, i, :, start : start + q_len] = v[i]
        else:  # no host sync for the lengths
            slots = (cache.lengths[:, None] + torch.arange(q_len, device=k.device))[:, None, :, None]
            slots = slots.expand(b, kv_heads, q_len, head_dim)
            cache.k[layer].scatter_(2, slots, k.to(cache.k.dtype))
            cache.v[layer].scatter_(2, slots, v.to(cache.v.dtype))
        if self.cpu:
            return torch.ops.ddtree_cpu.tree_attention(q, cache.k[layer], cache.v[layer], self.offsets, kv_heads,
                                                       cache.slots * head_dim, cache.lengths, self.mask,
                                                       1.0 / math.sqrt(head_dim), self.rows)
        return self.attention(q, cache.k[layer, :, :, : self.span], cache.v[layer, :, :, : self.span])


def uses_kernel(block_mask, keys: torch.Tensor) -> bool:
    """Whether the Triton tree-attention kernel serves a block: its mask is TreeBits and the
    keys are on CUDA. The one place a dense cache's attention picks its route (a paged pool's:
    uses_paged_kernel)."""
    return isinstance(block_mask, TreeBits) and use_triton(keys)


def uses_paged_kernel(pool_keys: torch.Tensor, q_len: int, batch_invariant: bool = False) -> bool:
    """Whether a paged pool's block attends through the paged tree-attention kernel (reading
    the pool in place through the block tables): the pool is on CUDA, the block is a decode or
    verify step (<= ATTENTION_MAX_ROWS rows; longer prefill chunks gather and run SDPA, unless
    `batch_invariant`: then every block, so that a prompt's keys and values do not depend on
    which prompts were prefilled beside it), and the head width is one the kernel tiles."""
    return (use_triton(pool_keys) and (q_len <= ATTENTION_MAX_ROWS or batch_invariant)
            and pool_keys.shape[-1] in ATTENTION_HEAD_DIMS)


def block_attention(block_mask, lengths: torch.Tensor, span: int, kernel: bool):
    """attention(q, keys, values) for a block of Q rows per sequence over key slots [0, span),
    where slot lengths[b] + j holds block row j: slots below lengths[b] are seen by every row,
    block slots by `block_mask` ([B, Q, Q] bool, or TreeBits), later slots by none. With
    `kernel` (TreeBits on CUDA) the Triton tree-attention kernel reads the bits; otherwise one
    dense [B, 1, Q, span] mask is built here, once per forward, for every layer."""
    if kernel:
        return lambda q, keys, values: tree_attention(q, keys, values, lengths, block_mask.bits)
    dense = block_mask.dense() if isinstance(block_mask, TreeBits) else block_mask
    mask = slot_mask(lengths, dense.to(lengths.device), span)[:, None]
    bias = {}  # the mask as 0 / -inf in the queries' dtype, made at the first layer (SDPA would
    # otherwise convert the bool mask at every layer)

    def attention(q, keys, values):
        if q.dtype not in bias:
            bias[q.dtype] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        return attend(q, keys, values, bias[q.dtype])

    return attention


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.qk_norm = c.family == "qwen3"  # Qwen3 normalizes each head's queries and keys
        if self.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, layer: int, view, packing: Packing | None = None):
        """x [B, Q, H], or [N, H] with `packing` (the real rows of a padded block: they attend as
        they are where the view `packs`, else in the padded layout, the padding rows zero).
        `view` (the cache bound to this forward: DenseView or a paged pool's view) writes the
        block's keys and values into its cache and attends over what each query may see."""
        rows = x.shape[:-1]  # (B, Q), or (N,) packed; cos, sin: [*rows, 1, D]
        q, k, v = self.qkv(x)
        q = q.view(*rows, self.heads, self.head_dim)
        k = k.view(*rows, self.kv_heads, self.head_dim)
        v = v.view(*rows, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # queries and keys rotate together, into one tensor
        q, k = rope_qk(q, k, cos, sin)
        if packing is not None and view.packs:  # the CPU kernel takes the real rows as they are
            return self.o_proj(view.attend_rows(layer, q, k, v, packing).flatten(1))
        if packing is not None:  # attention runs per sequence, in the padded layout
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        out = view.attend(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        if packing is not None:
            return self.o_proj(out[packing.sequences, packing.positions].flatten(1))
        return self.o_proj(out.reshape(*rows, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, layer, view, reduce, packing=None):
        """`reduce` sums the partial outputs of tensor-parallel shards (identity in one process)."""
        x, h = self.post_attention_layernorm.add_forward(
            x, reduce(self.self_attn(self.input_layernorm(x), cos, sin, layer, view, packing)))
        return x + reduce(self.mlp(h))


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SingleProcess:
    """The whole model in this process: the full vocabulary here, nothing to reduce.
    (workers.tensor_parallel.TensorParallel is the other implementation.)"""

    vocab_offset = 0  # first vocabulary id of this process's logits

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def embed(self, table: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        return table(tokens)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V_local] -> [N, V]: here they are whole already."""
        return logits

    def choose(self, logits: torch.Tensor, params, seed: int | None, positions: list[int]) -> torch.Tensor:
        """[N] the target's token per row of logits [N, V] (kernels.sampling.choose_tokens);
        a tensor-parallel shard computes the same from its slice of the vocabulary."""
        return choose_tokens(logits, params, seed, positions)

    def choose_rows(self, logits: torch.Tensor, sampling: list, seeds: list[int | None],
                    draw_positions: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """[B, K] the target's token at every kept row, each row by its own rule: the argmax when
        greedy, else the seeded draw for the position the token takes (kernels.sampling's rule,
        batched: every seeded node of the step in one draw). logits [B, K, V] (on a
        tensor-parallel shard [B, K, V_local], and every shard returns the same: greedy rows
        gather one (value, id) per node between the shards, seeded rows gather their logits).

        Example: rows (greedy, seed 7), K = 2 -> row 0 is logits[0].argmax(-1); row 1 is the
        inverse-CDF draw of processed_probs(logits[1]) at u(7, draw_positions[1, k]) for k = 0, 1.
        """
        if packing is not None:
            return self._choose_packed(logits, sampling, seeds, draw_positions, packing)
        b, k, _ = logits.shape
        greedy = [r for r in range(b) if is_greedy(sampling[r])]
        if len(greedy) == b:  # every row greedy: the logits as they are, no copy of [B, K, V]
            return self.choose(logits.reshape(b * k, logits.shape[-1]), GREEDY, None, []).view(b, k).to(logits.device)
        choices = torch.empty((b, k), dtype=torch.int64, device=logits.device)
        if greedy:
            nodes = logits[greedy].reshape(len(greedy) * k, logits.shape[-1])
            choices[greedy] = self.choose(nodes, GREEDY, None, []).view(len(greedy), k).to(logits.device)
        seeded = [r for r in range(b) if not is_greedy(sampling[r])]
        owner = torch.arange(len(seeded), device=logits.device).repeat_interleave(k)
        picks = self._draw(logits[seeded].reshape(len(seeded) * k, logits.shape[-1]), [sampling[r] for r in seeded],
                           [seeds[r] for r in seeded], owner, draw_positions[seeded].reshape(-1))
        choices[seeded] = picks.view(len(seeded), k)
        return choices

    def _choose_packed(self, logits, sampling, seeds, draw_positions, packing: Packing) -> torch.Tensor:
        """choose_rows over packed logits [N, V] (every row kept): [B, Q], padding rows 0."""
        flat = torch.zeros(packing.batch * packing.q_len, dtype=torch.int64, device=logits.device)
        if all(is_greedy(p) for p in sampling):  # the logits as they are: `logits[chosen]` copied [N, V]
            flat[packing.index] = self.choose(logits, GREEDY, None, []).to(logits.device)
            return flat.view(packing.batch, packing.q_len)
        seeded = [r for r in range(packing.batch) if not is_greedy(sampling[r])]
        slot = torch.full((packing.batch,), -1, dtype=torch.int64)  # sequence b -> its place in `seeded`
        slot[seeded] = torch.arange(len(seeded))
        owner = slot.to(logits.device)[packing.sequences]  # [N]: each real row's seeded place, or -1
        chosen = (owner < 0).nonzero().view(-1)
        if len(chosen):
            flat[packing.index[chosen]] = self.choose(logits[chosen], GREEDY, None, []).to(logits.device)
        drawn = (owner >= 0).nonzero().view(-1)
        if len(drawn):
            at = packing.index[drawn]  # into the flattened [B * Q]
            flat[at] = self._draw(logits[drawn], [sampling[r] for r in seeded], [seeds[r] for r in seeded],
                                  owner[drawn], draw_positions.to(logits.device).view(-1)[at])
        return flat.view(packing.batch, packing.q_len)

    def _draw(self, logits: torch.Tensor, params: list, seeds: list[int], owner: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """The seeded draws of N nodes at once: logits [N, V] (a shard: [N, V_local]), node n
        belonging to request owner[n] (its `params` and `seeds` entry), positions [N] the
        position each node's token takes -> [N] int64."""
        full = self.gather_vocab(logits)
        rows = RowSampling.of(params, full.shape[-1], full.device).select(owner)
        seed = torch.tensor(seeds, dtype=torch.int64, device=full.device)[owner]
        probs = processed_probs_rows(full, rows)
        return sampled_choices(probs[:, None], seed, positions.to(full.device)[:, None])[:, 0]


@dataclass
class ForwardOutput:
    # [B, Q_keep, V] (the last Q_keep rows; a shard: its vocabulary slice); packed: [N, V]; None: features only
    logits: torch.Tensor | None
    features: torch.Tensor | None  # [B, Q, len(capture_layers) * H], outputs of those layers
    packing: Packing | None = None  # a packed forward's real rows (its logits are theirs alone)


class TargetModel(nn.Module):
    """The target: embed -> decoder layers -> norm -> LM head, over a block that extends the
    cache. Its KV cache is explicit and owned by the caller. A tensor-parallel shard is this same
    model built from the shard's local sizes (see workers.tensor_parallel), `parallel` doing the
    sums."""

    def __init__(self, config: ModelConfig, parallel=None):
        super().__init__()
        self.config = config
        self.parallel = parallel or SingleProcess()
        self.model = _Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    batch_invariant = False  # use_batch_invariant_kernels

    def use_batch_invariant_kernels(self, on: bool = True) -> "TargetModel":
        """Routes the linears (q/k/v/o, the MLP's, the LM head), the norms and the paged
        attention through the batch-invariant Triton kernels wherever the Triton route serves
        (CUDA tensors; `deterministic: true` on the GPU): a row's logits are then bitwise the
        same whatever rows share its forward. (On the CPU ddtree_cpu's kernels are batch-invariant
        already.) Attention through the pool needs a head width the paged kernel tiles."""
        if on and self.config.head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"batch-invariant kernels need a head width in {ATTENTION_HEAD_DIMS} (the paged "
                             f"tree-attention kernel's tiles); this model's is {self.config.head_dim}")
        self.batch_invariant = on
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm)):
                module.batch_invariant = on
        return self

    def _apply(self, fn, recurse=True):
        """.to() / .cuda() also move the float64 rotary frequencies (a plain attribute, so that
        dtype casts leave them float64)."""
        out = super()._apply(fn, recurse)
        self.rope = self.rope.to(self.device)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the final norm's (the LM head may hold quantized blocks, see
        workers.quantized)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_cache(self, batch: int, slots: int) -> KVCache:
        return KVCache.allocate(self.config, batch, slots, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, Q] int64
        positions: torch.Tensor,  # [B, Q] int64 absolute positions (start + depth for a tree)
        block_mask,  # [B, Q, Q] bool, row i may see column j of the block; or TreeBits
        cache,  # KVCache, or a batch of a paged pool (workers.kv_pool.PagedBatch): bind(mask, Q)
        capture_layers: tuple[int, ...] = (),
        logits_to_keep: int = 0,  # 0 = every row
        rows: torch.Tensor | None = None,  # [B] int64: real rows per block, the rest padding (see Packing)
        resume: tuple[int, torch.Tensor] | None = None,  # (L, [B, Q, H] layer L's output): run the layers after L
        features_only: bool = False,  # stop after the last of `capture_layers`: no logits
    ) -> ForwardOutput:
        """Runs the block over the committed prefix in `cache` and writes the block's keys and
        values at slots lengths[b] ... lengths[b] + Q - 1 (packed into a paged pool on the CPU: the
        real rows' alone, `PagedView.attend_rows`). It does not advance `lengths`: the
        caller commits what it keeps (see kernels.tree.compact_kv). With `rows` (every row kept,
        logits_to_keep 0), the padding rows are not computed: the logits come back packed.
        With `resume`, the block starts from layer L's recorded outputs (e.g. features the data
        stage captured) and only the later layers run: the cache holds those layers alone. With
        `features_only`, the layers after the last captured one and the LM head do not run (the
        data stage: SmolLM2's features of layers 1, 14 and 27 skip 2 of its 30 layers) and the
        cache holds the layers that ran alone."""
        if features_only and not capture_layers:
            raise ValueError("features_only needs capture_layers")
        b, q_len = tokens.shape
        packing = None
        if rows is not None:
            if logits_to_keep:
                raise ValueError("a packed forward keeps every real row's logits (logits_to_keep 0)")
            packing = Packing.of(rows.to(tokens.device), q_len)
        view = cache.bind(block_mask, q_len, None if packing is None else packing.rows, self.batch_invariant)
        # [B, Q, 1, D] (packed: [N, 1, D]): broadcast over the heads
        cos, sin = (t[0].transpose(0, 1) if packing is not None else t.transpose(1, 2) for t in rope_cos_sin(
            positions if packing is None else packing.pack(positions)[None], self.rope, self.dtype))
        if resume is None:
            first, x = 0, self.parallel.embed(self.model.embed_tokens, tokens if packing is None else packing.pack(tokens))
        else:
            first, x = resume[0] + 1, resume[1].to(self.dtype)
        captured, last = [], max(capture_layers) if features_only else None
        for i, layer in enumerate(self.model.layers):
            if i < first:
                continue
            x = layer(x, cos, sin, i, view, self.parallel.all_reduce, packing)
            if i in capture_layers:
                captured.append((capture_layers.index(i), x if packing is None else packing.unpack(x)))
            if i == last:
                break
        logits = None
        if not features_only:
            keep = x[:, -logits_to_keep:] if logits_to_keep else x
            logits = self.lm_head(self.model.norm(keep))
        features = torch.cat([t for _, t in sorted(captured, key=lambda p: p[0])], dim=-1) if captured else None
        return ForwardOutput(logits=logits, features=features, packing=packing)

    def prefill_mask(self, q_len: int) -> torch.Tensor:
        """[1, Q, Q] causal mask for a plain (chain) block."""
        return torch.ones(q_len, q_len, dtype=torch.bool, device=self.device).tril()[None]
