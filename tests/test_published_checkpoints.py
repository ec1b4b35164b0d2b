"""A Qwen3 target with a drafter in z-lab's published DFlash layout works as the reference does,
and what ddtree cannot run the same way is refused (issue 20).

The fixture is what a real deployment points ddtree at, shrunk: a tiny random Qwen3 target saved
by transformers itself (sharded, with a Qwen3-style chat template), and a drafter checkpoint whose
config.json has exactly the keys of z-lab/Qwen3-8B-DFlash-b16's (auto_map, block 16, five target
layers) and whose bf16 weights are sharded with an index. Against it: the drafter's forward equals
an independent plain-torch forward written here from the reference's equations (z-lab/dflash
`dflash/model.py`), with features taken from transformers' own hidden_states; greedy generation
equals transformers' greedy decoding; and each of the issue's five cases has its test.

`make gpu-check` runs this file on CUDA (DDTREE_KERNEL_DEVICE=cuda): the lossless test then runs
the engine's device path in float32.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.config import ModelPairConfig, SamplingParams
from ddtree.engine import Engine
from ddtree.workers.drafter import PUBLISHED_CONFIG_KEYS, DFlashConfig, DFlashDrafter
from ddtree.workers.loading import load_target_weights
from ddtree.workers.model import ModelConfig

from .helpers import hf_greedy, make_hf_model

DEVICE = os.environ.get("DDTREE_KERNEL_DEVICE", "cpu")

# z-lab/Qwen3-8B-DFlash-b16's config.json as published on the Hugging Face hub (the same
# transformers-4.57 layout as its Qwen3-4B sibling): every key, the published values.
Z_LAB_QWEN3_8B_B16 = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

VOCAB, TARGET_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 97, 8, 32, 4, 2, 8
DRAFT_LAYERS, DRAFT_INTER, BLOCK = 2, 48, 16
LAYER_IDS = [1, 2, 3, 4, 5]  # five, spread from the second layer to the third-to-last, as published
MASK = VOCAB - 3

# The tokens of the fixture's word-level tokenizer: specials first (ids 0-5), then words.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "[UNK]"]
WORDS = ["user", "assistant", "system"] + [f"w{i}" for i in range(VOCAB - len(SPECIALS) - 3)]
# The part of Qwen3's chat template this test depends on: with add_generation_prompt, the
# assistant turn opens with an empty think block exactly when enable_thinking is false.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CHAT = [{"role": "user", "content": "w3 w17 w40 w5"}]


def write_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:5])
    fast.chat_template = QWEN3_STYLE_TEMPLATE
    fast.save_pretrained(directory)


def write_target(directory, family: str = "qwen3", **overrides):
    """A tiny random target saved by transformers, its weights in several shards."""
    hf = make_hf_model(family, VOCAB, layers=TARGET_LAYERS, seed=11, **overrides)
    hf.save_pretrained(directory, max_shard_size="100KB")
    write_tokenizer(directory)
    return hf


def published_drafter_config(**overrides) -> dict:
    """The published config.json with tiny sizes: the same keys, the same layout (plus any
    `overrides` a refusal test adds)."""
    config = {
        **Z_LAB_QWEN3_8B_B16,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS},
        "bos_token_id": None,
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_size": HIDDEN,
        "intermediate_size": DRAFT_INTER,
        "layer_types": ["full_attention"] * DRAFT_LAYERS,
        "max_position_embeddings": 512,
        "max_window_layers": DRAFT_LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": DRAFT_LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": TARGET_LAYERS,
        "vocab_size": VOCAB,
        **overrides,
    }
    return config


def write_published_drafter(directory, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """Random bf16 weights under the published tensor names, in three shards + an index, as
    transformers' save_pretrained shards a checkpoint; config.json as published_drafter_config."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, around=0.0):
        return (around + torch.randn(*shape, generator=g, dtype=torch.float64) * 0.2).to(torch.bfloat16)

    state = {"fc.weight": rand(HIDDEN, HIDDEN * len(LAYER_IDS)), "hidden_norm.weight": rand(HIDDEN, around=1),
             "norm.weight": rand(HIDDEN, around=1)}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": rand(HEAD_DIM, around=1),
            p + "self_attn.k_norm.weight": rand(HEAD_DIM, around=1),
            p + "input_layernorm.weight": rand(HIDDEN, around=1),
            p + "post_attention_layernorm.weight": rand(HIDDEN, around=1),
            p + "mlp.gate_proj.weight": rand(DRAFT_INTER, HIDDEN),
            p + "mlp.up_proj.weight": rand(DRAFT_INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, DRAFT_INTER),
        }
    names = sorted(state)
    shards = [names[0::3], names[1::3], names[2::3]]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in shard}, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(published_drafter_config(**overrides), indent=2))
    return state


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    hf = write_target(root / "qwen3-target")
    state = write_published_drafter(root / "drafter")
    return hf, root / "qwen3-target", root / "drafter", state


