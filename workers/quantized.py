"""GGUF low-bit weights kept as they are, multiplied with directly.

A GGUF file stores each row of a [N, K] weight matrix as blocks of 32 consecutive weights along
K, each block with its own scale (and, for Q4_1, its own minimum):

    type  bytes per block                          weight k of the block
    Q4_0  fp16 d, 16 bytes of 4-bit codes q         d * (q - 8)
    Q4_1  fp16 d, fp16 m, 16 bytes of 4-bit codes   d * q + m
    Q8_0  fp16 d, 32 int8 codes q                   d * q

In a 4-bit block, byte j holds code j (low nibble) and code j + 16 (high nibble).

`BlockWeights` is one matrix decoded from those bytes into codes, scales and offsets
(w = scale * code + offset per block, which is each type's formula above exactly: every product
of an fp16 scale and a code is exact in fp32). Its `dequantize()` gives the fp32 weights that
transformers' GGUF loader gives (gguf.quants), the reference of every test here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

GROUP = 32  # weights per GGUF block (and per scale of the packed int4 layout)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QUANT_TYPES = tuple(BLOCK_BYTES)


@dataclass
class BlockWeights:
    """A [N, K] matrix as GGUF blocks decode: w[n, k] = scale[n, g] * codes[n, k] + offset[n, g],
    g = k // 32."""

    kind: str  # "Q4_0" | "Q4_1" | "Q8_0"
    codes: torch.Tensor  # [N, K] uint8 in [0, 15] (Q4_*) or int8 in [-128, 127] (Q8_0)
    scale: torch.Tensor  # [N, K / 32] float32
    offset: torch.Tensor  # [N, K / 32] float32 (Q4_0: -8 scale; Q4_1: the block minimum; Q8_0: 0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, equal to gguf.quants.dequantize of the same blocks."""
        n, k = self.shape
        w = self.codes.view(n, k // GROUP, GROUP).to(torch.float32) * self.scale[..., None] + self.offset[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> "BlockWeights":
        """The rows `index` (a permutation or a lookup), still quantized."""
        return BlockWeights(self.kind, self.codes[index], self.scale[index], self.offset[index])

    @classmethod
    def from_gguf_bytes(cls, kind: str, raw, k: int) -> "BlockWeights":
        """raw: the [N, K / 32 * block bytes] uint8 rows of a GGUF tensor (GGUFReader's .data,
        a numpy array, or a tensor)."""
        if kind not in BLOCK_BYTES:
            raise ValueError(f"GGUF type {kind} is not kept quantized; ddtree reads {', '.join(QUANT_TYPES)}")
        if k % GROUP:
            raise ValueError(f"input size {k} is not a multiple of the GGUF block of {GROUP}")
        raw = raw.contiguous() if isinstance(raw, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(raw))
        blocks = raw.view(torch.uint8).view(-1, k // GROUP, BLOCK_BYTES[kind])
        n = blocks.shape[0]
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].to(torch.float32)  # [N, G]
        if kind == "Q8_0":
            codes = blocks[..., 2:].contiguous().view(torch.int8)
            return cls(kind, codes.reshape(n, k), d, torch.zeros_like(d))
        packed = blocks[..., -GROUP // 2 :]
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)
        if kind == "Q4_0":
            return cls(kind, codes, d, -8 * d)
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].to(torch.float32)
        return cls(kind, codes, d, m)


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
    (workers.cpu_gemm's blocks_mm), which decodes each weight once per 64 rows of x into a small
    fp32 tile and multiplies the rows against it:
    F.linear(x, self.dequantize()) up to float summation order, and each row's result is the same
    whichever other rows come with it."""

    def __init__(self, kind: str, blocks: torch.Tensor):
        super().__init__()
        if kind not in BLOCK_BYTES or blocks.dim() != 3 or blocks.shape[2] != BLOCK_BYTES[kind]:
            raise ValueError(f"{kind} blocks must be [N, K / 32, {BLOCK_BYTES.get(kind)}] uint8, got {tuple(blocks.shape)}")
        self.kind = kind
        self.register_buffer("blocks", blocks.to(torch.uint8).contiguous())  # [N, K / 32, bytes]
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * GROUP

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
    """BlockWeights back into GGUF block bytes [N, K / 32, block bytes] uint8 (tests, benchmarks)."""
    n, k = weights.shape
    g = k // GROUP
    d = half_bytes(weights.scale)
    if weights.kind == "Q8_0":
        return torch.cat([d, weights.codes.reshape(n, g, GROUP).view(torch.uint8)], dim=-1)
    codes = weights.codes.reshape(n, g, 2, GROUP // 2)
    packed = codes[:, :, 0] | (codes[:, :, 1] << 4)
    if weights.kind == "Q4_0":
        return torch.cat([d, packed], dim=-1)
    m = half_bytes(weights.offset)
    return torch.cat([d, m, packed], dim=-1)


def half_bytes(values: torch.Tensor) -> torch.Tensor:
    """[N, G] float32 -> [N, G, 2] uint8: each value's fp16 bytes, as a block stores them."""
    halves = torch.empty(values.numel(), dtype=torch.float16).copy_(values.reshape(-1))  # strides of 1
    return halves.view(torch.uint8).view(*values.shape, 2)
