"""GGUF low-bit weights kept native (workers.quantized): the C++ kernel against the de-quantized
F.linear on tile-breaking shapes, its decoding bitwise gguf.quants' (the K-quants on random
super-blocks, which the gguf package cannot quantize), tiny llamas written as GGUF files --
Q4_0 / Q4_1 / Q8_0 tensors, and a Q4_K_M-style mix of Q4_K / Q5_K / Q6_K / Q8_0 -- loaded native
against the same file de-quantized by transformers, and the engine lossless on the native
models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ddtree.workers.cpu_kernels import load_kernels
from ddtree.workers.loading import load_native_target, load_target_weights, rope_row_order
from ddtree.workers.quantized import (BLOCK_VALUES, K_QUANTS, QUANT_TYPES, BlockWeights, QuantizedLinear,
                                     quantize_for_test, random_blocks)
from ddtree.workers.requests import Request
from ddtree.workers.solo import SoloLoop

from .drafters import OracleDrafter

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 97, 64, 96, 2, 1, 2
# GGUF type per tensor: q, k, v of different types (no fused q/k/v), every type at least twice
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q8_0"}
# As llama.cpp's Q4_K_M mixes them: Q4_K for most matrices, Q6_K for v / down / the embedding,
# Q5_K beside them, and the 32-weight types it falls back to where an input size is no multiple
# of 256 (Q5_0 for Q4_K: gate and up of different types run unfused)
K_HIDDEN, K_INTERMEDIATE = 256, 512
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q6_K"}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_kernels()


# Shapes that break the kernel's tiling (workers/cpu_kernels/gemm.cpp, blocks_mm): 12 output columns per tile,
# decoded 6 (AVX2: 3) at a time over all inputs, the last ones padded with zeros; activation rows
# in register tiles of 3-4 rows (fewer only below 3) and panels of 64; up to 5 rows (8 in an
# AVX-512 build) take the path that decodes in registers, one row its own tile.
# The K-quants' super-blocks of 256: 3 of them (an odd count) and 5.
TILE_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 64, 65, 130, 300]
TILE_SHAPES = [(1, 32), (11, 96), (13, 256), (25, 288), (130, 576), (12, 800)]
K_TILE_SHAPES = [(1, 256), (25, 768), (13, 1280)]
CASES = [(kind, n, k) for kind in QUANT_TYPES for n, k in (K_TILE_SHAPES if kind in K_QUANTS else TILE_SHAPES)]


# A K-quant's largest weight over d: 63 * 15 (Q4_K), 63 * 31 (Q5_K), 128 * 32 (Q6_K)
K_REACH = {"Q4_K": 945, "Q5_K": 1953, "Q6_K": 4096}


def k_quant_blocks(kind: str, n: int, k: int, gen: torch.Generator, scale: float) -> torch.Tensor:
    """Random super-blocks whose weights reach about +-scale."""
    return random_blocks(kind, n, k, gen, d_range=(scale / K_REACH[kind] / 2, scale / K_REACH[kind]))


def layer_of(kind: str, n: int, k: int, gen: torch.Generator) -> tuple[QuantizedLinear, BlockWeights]:
    """A [n, k] layer of `kind` with weights of about 0.1: quantized by the gguf package where it
    can, else random blocks."""
    if kind in K_QUANTS:
        blocks = k_quant_blocks(kind, n, k, gen, 0.2)
        layer = QuantizedLinear(kind, blocks)
        return layer, layer.decoded()
    weights = quantize_for_test(torch.randn(n, k, generator=gen) * 0.1, kind)
    return QuantizedLinear.from_weights(weights), weights


@pytest.mark.parametrize("rows", TILE_ROWS)
@pytest.mark.parametrize("kind,n,k", CASES)
def test_kernel_equals_dequantized_linear(kind, rows, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    layer, weights = layer_of(kind, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    want = F.linear(x.double(), weights.dequantize().double())
    assert torch.equal(layer.dequantize(), weights.dequantize())
    # float32 sums of k products in another order: within a few ulps of the sum of |products|
    bound = 1e-6 * k ** 0.5 * F.linear(x.abs().double(), weights.dequantize().abs().double()) + 1e-30
    assert ((layer(x).double() - want).abs() <= bound).all()
    torch.testing.assert_close(layer(x[None]), want.float()[None], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,n,k", [(kind, n, k) for kind in QUANT_TYPES
                                       for n, k in ([(25, 768)] if kind in K_QUANTS else [(25, 288), (131, 576)])])
def test_kernel_rows_do_not_depend_on_their_batch(kind, n, k):
    """Batch invariance: row r of an M-row call is bitwise the 1-row call on that row, for every M
    (register tiles of 4 and 3 rows, panels of 64, the register paths of 1 and of 2-5 rows;
    the verify buckets' 5, 9, 17, 33, 65 rows among them) and with 1 or 2 threads, on odd output
    counts and odd numbers of blocks.
    A tree's rows are verified together; if a row's logits depended on how many rows came with it,
    a tie could go another way than in plain decoding and the output would not be lossless."""
    gen = torch.Generator().manual_seed(k)
    layer, _ = layer_of(kind, n, k, gen)
    x = torch.randn(max(TILE_ROWS), k, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in TILE_ROWS:
                assert torch.equal(layer(x[:rows]), alone[:rows]), (rows, t)
            assert torch.equal(layer(x[3:12]), alone[3:12]), t  # rows in other tile positions
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_blocks_decode_as_gguf_dequantizes(kind):
    """BlockWeights (Python) and the kernel (C++: one-hot rows of x pick out each weight, exactly)
    decode random blocks -- every code, every 6-bit scale and minimum, signed Q6_K scales -- bitwise
    as gguf.quants.dequantize does."""
    from gguf import GGMLQuantizationType, quants

    gen = torch.Generator().manual_seed(1)
    n, k = 7, 2 * BLOCK_VALUES[kind]
    blocks = random_blocks(kind, n, k, gen, d_range=(-0.5, 0.5))
    want = torch.from_numpy(quants.dequantize(blocks.reshape(n, -1).numpy(), GGMLQuantizationType[kind]))
    layer = QuantizedLinear(kind, blocks)
    assert torch.equal(layer.dequantize(), want)
    picks = torch.eye(k)  # row i of x picks input i: y = w[:, i], no rounding
    assert torch.equal(layer(picks), want.T)  # the buffered tiles
    assert torch.equal(torch.cat([layer(picks[i : i + 5]) for i in range(0, k, 5)]), want.T)  # the register path
    if kind not in K_QUANTS:
        w = torch.randn(7, 64, generator=gen) * 0.3
        raw = quants.quantize(w.numpy(), GGMLQuantizationType[kind])
        assert torch.equal(quantize_for_test(w, kind).dequantize(),
                           torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind])))


def test_rope_row_order_undoes_the_converters_interleave():
    assert rope_row_order(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def write_tiny_llama(path, types=TYPES, hidden=HIDDEN, intermediate=INTERMEDIATE):
    """A random 2-layer llama as llama.cpp lays one out (tied embedding, GGUF names), each
    matrix quantized as `types` says: by the gguf package's quantizer, or, for a K-quant, as
    random super-blocks whose weights have about the matrix's scale."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    gen = torch.Generator().manual_seed(3)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(hidden // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    head_dim = hidden // HEADS

    def matrix(name, n, k, scale=0.2):
        kind = types[name.split(".")[-2] if name.startswith("blk") else name.split(".")[0]]
        if kind in K_QUANTS:
            raw = k_quant_blocks(kind, n, k, gen, 2 * scale).reshape(n, -1).numpy()
        else:
            raw = quants.quantize((torch.randn(n, k, generator=gen) * scale).numpy(), GGMLQuantizationType[kind])
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    matrix("token_embd.weight", VOCAB, hidden, 1.0)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * torch.randn(hidden, generator=gen)).numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * torch.randn(hidden, generator=gen)).numpy())
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, HEADS * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_dir(gguf, directory):
    """The GGUF file de-quantized by transformers, as gguf_to_hf_dir caches it (this file has no
    tokenizer, which gguf_to_hf_dir would also save)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: t.contiguous() for k, t in hf.state_dict().items() if k != "lm_head.weight"}
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


TINY_FILES = {"q4_0-q4_1-q8_0": (TYPES, HIDDEN, INTERMEDIATE), "q4_k_m": (K_TYPES, K_HIDDEN, K_INTERMEDIATE)}


@pytest.fixture(scope="module", params=list(TINY_FILES))
def tiny_pair(request, tmp_path_factory):
    """(native model, the same file de-quantized to fp32) of a tiny llama GGUF: one with the
    32-weight types, one mixing K-quants per tensor as a Q4_K_M file does."""
    types, hidden, intermediate = TINY_FILES[request.param]
    root = tmp_path_factory.mktemp("gguf")
    gguf = root / "tiny-llama.gguf"
    write_tiny_llama(gguf, types, hidden, intermediate)
    directory = dequantized_dir(gguf, root / "hf")
    return load_native_target(gguf, directory), load_target_weights(directory, torch.float32)


def logits_of(model, tokens):
    cache = model.new_cache(1, 64)
    tokens = torch.tensor([tokens])
    positions = torch.arange(tokens.shape[1])[None]
    return model(tokens, positions, model.prefill_mask(tokens.shape[1]), cache).logits[0]


def test_native_model_keeps_blocks_and_matches_the_dequantized_one(tiny_pair):
    native, dense = tiny_pair
    kinds = {type(m).__name__ for m in native.modules()}
    assert {"QuantizedLinear", "QuantizedEmbedding"} <= kinds and "Linear" not in kinds
    block_types = {m.kind for m in native.modules() if isinstance(m, QuantizedLinear)}
    assert block_types in ({"Q4_0", "Q4_1", "Q8_0"}, {"Q4_K", "Q5_K", "Q6_K", "Q5_0"})  # every type of the file, kept
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    for rows in (prompt[:1], prompt[:9], prompt):
        torch.testing.assert_close(logits_of(native, rows), logits_of(dense, rows), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("budget", [0, 16])
def test_engine_on_native_weights_is_lossless(tiny_pair, budget):
    """Greedy output at budget 16 (trees verified by the native kernel, 17 rows) equals plain
    decoding of the same native model, which equals the de-quantized model's."""
    native, dense = tiny_pair
    prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    request = Request(prompt=prompt, max_tokens=24)
    plain = SoloLoop.local(dense, None, 0).generate([request])[0].tokens
    drafter = OracleDrafter(prompt + plain + [0] * 16, VOCAB, 8, accuracy=0.7)
    out = SoloLoop.local(native, drafter, budget).generate([request])[0]
    assert out.tokens == plain
