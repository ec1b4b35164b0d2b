"""The DFlash drafter: loads the published checkpoint format; cached drafting equals a recompute."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ddtree.workers.drafter import DFlashDrafter

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK = 32, 4, 2, 8, 48, 2, 5
TARGET_LAYERS = [0, 1]  # not 2: the 3-layer target's last layer is refused (check_target_layer_ids)


def write_published_checkpoint(directory, vocab: int, seed: int = 0):
    """A tiny random drafter written by hand in the published DFlash layout (config fields and
    tensor names as released checkpoints have them), not through ddtree's own save()."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    state = {"fc.weight": rand(HIDDEN, HIDDEN * len(TARGET_LAYERS)),
             "hidden_norm.weight": 1 + rand(HIDDEN), "norm.weight": 1 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + rand(HEAD_DIM),
            p + "self_attn.k_norm.weight": 1 + rand(HEAD_DIM),
            p + "input_layernorm.weight": 1 + rand(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
        }
    save_file(state, str(directory / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": BLOCK,
        "num_target_layers": 3,
        "dflash_config": {"target_layer_ids": TARGET_LAYERS, "mask_token_id": vocab - 2},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return state, config


def reference_draft(state, config, target, features, bonus: int, start: int):
    """Plain-torch DFlash forward from the published description, no cache: context = all
    features before `start`; queries = the block; keys = [context ; block], all visible."""
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    norm = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)

    def rope(x, pos):  # x [T, heads, D]
        f = pos.double()[:, None] * inv
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]], -1) * sin

    W = {k: v.double() for k, v in state.items()}
    n = features.shape[0]
    ctx = norm(features @ W["fc.weight"].T, W["hidden_norm.weight"])
    block = torch.full((BLOCK,), config["dflash_config"]["mask_token_id"])
    block[0] = bonus
    x = target.model.embed_tokens(block).double()
    ctx_pos, blk_pos = torch.arange(n), start + torch.arange(BLOCK)
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = norm(x, W[p + "input_layernorm.weight"])
        q = rope(norm((h @ W[p + "self_attn.q_proj.weight"].T).view(BLOCK, HEADS, HEAD_DIM), W[p + "self_attn.q_norm.weight"]), blk_pos)
        both = torch.cat([ctx, h])
        k = (both @ W[p + "self_attn.k_proj.weight"].T).view(n + BLOCK, KV_HEADS, HEAD_DIM)
        k = rope(norm(k, W[p + "self_attn.k_norm.weight"]), torch.cat([ctx_pos, blk_pos]))
        v = (both @ W[p + "self_attn.v_proj.weight"].T).view(n + BLOCK, KV_HEADS, HEAD_DIM)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(BLOCK, -1) @ W[p + "self_attn.o_proj.weight"].T
        h = norm(x, W[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)
        x = x + act @ W[p + "mlp.down_proj.weight"].T
    logits = target.lm_head(norm(x, W["norm.weight"])[1:])
    return torch.log_softmax(logits, -1)


@pytest.fixture
def drafter_and_state(tmp_path, tiny_checkpoint):
    _, target, _ = tiny_checkpoint("llama")
    state, config = write_published_checkpoint(tmp_path, vocab=97)
    return DFlashDrafter.load(tmp_path, target), state, config, target


def test_loads_published_format(drafter_and_state):
    drafter, state, config, _ = drafter_and_state
    assert drafter.block_size == BLOCK and drafter.target_layer_ids == tuple(TARGET_LAYERS)
    assert drafter.config.mask_token_id == 95
    ours = drafter.state_dict()
    assert set(ours) == set(state), "exactly the published tensor names, nothing of the target's"
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor.double())


def test_matches_plain_torch_reference(drafter_and_state):
    drafter, state, config, target = drafter_and_state
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, 9, HIDDEN * 2, generator=g, dtype=torch.float64)
    cache = drafter.new_cache(1, 32)
    got = drafter.draft(cache, features, torch.tensor([4]), torch.tensor([9]))[0]
    want = reference_draft(state, config, target, features[0], 4, 9)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_cached_incremental_drafting_equals_recompute(drafter_and_state):
    """Three rounds that hand over 6, 2 and 3 newly committed tokens' features give the same
    distributions as a fresh drafter cache fed all features at once, each round."""
    drafter, *_ = drafter_and_state
    g = torch.Generator().manual_seed(2)
    features = torch.randn(1, 11, HIDDEN * 2, generator=g, dtype=torch.float64)
    cache = drafter.new_cache(1, 32)
    for end, bonus in [(6, 3), (8, 17), (11, 50)]:
        begun = int(cache.lengths[0])
        incremental = drafter.draft(cache, features[:, begun:end], torch.tensor([bonus]), torch.tensor([end]))
        assert int(cache.lengths[0]) == end, "the context cache holds exactly the committed tokens"
        fresh = drafter.draft(drafter.new_cache(1, 32), features[:, :end], torch.tensor([bonus]), torch.tensor([end]))
        torch.testing.assert_close(incremental, fresh, rtol=0, atol=1e-12)


def test_rejects_a_misaligned_context(drafter_and_state):
    drafter, *_ = drafter_and_state
    cache = drafter.new_cache(1, 32)
    with pytest.raises(ValueError, match="bonus sits at"):
        drafter.draft(cache, torch.zeros(1, 4, HIDDEN * 2, dtype=torch.float64), torch.tensor([1]), torch.tensor([6]))