# --- the fixture loads as published ---------------------------------------------------------


def test_the_fixture_is_the_published_layout(pair):
    """Every key of z-lab's config.json, the weights sharded; both target and drafter load."""
    _, target_dir, drafter_dir, state = pair
    config = json.loads((drafter_dir / "config.json").read_text())
    assert set(config) == set(Z_LAB_QWEN3_8B_B16) and config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["block_size"] == 16 and len(config["dflash_config"]["target_layer_ids"]) == 5
    assert not (drafter_dir / "model.safetensors").exists() and len(list(drafter_dir.glob("model-*.safetensors"))) == 3
    assert len(list(target_dir.glob("model-*.safetensors"))) > 1, "the target is sharded too"
    target = load_target_weights(target_dir, torch.float64)
    drafter = DFlashDrafter.load(drafter_dir, target)
    assert drafter.block_size == 16 and drafter.target_layer_ids == tuple(LAYER_IDS)
    assert drafter.config.mask_token_id == MASK and drafter.draft_vocab is None
    ours = drafter.state_dict()
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert torch.equal(ours[name], tensor.double())


# --- an independent forward from the reference's equations -----------------------------------


def reference_dflash(config: dict, state: dict, hf, context_ids: list[int], bonus: int) -> torch.Tensor:
    """z-lab/dflash's DFlashDraftModel forward, written from its equations with no cache: the
    target's hidden_states[i + 1] for i in target_layer_ids over the context, concatenated ->
    fc -> hidden_norm; the block [bonus, MASK x 15] embedded by the target; in every layer, the
    queries of the normed block attend (no mask) to keys/values of [context ; normed block]
    through the layer's own k/v projections and k-norm, RoPE at positions 0 ... n + 15 (the
    queries at the block's); final norm; the target's LM head on block rows 1 .... Returns
    log-probs [15, V]. RoPE comes from transformers' Qwen3RotaryEmbedding of the drafter's own
    config, as the reference builds it."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    eps, dim, heads, kv_heads = config["rms_norm_eps"], config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    W = {k: v.double() for k, v in state.items()}

    def norm(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rotate(x, cos, sin):  # x [T, h, D]; cos, sin [T, D]
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]

    with torch.no_grad():
        out = hf(torch.tensor([context_ids]), output_hidden_states=True)
        target_hidden = torch.cat([out.hidden_states[i + 1][0] for i in config["dflash_config"]["target_layer_ids"]], -1)
        n, s = len(context_ids), config["block_size"]
        ctx = norm(target_hidden.double() @ W["fc.weight"].T, W["hidden_norm.weight"])
        block = torch.tensor([bonus] + [config["dflash_config"]["mask_token_id"]] * (s - 1))
        x = hf.model.embed_tokens(block).double()
        rotary = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in config.items() if k != "auto_map"})).double()
        cos, sin = rotary(x[None], torch.arange(n + s)[None])
        cos, sin = cos[0].double(), sin[0].double()
        for i in range(config["num_hidden_layers"]):
            p = f"layers.{i}."
            h = norm(x, W[p + "input_layernorm.weight"])
            q = norm((h @ W[p + "self_attn.q_proj.weight"].T).view(s, heads, dim), W[p + "self_attn.q_norm.weight"])
            both = torch.cat([ctx, h])
            k = norm((both @ W[p + "self_attn.k_proj.weight"].T).view(n + s, kv_heads, dim), W[p + "self_attn.k_norm.weight"])
            v = (both @ W[p + "self_attn.v_proj.weight"].T).view(n + s, kv_heads, dim)
            q, k = rotate(q, cos[n:], sin[n:]), rotate(k, cos, sin)
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / dim**0.5, -1)
            x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(s, -1) @ W[p + "self_attn.o_proj.weight"].T
            h = norm(x, W[p + "post_attention_layernorm.weight"])
            x = x + (torch.nn.functional.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
        logits = hf.lm_head(norm(x, W["norm.weight"])[1:].to(hf.lm_head.weight.dtype))
    return torch.log_softmax(logits.double(), -1)


def ours_after_prefill(target, drafter, context_ids: list[int], bonus: int) -> torch.Tensor:
    """Our drafter's log-probs for the block after `context_ids`, fed our target's features."""
    n = len(context_ids)
    cache = target.new_cache(1, n + 1)
    out = target(torch.tensor([context_ids]), torch.arange(n)[None], target.prefill_mask(n), cache,
                 capture_layers=drafter.target_layer_ids)
    return drafter.draft(drafter.new_cache(1, 64), out.features, torch.tensor([bonus]), torch.tensor([n]))[0]


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["published", "yarn-drafter"])
def test_our_drafter_equals_the_reference_forward(pair, tmp_path, rope_scaling):
    """Our cached, GQA, fp64 drafter against the reference's equations on the published
    checkpoint, with features from transformers' hidden_states (not from our target). The
    yarn case: a drafter config's rope_scaling used to be read and ignored."""
    hf, target_dir, _, _ = pair
    directory = tmp_path / "drafter"
    state = write_published_drafter(directory, seed=5, rope_scaling=rope_scaling)
    config = json.loads((directory / "config.json").read_text())
    target = load_target_weights(target_dir, torch.float64)
    drafter = DFlashDrafter.load(directory, target)
    g = torch.Generator().manual_seed(2)
    for n in (1, 9, 30):
        context = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        want = reference_dflash(config, state, hf, context, bonus=7)
        got = ours_after_prefill(target, drafter, context, bonus=7)
        # transformers computes RoPE in float32 (ours: float64), hence not 1e-12; a wrong equation
        # or frequency moves log-probs by far more than 1e-5
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# --- lossless through the engine ----------------------------------------------------------


