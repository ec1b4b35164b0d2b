"""Helpers the tests share (fixtures live in conftest.py): tiny random Hugging Face models, the
plain-decoding oracle, the Serve app's constants, a free loopback port and the benchmark scripts
as modules."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}

# The real Serve app on 127.0.0.1 (conftest's `server` fixture): its model name and context.
MODEL = "tiny-ddtree"
CONTEXT = 256
CHAT_SAMPLE = [{"role": "user", "content": "Tell me about trees."}]


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str):
    """benchmarks/NAME.py loaded as a module (benchmarks/ is scripts, not a package)."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass's module must be importable by its name
    spec.loader.exec_module(module)
    return module


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_tokenizer(source, directory) -> None:
    """Every file of checkpoint `source` but its config and weights: tokenizer, chat template."""
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, directory / f.name)