def test_save_load_round_trip(tmp_path, tiny_checkpoint):
    _, target, _ = tiny_checkpoint("qwen3")
    drafter = DFlashDrafter.untrained(target, block_size=4, seed=3)
    drafter.save(tmp_path)
    again = DFlashDrafter.load(tmp_path, target)
    features = torch.randn(1, 5, drafter.fc.in_features, dtype=torch.float64)
    args = (features, torch.tensor([2]), torch.tensor([5]))
    assert torch.equal(drafter.draft(drafter.new_cache(1, 16), *args), again.draft(again.new_cache(1, 16), *args))


def test_training_blocks_equal_drafting_at_each_anchor(drafter_and_state):
    """The batched training forward gives, for every anchor, the distributions drafting there
    gives (context = features before the anchor, block = [token at anchor, MASK...])."""
    drafter, *_ = drafter_and_state
    g = torch.Generator().manual_seed(4)
    features = torch.randn(14, HIDDEN * 2, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 95, (14,), generator=g)
    anchors = torch.tensor([1, 5, 9])
    train = torch.log_softmax(drafter.block_logits(features, tokens, anchors).double(), -1)
    for i, a in enumerate(anchors.tolist()):
        drafted = drafter.draft(drafter.new_cache(1, 32), features[None, :a], tokens[a : a + 1], torch.tensor([a]))
        torch.testing.assert_close(train[i], drafted[0], rtol=0, atol=1e-10)


DRAFT_VOCAB = [0, 3, 4, 17, 40, 41, 88, 95, 96]


def test_a_draft_vocabulary_restricts_the_head_only(drafter_and_state, tmp_path):
    """With a draft vocabulary the drafter's logits are the full head's at those ids and -inf
    elsewhere (log-probs renormalised over the subset); the ids travel in the checkpoint
    (`dflash_config.draft_vocab_size` + a `draft_vocab` tensor) and load back exactly."""
    drafter, state, config, target = drafter_and_state
    g = torch.Generator().manual_seed(6)
    features = torch.randn(1, 7, HIDDEN * 2, generator=g, dtype=torch.float64)
    args = (torch.tensor([5]), torch.tensor([7]))
    full = drafter.draft_logits(drafter.new_cache(1, 32), features, *args)
    restricted = DFlashDrafter.load(tmp_path, target)
    restricted.set_draft_vocab(torch.tensor(DRAFT_VOCAB[::-1]))  # any order; kept sorted
    assert restricted.draft_vocab.tolist() == DRAFT_VOCAB and restricted.config.draft_vocab_size == len(DRAFT_VOCAB)
    logits = restricted.draft_logits(restricted.new_cache(1, 32), features, *args)
    outside = torch.ones(97, dtype=torch.bool)
    outside[DRAFT_VOCAB] = False
    torch.testing.assert_close(logits[..., DRAFT_VOCAB], full[..., DRAFT_VOCAB], rtol=0, atol=1e-12)  # same rows
    assert torch.isneginf(logits[..., outside]).all()
    logprobs = restricted.draft(restricted.new_cache(1, 32), features, *args)
    torch.testing.assert_close(logprobs[..., DRAFT_VOCAB], torch.log_softmax(full[..., DRAFT_VOCAB], -1), rtol=0, atol=1e-12)

    saved = tmp_path / "restricted"
    restricted.save(saved)
    assert json.loads((saved / "config.json").read_text())["dflash_config"]["draft_vocab_size"] == len(DRAFT_VOCAB)
    again = DFlashDrafter.load(saved, target)
    assert again.draft_vocab.dtype == torch.int64 and again.draft_vocab.tolist() == DRAFT_VOCAB
    assert torch.equal(again.draft(again.new_cache(1, 32), features, *args), logprobs)


def test_training_labels_outside_the_draft_vocabulary_are_ignored(drafter_and_state):
    drafter, *_ = drafter_and_state
    drafter.set_draft_vocab(torch.tensor(DRAFT_VOCAB))
    assert drafter.draft_ids(torch.tensor([17, 5, 96, 0])).tolist() == [3, -100, 8, 0]
    g = torch.Generator().manual_seed(4)
    features = torch.randn(14, HIDDEN * 2, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 95, (14,), generator=g)
    assert drafter.block_logits(features, tokens, torch.tensor([2, 6])).shape == (2, BLOCK - 1, len(DRAFT_VOCAB))


def test_a_restricted_drafter_stays_lossless(tiny_checkpoint):
    """The draft vocabulary shapes the trees, never the output: greedy generation through a
    drafter that cannot propose most tokens equals plain decoding, at every budget."""
    from ddtree.config import SamplingParams
    from ddtree.workers.requests import Request
    from ddtree.workers.solo import SoloLoop

    _, target, _ = tiny_checkpoint("llama")
    drafter = DFlashDrafter.untrained(target, block_size=4, seed=1)
    drafter.set_draft_vocab(torch.arange(0, 97, 3))
    request = Request([5, 9, 2, 33, 7], 24, sampling=SamplingParams())
    plain = SoloLoop.local(target).generate([request])[0].tokens
    for budget in ["chain", 6, 16]:
        assert SoloLoop.local(target, drafter, budget).generate([request])[0].tokens == plain
