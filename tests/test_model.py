"""Our model code against transformers' own implementation, and the tree-verify forward
against plain decoding."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.kernels.tree import build_tree, verify_block
from ddtree.workers.loading import gguf_to_hf_dir, default_target_path, load_target_weights

from .helpers import make_hf_model


def our_logits(model, ids: torch.Tensor, capture=()):
    n = ids.shape[1]
    cache = model.new_cache(1, n + 1)
    return model(ids, torch.arange(n)[None], model.prefill_mask(n), cache, capture_layers=capture)


def prefilled_cache(model, prompt: torch.Tensor, slots: int = 40):
    """A cache holding `prompt` [1, n], committed."""
    n = prompt.shape[1]
    cache = model.new_cache(1, slots)
    model(prompt, torch.arange(n)[None], model.prefill_mask(n), cache)
    cache.lengths += n
    return cache


def root_path(tree, node: int) -> list[int]:
    """The nodes from the root down to `node`, root first."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return list(reversed(path))


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("llama", {}),
        ("qwen3", {}),
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                    "beta_fast": 8, "beta_slow": 2, "mscale": 1.2, "mscale_all_dim": 0.8}}),
    ],
    ids=["llama", "qwen3", "llama3-rope-scaling", "linear-rope-scaling", "yarn-rope-scaling", "yarn-mscale"],
)
def test_logits_match_transformers(tmp_path, family, overrides):
    """Our forward against transformers'; the rope-scaled cases also pin our rotary frequencies to
    transformers' own rope init (a yarn or linear config used to load and run plain RoPE)."""
    hf = make_hf_model(family, **overrides).to(torch.float32)
    hf.save_pretrained(tmp_path)
    ours = load_target_weights(tmp_path, torch.float32)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = hf(ids, output_hidden_states=True)
    out = our_logits(ours, ids, capture=(1, 0))
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    # features: outputs of decoder layers 1 then 0 = HF hidden_states[2], [1], in the asked order
    # (HF's last entry is after the final norm, so the last layer is not compared here)
    expected = torch.cat([ref.hidden_states[2], ref.hidden_states[1]], -1)
    torch.testing.assert_close(out.features, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("pad", [False, True])
def test_tree_verify_equals_plain_decoding_of_each_path(tiny_checkpoint, family, pad):
    """Each tree node's logits equal the logits plain decoding computes after that node's path."""
    _, model, _ = tiny_checkpoint(family)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 97, (1, 7), generator=g)
    tree = build_tree(11, torch.log_softmax(torch.randn(4, 97, generator=g, dtype=torch.float64), -1), 12)
    start = prompt.shape[1]
    cache = prefilled_cache(model, prompt)
    block = verify_block(tree, start, pad_to=20 if pad else None)
    out = model(block.tokens[None], block.positions[None], block.mask[None], cache)
    for node in range(tree.size):
        seq = torch.cat([prompt, tree.tokens[root_path(tree, node)][None]], dim=1)
        plain = our_logits(model, seq).logits[0, -1]
        torch.testing.assert_close(out.logits[0, node], plain, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp32_tree_verify_is_bitwise_plain_decoding(tmp_path, family):
    """In float32 on the CPU, with ddtree_cpu's row-invariant linears (float_mm) and attention
    (tree_attention), a tree node's logits are bitwise the logits plain decoding computes one
    token at a time along the node's path: the verify pass can change no token, not even at a
    near-tie. (torch's SDPA and oneDNN, the fallback, give the same values only up to float
    summation order: docs/cpu-kernels.md, "Numerics".)"""
    from ddtree.workers import cpu_kernels

    if not cpu_kernels.float_kernel():
        pytest.skip("ddtree_cpu's fp32 kernels are built for AVX2 CPUs; elsewhere equality holds at the tie rule")
    make_hf_model(family).to(torch.float32).save_pretrained(tmp_path)
    model = load_target_weights(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 97, (1, 9), generator=g)
    tree = build_tree(11, torch.log_softmax(torch.randn(5, 97, generator=g, dtype=torch.float64), -1), 16)
    block = verify_block(tree, prompt.shape[1], pad_to=17)
    out = model(block.tokens[None], block.positions[None], block.mask[None], prefilled_cache(model, prompt))
    for node in range(tree.size):
        plain_cache = prefilled_cache(model, prompt)
        for token in tree.tokens[root_path(tree, node)].tolist():  # one row per forward, as plain decoding
            logits = model(torch.tensor([[token]]), plain_cache.lengths[:, None].clone(), model.prefill_mask(1),
                           plain_cache).logits[0, -1]
            plain_cache.lengths += 1
        assert torch.equal(out.logits[0, node], logits), (node, (out.logits[0, node] - logits).abs().max())


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_a_packed_verify_computes_the_real_rows_alone_and_as_padded(tmp_path, storage):
    """A step pads every tree to one Q; on the CPU the forward computes the real rows only
    (`rows`, workers.model.Packing). Their logits, features and chosen tokens (greedy and
    seeded) are those of the padded forward -- bitwise with ddtree_cpu's row-invariant fp32
    kernels -- and the padding rows' features are zero. In the paged pool (the scheduler's) the
    attention takes the real rows as they are, never laid out padded (`PagedView.attend_rows`)."""
    from ddtree.config import SamplingParams
    from ddtree.workers import cpu_kernels
    from ddtree.workers.kv_pool import KVStorage, PageAllocator
    from ddtree.workers.model import SingleProcess

    make_hf_model("llama").to(torch.float32).save_pretrained(tmp_path)
    model = load_target_weights(tmp_path, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 97, (2, 9), generator=g)
    trees = [build_tree(int(prompts[b, -1]), torch.log_softmax(torch.randn(5, 97, generator=g, dtype=torch.float64), -1),
                        budget) for b, budget in enumerate((16, 4))]
    blocks = [verify_block(tree, 9, pad_to=17) for tree in trees]
    tokens, positions, mask = (torch.stack([getattr(b, f) for b in blocks]) for f in ("tokens", "positions", "mask"))

    def cache():
        if storage == "paged":
            pages = PageAllocator(tokens=128, page=4)
            pages._free.reverse()  # high page ids first: the tables are not contiguous
            pool = KVStorage(model.config, pages.num_pages, 4, torch.float32)
            tables = [[], []]
            for table in tables:
                pages.grow(table, 9 + 17)
            model(prompts, torch.arange(9)[None].expand(2, -1), model.prefill_mask(9), pool.batch(tables, [0, 0]))
            return pool.batch(tables, [9, 9])
        c = model.new_cache(2, 40)
        model(prompts, torch.arange(9)[None].expand(2, -1), model.prefill_mask(9), c)
        c.lengths += 9
        return c

    padded = model(tokens, positions, mask, cache(), capture_layers=(0, 1))
    sizes = [t.size for t in trees]
    packed = model(tokens, positions, mask, cache(), capture_layers=(0, 1), rows=torch.tensor(sizes))
    assert packed.logits.shape == (sum(sizes), padded.logits.shape[-1])
    same = torch.equal if cpu_kernels.float_kernel() else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    real = torch.cat([padded.logits[b, :n] for b, n in enumerate(sizes)])
    assert same(packed.logits, real)
    for b, n in enumerate(sizes):
        assert same(packed.features[b, :n], padded.features[b, :n])
        assert not packed.features[b, n:].any()
    rules = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)]
    draws = positions + 1
    want = SingleProcess().choose_rows(padded.logits, rules, [None, 7], draws)
    got = SingleProcess().choose_rows(packed.logits, rules, [None, 7], draws, packed.packing)
    for b, n in enumerate(sizes):
        assert torch.equal(got[b, :n], want[b, :n])
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(tokens, positions, mask, cache(), logits_to_keep=1, rows=torch.tensor(sizes))


