"""GGUF low-bit weights kept as they are, multiplied with directly.

A GGUF file stores each row of a [N, K] weight matrix as blocks of 32 consecutive weights along
K, each block with its own scale (and, for Q4_1, its own minimum):

    type  bytes per block                          weight k of the block
    Q4_0  fp16 d, 16 bytes of 4-bit codes q         d * (q - 8)
    Q4_1  fp16 d, fp16 m, 16 bytes of 4-bit codes   d * q + m
    Q5_0  fp16 d, 4 bytes qh, 16 bytes of low bits  d * (q - 16)
    Q5_1  fp16 d, fp16 m, qh, 16 bytes of low bits  d * q + m
    Q8_0  fp16 d, 32 int8 codes q                   d * q

In a 4-bit block, byte j holds code j (low nibble) and code j + 16 (high nibble); a 5-bit code
adds bit j of the little-endian 32-bit qh as its fifth bit.

The K-quants store super-blocks of 256 weights, each with an fp16 d (and dmin) and small
integer scales per sub-block (llama.cpp's block_q4_K, block_q5_K, block_q6_K):

    type  bytes  layout                                                  weight
    Q4_K  144    fp16 d, fp16 dmin, 12 bytes of 6-bit sc[8] and m[8],    (d sc[j]) q - dmin m[j]
                 128 bytes of 4-bit codes (group j of 32: the low (j
                 even) or high (j odd) nibbles of bytes 32 (j // 2)...)
    Q5_K  176    as Q4_K, with 32 bytes qh after the scales (bit j of   (d sc[j]) q - dmin m[j]
                 qh[l]: the fifth bit of group j's code l)
    Q6_K  210    128 bytes of low 4 bits, 64 of high 2 bits, 16 int8    (d sc[i // 16]) (q - 32)
                 scales sc (one per 16 weights), fp16 d last

`BlockWeights` is one matrix decoded from those bytes into codes, scales and offsets
(w = scale * code + offset per group of `group` weights, which is each type's formula above
exactly: every product of an fp16 scale, an integer scale and a code is exact in fp32). Its
`dequantize()` gives the fp32 weights that transformers' GGUF loader gives (gguf.quants), the
reference of every test here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP = 32  # weights per GGUF block of the 32-weight types (and per scale of the packed int4 layout)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per stored block
BLOCK_VALUES = {kind: 256 if kind.endswith("_K") else 32 for kind in BLOCK_BYTES}  # weights per stored block
SCALE_GROUP = {"Q6_K": 16}  # weights per scale where not GROUP
QUANT_TYPES = tuple(BLOCK_BYTES)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@dataclass
class BlockWeights:
    """A [N, K] matrix as GGUF blocks decode: w[n, k] = scale[n, g] * codes[n, k] + offset[n, g],
    g = k // group (32; Q6_K 16)."""

    kind: str  # one of QUANT_TYPES
    codes: torch.Tensor  # [N, K] uint8 in [0, 15] (Q4_*), [0, 31] (Q5_*); int8 (Q8_0, Q6_K: q - 32)
    scale: torch.Tensor  # [N, K / group] float32
    offset: torch.Tensor  # [N, K / group] float32 (Q4_0: -8 scale; Q5_0: -16 scale; Q4_1, Q5_1: the minimum;
    #                       Q4_K / Q5_K: -dmin m; Q8_0, Q6_K: 0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group(self) -> int:
        return SCALE_GROUP.get(self.kind, GROUP)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, equal to gguf.quants.dequantize of the same blocks."""
        n, k = self.shape
        codes = self.codes.view(n, k // self.group, self.group).to(torch.float32)
        return (codes * self.scale[..., None] + self.offset[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> "BlockWeights":
        """The rows `index` (a permutation or a lookup), still quantized."""
        return BlockWeights(self.kind, self.codes[index], self.scale[index], self.offset[index])

    @classmethod
    def from_gguf_bytes(cls, kind: str, raw, k: int) -> "BlockWeights":
        """raw: the [N, K / block values * block bytes] uint8 rows of a GGUF tensor
        (GGUFReader's .data, a numpy array, or a tensor)."""
        if kind not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {kind} is not kept quantized; ddtree reads {', '.join(QUANT_TYPES)}")
        if k % BLOCK_VALUES[kind]:
            raise ValueError(f"input size {k} is not a multiple of the {kind} block of {BLOCK_VALUES[kind]}")
        raw = raw.contiguous() if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw))
        blocks = raw.view(torch.uint8).view(-1, k // BLOCK_VALUES[kind], BLOCK_BYTES[kind])
        if kind in K_QUANTS:
            return cls(kind, *decode_k_quant(kind, blocks))
        n = blocks.shape[0]
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].to(torch.float32)  # [N, G]
        if kind == "Q8_0":
            codes = blocks[..., 2:].contiguous().view(torch.int8)
            return cls(kind, codes.reshape(n, k), d, torch.zeros_like(d))
        packed = blocks[..., -GROUP // 2 :]
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [N, G, 32]
        if kind in ("Q5_0", "Q5_1"):
            qh = blocks[..., -GROUP // 2 - 4 : -GROUP // 2].to(torch.int64)  # [N, G, 4] bytes of a little-endian uint32
            bits = (qh[..., :, None] >> torch.arange(8)) & 1  # [N, G, 4, 8]: bit l of qh at [l // 8, l % 8]
            codes = codes | (bits.reshape(n, -1, GROUP).to(torch.uint8) << 4)
        codes = codes.reshape(n, k)
        if kind in ("Q4_0", "Q5_0"):
            return cls(kind, codes, d, (-8 if kind == "Q4_0" else -16) * d)
        return cls(kind, codes, d, fp16_at(blocks, 2))


def fp16_at(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """[N, S, bytes] uint8 -> [N, S] float32: the fp16 at byte `at` of each block."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].to(torch.float32)


def decode_k_quant(kind: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, S, bytes] super-blocks -> codes [N, 256 S], scale and offset [N, 256 S / group] (the
    fields of BlockWeights), by the layouts in this module's docstring.

    Example (Q4_K): scale bytes s[0..11] give sub-block 5 the scale (s[9] & 15) | (s[1] >> 6) << 4
    and the minimum (s[9] >> 4) | (s[5] >> 6) << 4; its 32 codes are the high nibbles of code
    bytes 64..95."""
    n, s = blocks.shape[:2]
    if kind == "Q6_K":
        ql = blocks[..., :128].reshape(n, s, 2, 2, 32)  # [half, which 32 bytes, l]
        qh = blocks[..., 128:192].reshape(n, s, 2, 32)  # [half, l]
        groups = []  # group 4 half + u: ql's bytes u % 2 (nibble u // 2), qh's bits 2u, 2u + 1
        for u in range(4):
            low = (ql[:, :, :, u % 2] >> (4 * (u // 2))) & 0x0F
            high = (qh >> (2 * u)) & 0x03
            groups.append(low | (high << 4))
        codes = (torch.stack(groups, dim=3).to(torch.int16) - 32).to(torch.int8)  # [N, S, 2, 4, 32]
        sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.float32)  # [N, S, 16]
        scale = fp16_at(blocks, 208)[..., None] * sc
        return codes.reshape(n, -1), scale.reshape(n, -1), torch.zeros(n, s * 16)
    scales = blocks[..., 4:16].reshape(n, s, 3, 4)
    d, m, md = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1).to(torch.float32)  # [N, S, 8]
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1).to(torch.float32)
    qs = blocks[..., -128:].reshape(n, s, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3)  # [N, S, 4, 2, 32]: group 2i + nibble
    if kind == "Q5_K":
        qh = blocks[..., 16:48]  # [N, S, 32]
        high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=2)  # [N, S, 8, 32]
        codes = codes.reshape(n, s, 8, 32) | (high << 4)
    scale = fp16_at(blocks, 0)[..., None] * sc
    offset = -(fp16_at(blocks, 2)[..., None] * mn)
    return codes.reshape(n, -1), scale.reshape(n, -1), offset.reshape(n, -1)


def random_blocks(kind: str, n: int, k: int, generator: torch.Generator, d_range=(1e-4, 1e-3)) -> torch.Tensor:
    """[N, K / block values, block bytes] uint8: random GGUF blocks of `kind` (random codes and
    integer scales, fp16 d and dmin drawn from `d_range`), for tests and benchmarks of the types
    that the gguf package cannot quantize (the K-quants)."""
    s = k // BLOCK_VALUES[kind]
    blocks = torch.randint(0, 256, (n, s, BLOCK_BYTES[kind]), dtype=torch.uint8, generator=generator)
    low, high = d_range
    for at in ([208] if kind == "Q6_K" else [0, 2] if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0]):
        d = (low + (high - low) * torch.rand(n, s, generator=generator)).to(torch.float16)
        blocks[..., at : at + 2] = d[..., None].view(torch.uint8).view(n, s, 2)
    return blocks


def quantize_for_test(weight: torch.Tensor, kind: str) -> BlockWeights:
    """`weight` [N, K] quantized by the gguf package's own quantizer (as llama.cpp's tools do),
    decoded back into BlockWeights: for tests and benchmarks."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.to(torch.float32).numpy(), GGMLQuantizationType[kind])
    return BlockWeights.from_gguf_bytes(kind, raw, weight.shape[1])


# --- modules --------------------------------------------------------------------------------

class QuantizedLinear(nn.Module):
    """A bias-free nn.Linear whose weight stays GGUF blocks: forward(x [..., K]) -> [..., N].

    Every input (decoding, tree verification, prefill) goes through the C++ kernel
    (ddtree_cpu.blocks_mm, workers/cpu_kernels/gemm.cpp), which decodes each weight once per call of up to 5 rows (8
    with AVX-512) in registers, else once per 64 rows of x into a small fp32 tile, and multiplies
    every row against it:
    F.linear(x, self.dequantize()) up to float summation order, and each row's result is the same
    whichever other rows come with it."""

    def __init__(self, kind: str, blocks: torch.Tensor):
        super().__init__()
        if kind not in BLOCK_BYTES or blocks.dim() != 3 or blocks.shape[2] != BLOCK_BYTES[kind]:
            raise ValueError(f"{kind} blocks must be [N, K / {BLOCK_VALUES.get(kind)}, {BLOCK_BYTES.get(kind)}] uint8, "
                             f"got {tuple(blocks.shape)}")
        self.kind = kind
        self.register_buffer("blocks", blocks.to(torch.uint8).contiguous())  # [N, K / block values, bytes]
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * BLOCK_VALUES[kind]

    @classmethod
    def from_weights(cls, weights: BlockWeights) -> "QuantizedLinear":
        return cls(weights.kind, encode_blocks(weights))

    def decoded(self, rows: torch.Tensor | slice = slice(None)) -> BlockWeights:
        return BlockWeights.from_gguf_bytes(self.kind, self.blocks[rows].flatten(1), self.in_features)

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """[N, K] float32 (or the rows `rows`): the weights transformers' GGUF loader gives."""
        return self.decoded(rows).dequantize()

    def select_rows(self, rows: torch.Tensor) -> "QuantizedLinear":
        """The layer of output rows `rows` only (a draft vocabulary's slice of an LM head)."""
        return QuantizedLinear(self.kind, self.blocks[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            raise TypeError(f"QuantizedLinear multiplies float32 activations, got {flat.dtype}")
        out = torch.ops.ddtree_cpu.blocks_mm(flat, self.blocks, self.kind)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


class FusedQuantized:
    """Quantized layers that read the same input, as one kernel call: their blocks concatenated
    along the output rows, each layer's own blocks a view of its rows (nothing held twice).
    Layers of different block types run one by one. The quantized counterpart of
    workers.model.FusedLinears: calling it on x gives the layers' outputs, in order.

    Example: q_proj, k_proj, v_proj Q4_1 [576 | 192 | 192, 18, 20] -> one [960, 18, 20] layer;
    x [B, Q, 576] gives [B, Q, 576], [B, Q, 192], [B, Q, 192]."""

    def __init__(self, *layers: QuantizedLinear):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.fused = None
        if len({(layer.kind, layer.in_features) for layer in layers}) == 1:
            self.fused = QuantizedLinear(layers[0].kind, torch.cat([layer.blocks for layer in layers]))
            for layer, part in zip(layers, self.fused.blocks.split(self.sizes)):
                layer.blocks = part

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused is None:
            return tuple(layer(x) for layer in self.layers)
        return self.fused(x).split(self.sizes, dim=-1)


class QuantizedEmbedding(nn.Module):
    """An nn.Embedding over a QuantizedLinear's blocks (a tied LM head's, shared, not copied):
    forward(tokens [...]) -> [..., K] float32, the de-quantized rows of the tokens."""

    def __init__(self, table: QuantizedLinear):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table.dequantize(tokens.reshape(-1))
        return rows.view(*tokens.shape, self.embedding_dim)


def encode_blocks(weights: BlockWeights) -> torch.Tensor:
    """BlockWeights of a 32-weight type back into GGUF block bytes [N, K / 32, block bytes] uint8
    (tests, benchmarks). A K-quant's integer scales are not kept in BlockWeights: its blocks come
    from a file (or random_blocks) as they are."""
    if weights.kind in K_QUANTS:
        raise ValueError(f"{weights.kind} BlockWeights do not keep the super-blocks' integer scales; use the blocks as stored")
    n, k = weights.shape
    g = k // GROUP
    d = half_bytes(weights.scale)
    if weights.kind == "Q8_0":
        return torch.cat([d, weights.codes.reshape(n, g, GROUP).view(torch.uint8)], dim=-1)
    codes = weights.codes.reshape(n, g, 2, GROUP // 2)
    packed = (codes[:, :, 0] & 0x0F) | ((codes[:, :, 1] & 0x0F) << 4)
    if weights.kind in ("Q5_0", "Q5_1"):  # the fifth bits, 8 per byte of qh
        bits = (weights.codes.reshape(n, g, 4, 8).to(torch.int64) >> 4) << torch.arange(8)
        packed = torch.cat([bits.sum(-1).to(torch.uint8), packed], dim=-1)
    if weights.kind in ("Q4_0", "Q5_0"):
        return torch.cat([d, packed], dim=-1)
    m = half_bytes(weights.offset)
    return torch.cat([d, m, packed], dim=-1)


def half_bytes(values: torch.Tensor) -> torch.Tensor:
    """[N, G] float32 -> [N, G, 2] uint8: each value's fp16 bytes, as a block stores them."""
    halves = torch.empty(values.numel(), dtype=torch.float16).copy_(values.reshape(-1))  # strides of 1
    return halves.view(torch.uint8).view(*values.shape, 2)