def test_greedy_through_the_engine_equals_transformers(pair):
    """The engine on the published pair (Qwen3 chat rendering, sharded target and drafter)
    drafts every round and its greedy output equals transformers' own greedy decoding at the
    chain and at tree budgets."""
    hf, target_dir, drafter_dir, _ = pair
    dtype = "float32" if DEVICE == "cuda" else "float64"
    engine = Engine.from_config(ModelPairConfig(model=str(target_dir), drafter=str(drafter_dir), budget=16,
                                                dtype=dtype, device=DEVICE))
    prompt = engine.render_chat(CHAT)
    reference = copy.deepcopy(hf).to(getattr(torch, dtype)).to(DEVICE)  # the fixture's model stays fp64 on CPU
    want = hf_greedy(reference, prompt, 40) if DEVICE == "cpu" else None
    for budget in ("chain", 4, 16, 40):
        result = engine.generate([engine.request(prompt, 40, SamplingParams(), budget=budget)])[0]
        if want is None:  # hf_greedy on CUDA: the same recompute, on the device
            with torch.no_grad():
                ids, want = torch.tensor([prompt], device=DEVICE), []
                for _ in range(40):
                    token = int(reference(ids).logits[0, -1].argmax())
                    want.append(token)
                    ids = torch.cat([ids, torch.tensor([[token]], device=DEVICE)], 1)
        eos = want.index(2) + 1 if 2 in want else len(want)  # <|im_end|> stops the engine
        assert result.tokens == want[:eos], f"budget {budget}"
        assert result.rounds and all(r.tree_size > 1 for r in result.rounds), "every round drafted"