@pytest.mark.smollm2
def test_smollm2_logits_match_transformers(smollm2):
    """Our fp32 SmolLM2-135M-Instruct (from the GGUF, cached as safetensors) against
    transformers reading the same cached directory."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2.directory, dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about speculative decoding."}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        ref = hf(ids).logits
    out = our_logits(smollm2.model, ids)
    torch.testing.assert_close(out.logits, ref, rtol=1e-3, atol=2e-3)
    assert torch.equal(out.logits.argmax(-1), ref.argmax(-1))


@pytest.mark.smollm2
def test_gguf_is_cached_as_safetensors(smollm2):
    """The second load of the GGUF reads the safetensors cache instead of converting again."""
    directory = gguf_to_hf_dir(default_target_path())
    assert directory == smollm2.directory
    weights = directory / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert gguf_to_hf_dir(default_target_path()) == directory
    assert weights.stat().st_mtime_ns == before
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert smollm2.tokenizer.chat_template, "chat template comes from the same GGUF"


def test_fused_projections_follow_the_weights_they_were_made_of(tmp_path):
    """q/k/v and gate/up run as one GEMM each over a fused weight whose rows the layers' own
    weights are views of. Regression guard for the stale-copy failure: after the weights are
    replaced (a load with assign=True, a .to() that copies them) the fused weight must follow,
    so the model computes with its current weights, not the ones it first fused."""
    hf = make_hf_model("llama", 64).to(torch.float32)
    hf.save_pretrained(tmp_path)
    ours = load_target_weights(tmp_path, torch.float32)
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    first = our_logits(ours, ids).logits  # fuses
    attn = ours.model.layers[0].self_attn
    fused = attn.qkv.weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()  # a view, not a second copy
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), fused)

    # new weights through the layers (assign=True replaces the tensors): the output follows them
    state = {k: v * 1.5 if k.endswith(("q_proj.weight", "up_proj.weight")) else v for k, v in ours.state_dict().items()}
    ours.load_state_dict(state, assign=True)
    fresh = load_target_weights(tmp_path, torch.float32)
    fresh.load_state_dict(state)
    assert torch.equal(our_logits(ours, ids).logits, our_logits(fresh, ids).logits)
    assert not torch.equal(our_logits(ours, ids).logits, first)

    # a dtype change copies every weight: the float64 model is the float64 checkpoint's
    as64 = load_target_weights(tmp_path, torch.float64)
    as64.load_state_dict(state)
    ours.to(torch.float64)
    assert torch.equal(our_logits(ours, ids).logits, our_logits(as64, ids).logits)
    assert sorted(ours.state_dict()) == sorted(fresh.state_dict())  # the checkpoint's names, unchanged


def test_a_features_only_forward_stops_after_the_last_captured_layer(tmp_path):
    """The data stage wants a prefill's captured features and nothing after them: a
    `features_only` forward runs the layers up to the last captured one (SmolLM2's layers 1, 14,
    27 of 30: the last two and the LM head were computed for nothing) and gives those layers'
    outputs exactly as the full forward does."""
    make_hf_model("llama").to(torch.float32).save_pretrained(tmp_path)
    model = load_target_weights(tmp_path, torch.float32)
    layers = len(model.model.layers)
    assert layers >= 2  # else no layer follows the captured one
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: ran.append(i))
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(5))
    full = our_logits(model, ids, capture=(0,))
    assert ran == list(range(layers))
    ran.clear()
    n = ids.shape[1]
    part = model(ids, torch.arange(n)[None], model.prefill_mask(n), model.new_cache(1, n), capture_layers=(0,),
                 features_only=True)
    assert ran == [0] and part.logits is None
    assert torch.equal(part.features, full.features)
    with pytest.raises(ValueError, match="capture_layers"):
        model(ids, torch.arange(n)[None], model.prefill_mask(n), model.new_cache(1, n), features_only=True)
