"""The in-process engine: a model pair loaded from its config, plus the tokenizer's side of a
request (chat template, EOS, decoding). The CLI and the Serve engine deployment both use it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .config import GenerateConfig, ModelPairConfig, SamplingParams
from .workers.coordinator import Budget, Coordinator, Request, Result
from .workers.drafter import DFlashDrafter
from .workers.loading import LoadedTarget, load_target, load_tokenizer, target_directory
from .workers.model import ModelConfig


SHIPPED_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"


def shipped_drafter() -> Path | None:
    """The trained drafter this package ships for the default target, if any."""
    return SHIPPED_DRAFTER if (SHIPPED_DRAFTER / "model.safetensors").is_file() else None


def device(config: ModelPairConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass
class Engine:
    config: ModelPairConfig
    target: LoadedTarget  # its model is None when the target lives in TargetShard actors (tp > 1)
    coordinator: Coordinator  # or a DistributedEngine (same generate / stream / budget)

    @classmethod
    def from_config(cls, config: ModelPairConfig) -> "Engine":
        dtype = getattr(torch, config.dtype)
        # The drafter is loaded even at budget 0, so that a request may ask for another budget.
        drafter_path = config.drafter or (shipped_drafter() if config.model is None else None)
        fixed = 0 if config.budget == "auto" else config.budget
        if config.tp > 1:
            from .workers.distributed import DistributedEngine, WorkerSpec

            directory = target_directory(config.model)
            target = LoadedTarget(None, load_tokenizer(directory), directory)  # the weights live in the shards
            threads = max(1, torch.get_num_threads() // config.tp)
            spec = WorkerSpec(str(directory), str(drafter_path) if drafter_path else None, config.block_size,
                              config.dtype, config.tp, threads)
            engine = cls(config, target, DistributedEngine(spec, fixed, config.static_shapes))
        else:
            target = load_target(config.model, dtype)
            target.model.to(device(config))
            drafter = (
                DFlashDrafter.load(drafter_path, target.model)
                if drafter_path
                else DFlashDrafter.untrained(target.model, block_size=config.block_size)
            ).to(device(config))
            engine = cls(config, target, None)
            engine.coordinator = Coordinator(
                target.model, drafter, fixed, static_shapes=config.static_shapes, decode=engine.decode
            )
        if config.budget == "auto":
            from .calibrate import calibrated_budget

            if drafter_path:
                weights = Path(drafter_path) / "model.safetensors"
                drafter_id = f"{drafter_path}:{weights.stat().st_size}:{weights.stat().st_mtime_ns}"
            else:
                drafter_id = f"untrained-block{config.block_size}"
            engine.coordinator.budget = calibrated_budget(engine, drafter_id)
        return engine

    @property
    def budget(self):
        """The budget requests run at unless they ask for another (auto resolved)."""
        return self.coordinator.budget

    @cached_property
    def context_length(self) -> int:
        config = json.loads((self.target.directory / "config.json").read_text())
        return ModelConfig.from_hf(config).max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.target.tokenizer.eos_token_id
        return (eos,) if eos is not None else ()

    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Messages rendered with the model's own chat template, ready for the assistant's turn."""
        tok = self.target.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.target.tokenizer.encode(text)

    def request(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: tuple[str, ...] = (),
        budget: Budget | None = None,
    ) -> Request:
        return Request(prompt, max_tokens, tuple(stop), self.eos_token_ids, sampling, budget)

    def generate(self, user_messages: list[str], config: GenerateConfig) -> list[Result]:
        """`ddtree generate`: each message is one user turn."""
        requests = [
            self.request(self.render_chat([{"role": "user", "content": m}]), config.max_tokens, config.sampling, tuple(config.stop))
            for m in user_messages
        ]
        return self.coordinator.generate(requests)