# --- 1. chat rendering --------------------------------------------------------------------


def test_a_qwen3_target_renders_without_thinking_by_default(pair, tmp_path):
    """Bug: chat rendering left Qwen3's thinking mode on, so the first tokens were a <think>
    block the b16 drafters never saw in training. Now a qwen3 target renders as transformers
    does with enable_thinking=False, unless the config or the request says otherwise."""
    _, target_dir, drafter_dir, _ = pair
    engine = Engine.from_config(ModelPairConfig(model=str(target_dir), drafter=str(drafter_dir), budget=0, dtype="float64"))
    tok = engine.target.tokenizer

    def hf_render(**kwargs):
        text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    think = tok.convert_tokens_to_ids("<think>")
    assert engine.chat_template_kwargs == {"enable_thinking": False}
    assert engine.render_chat(CHAT) == hf_render(enable_thinking=False) and think in engine.render_chat(CHAT)
    assert engine.render_chat(CHAT, {"enable_thinking": True}) == hf_render(enable_thinking=True) != hf_render(enable_thinking=False)
    with pytest.raises(ValueError, match="tokenize"):
        engine.render_chat(CHAT, {"tokenize": True})

    thinking = Engine.from_config(ModelPairConfig(model=str(target_dir), drafter=str(drafter_dir), budget=0, dtype="float64",
                                                  chat_template_kwargs={"enable_thinking": True}))
    assert think not in thinking.render_chat(CHAT)
    assert thinking.render_chat(CHAT, {"enable_thinking": False}) == hf_render(enable_thinking=False)

    llama = tmp_path / "llama"
    write_target(llama, "llama")
    other = Engine.from_config(ModelPairConfig(model=str(llama), budget=0, dtype="float64"))
    assert other.chat_template_kwargs == {} and other.render_chat(CHAT) == hf_render()


def test_training_renders_prompts_as_the_engine_serves_them(pair):
    """A drafter trained by ddtree for a Qwen3 target learns from non-thinking prompts, the
    ones the engine will serve it (the same default, default_chat_template_kwargs)."""
    from ddtree.training.evaluate import reference_continuations
    from ddtree.workers.loading import load_target

    _, target_dir, _, _ = pair
    target = load_target(target_dir, torch.float64)
    requests, _ = reference_continuations(target, [CHAT[0]["content"]], 2)
    text = target.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert requests[0].prompt == target.tokenizer.encode(text, add_special_tokens=False)


def test_a_request_passes_chat_template_kwargs_as_vllm_does():
    """The OpenAI body's `chat_template_kwargs` reaches the engine's rendering."""
    from ddtree.serve.openai_api import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}).engine_body()
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT}).engine_body()["chat_template_kwargs"] is None


# --- 2. rope scaling ----------------------------------------------------------------------


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}])
def test_rope_types_that_depend_on_length_are_refused(rope):
    """Bug: any rope_scaling but llama3 was accepted and ignored (a yarn config loaded and ran
    plain RoPE). linear, llama3 and yarn now run (test_model, above); dynamic and longrope,
    whose frequencies change with the sequence length, are refused by name."""
    base = make_hf_model("qwen3").config.to_dict()
    with pytest.raises(ValueError, match=rope["rope_type"]):
        ModelConfig.from_hf({**base, "rope_scaling": rope, "rope_parameters": None})
    with pytest.raises(ValueError, match=rope["rope_type"]):
        DFlashConfig.from_hf(published_drafter_config(rope_scaling=rope))


# --- 3. sliding-window layers -------------------------------------------------------------


