"""GGUF low-bit weights kept native (workers.quantized): the C++ kernel against the de-quantized
F.linear on tile-breaking shapes, a tiny llama written as a GGUF with Q4_0 / Q4_1 / Q8_0 tensors
loaded native against the same file de-quantized by transformers, and the engine lossless on
the native model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ddtree.workers.cpu_gemm import load_kernel
from ddtree.workers.loading import load_native_target, load_target_weights, rope_row_order
from ddtree.workers.quantized import QUANT_TYPES, QuantizedLinear, quantize_for_test
from ddtree.workers.requests import Request
from ddtree.workers.solo import SoloLoop

from .drafters import OracleDrafter

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 97, 64, 96, 2, 1, 2
# GGUF type per tensor: q, k, v of different types (no fused q/k/v), every type at least twice
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q8_0"}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    load_kernel()


# Shapes that break the kernel's tiling (workers/cpu_gemm.cpp, blocks_mm): 12 output columns per tile,
# inputs decoded in chunks of at most 256 of even size, activation rows in register tiles of
# 4 (then 3, 2, 1) and panels of 64; up to 5 rows (8 in an AVX-512 build) take the path that
# decodes in registers, one row its own tile.
TILE_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 64, 65, 130, 300]
TILE_SHAPES = [(1, 32), (11, 96), (13, 256), (25, 288), (130, 576), (12, 800)]


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("rows", TILE_ROWS)
@pytest.mark.parametrize("n,k", TILE_SHAPES)
def test_kernel_equals_dequantized_linear(kind, rows, n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weights = quantize_for_test(torch.randn(n, k, generator=gen) * 0.1, kind)
    layer = QuantizedLinear.from_weights(weights)
    x = torch.randn(rows, k, generator=gen)
    want = F.linear(x.double(), weights.dequantize().double())
    assert torch.equal(layer.dequantize(), weights.dequantize())
    # float32 sums of k products in another order: within a few ulps of the sum of |products|
    bound = 1e-6 * k ** 0.5 * F.linear(x.abs().double(), weights.dequantize().abs().double()) + 1e-30
    assert ((layer(x).double() - want).abs() <= bound).all()
    torch.testing.assert_close(layer(x[None]), want.float()[None], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", QUANT_TYPES)
@pytest.mark.parametrize("n,k", [(25, 288), (130, 576)])
def test_kernel_rows_do_not_depend_on_their_batch(kind, n, k):
    """Batch invariance: row r of an M-row call is bitwise the 1-row call on that row, for every M
    (register tiles of 4, 3, 2, 1 rows, panels of 64, the register paths of 1 and of 2-5 rows)
    and with 1 or 2 threads.
    A tree's rows are verified together; if a row's logits depended on how many rows came with it,
    a tie could go another way than in plain decoding and the output would not be lossless."""
    gen = torch.Generator().manual_seed(k)
    layer = QuantizedLinear.from_weights(quantize_for_test(torch.randn(n, k, generator=gen) * 0.1, kind))
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
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)) * 0.3
    raw = quants.quantize(w.numpy(), GGMLQuantizationType[kind])
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]))
    assert torch.equal(quantize_for_test(w, kind).dequantize(), want)


def test_rope_row_order_undoes_the_converters_interleave():
    assert rope_row_order(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def write_tiny_llama(path):
    """A random 2-layer llama as llama.cpp lays one out (tied embedding, GGUF names), each
    matrix quantized as TYPES says."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    gen = torch.Generator().manual_seed(3)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS

    def matrix(name, n, k, scale=0.2):
        kind = GGMLQuantizationType[TYPES[name.split(".")[-2] if name.startswith("blk") else name.split(".")[0]]]
        w = (torch.randn(n, k, generator=gen) * scale).numpy()
        writer.add_tensor(name, quants.quantize(w, kind), raw_dtype=kind)

    matrix("token_embd.weight", VOCAB, HIDDEN, 1.0)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).numpy())
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        matrix(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
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


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(native model, the same file de-quantized to fp32) of the tiny llama GGUF."""
    root = tmp_path_factory.mktemp("gguf")
    gguf = root / "tiny-llama.gguf"
    write_tiny_llama(gguf)
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