def test_sliding_window_layers_are_refused(pair, tmp_path):
    """Bug: `layer_types` with sliding-window layers was accepted and run as full attention.
    Now the target and the drafter refuse them; all-"full_attention" layer_types load (the
    fixture's target, saved by transformers 5, and the published drafter both carry them).
    Newer drafters' other departures (causal blocks, DFlash2, attention sinks) are refused too."""
    _, target_dir, _, _ = pair
    hf_config = json.loads((target_dir / "config.json").read_text())
    assert set(hf_config["layer_types"]) == {"full_attention"}
    ModelConfig.from_hf(hf_config)
    sliding = ["full_attention"] * 4 + ["sliding_attention"] * 4
    with pytest.raises(ValueError, match="sliding_attention"):
        ModelConfig.from_hf({**hf_config, "layer_types": sliding, "sliding_window": 64})
    legacy = {k: v for k, v in hf_config.items() if k != "layer_types"}
    with pytest.raises(ValueError, match="sliding_attention"):  # transformers' qwen3 derivation
        ModelConfig.from_hf({**legacy, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4})

    target = load_target_weights(target_dir, torch.float64)
    for overrides, match in [
        ({"layer_types": ["sliding_attention"] * DRAFT_LAYERS, "sliding_window": 2048, "use_sliding_window": True}, "sliding_attention"),
        ({"is_causal": True}, "is_causal"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
        ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, "attention_sink_bias": True}},
         "attention_sink_bias"),
    ]:
        directory = tmp_path / match
        write_published_drafter(directory, **overrides)
        with pytest.raises(ValueError, match=match):
            DFlashDrafter.load(directory, target)


# --- 4. the target's last layer -----------------------------------------------------------


def test_the_loader_refuses_the_targets_last_layer(pair, tmp_path):
    """Bug: the loader accepted a target_layer_ids entry naming the target's last layer. Our
    feature there is the layer's own output; the reference's hidden_states[L] is after the
    final norm, so such a drafter would be fed other inputs than it was trained on. Training
    already refused it; both now ask one rule (check_target_layer_ids)."""
    hf, target_dir, _, _ = pair
    out = hf(torch.tensor([[5, 9, 13]]), output_hidden_states=True)
    ours = load_target_weights(target_dir, torch.float64)
    cache = ours.new_cache(1, 4)
    mine = ours(torch.tensor([[5, 9, 13]]), torch.arange(3)[None], ours.prefill_mask(3), cache,
                capture_layers=(TARGET_LAYERS - 1,)).features
    assert not torch.allclose(mine, out.hidden_states[TARGET_LAYERS]), "the convention really differs there"

    directory = tmp_path / "last"
    write_published_drafter(directory, dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 2, 3, 4, TARGET_LAYERS - 1]})
    with pytest.raises(ValueError, match="last"):
        DFlashDrafter.load(directory, ours)


# --- 5. export and shard-aware identity ---------------------------------------------------


def test_the_published_export_is_the_published_layout(pair, tmp_path):
    """Bug: exports had no auto_map and carried an extra `draft_vocab` tensor. layout
    'published' writes exactly z-lab's keys and only the drafter's tensors, and loads back;
    a drafter with a draft vocabulary is refused (not widened), with what to do instead."""
    _, target_dir, drafter_dir, state = pair
    target = load_target_weights(target_dir, torch.float64)
    drafter = DFlashDrafter.load(drafter_dir, target).to(torch.bfloat16)
    out = tmp_path / "export"
    drafter.save(out, layout="published", eos_token_id=2)
    config = json.loads((out / "config.json").read_text())
    assert list(config) == list(PUBLISHED_CONFIG_KEYS) and set(config) == set(Z_LAB_QWEN3_8B_B16)
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and config["dtype"] == "bfloat16"
    for key in ("architectures", "block_size", "dflash_config", "hidden_size", "num_hidden_layers",
                "num_target_layers", "layer_types", "rope_theta", "rope_scaling", "model_type"):
        assert config[key] == published_drafter_config()[key], key
    assert set(load_file(str(out / "model.safetensors"))) == set(state), "no tensors beyond the published ones"
    again = DFlashDrafter.load(out, target)
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, state[name].double())

    drafter.set_draft_vocab(torch.arange(0, VOCAB, 2))
    with pytest.raises(ValueError, match="draft vocabulary"):
        drafter.save(tmp_path / "refused", layout="published")
    drafter.save(tmp_path / "ours")  # ddtree's layout keeps it
    assert "draft_vocab" in load_file(str(tmp_path / "ours" / "model.safetensors"))
