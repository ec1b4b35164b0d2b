"""The in-process engine: loads a model pair from a GenerateConfig and runs prompts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import GenerateConfig
from .workers.coordinator import Coordinator, Request, Result
from .workers.drafter import DFlashDrafter
from .workers.loading import LoadedTarget, load_target


@dataclass
class Engine:
    config: GenerateConfig
    target: LoadedTarget
    coordinator: Coordinator

    @classmethod
    def from_config(cls, config: GenerateConfig) -> "Engine":
        dtype = getattr(torch, config.dtype)
        target = load_target(config.model, dtype)
        drafter = None
        if config.budget != 0:
            drafter = (
                DFlashDrafter.load(config.drafter, target.model)
                if config.drafter
                else DFlashDrafter.untrained(target.model, block_size=config.block_size)
            )
        tok = target.tokenizer
        coordinator = Coordinator(
            target.model,
            drafter,
            config.budget,
            static_shapes=config.static_shapes,
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        )
        return cls(config, target, coordinator)

    def chat_prompt(self, user_message: str) -> list[int]:
        """One user message rendered with the model's own chat template."""
        tok = self.target.tokenizer
        text = tok.apply_chat_template(
            [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
        )
        return tok.encode(text, add_special_tokens=False)

    def request(self, user_message: str) -> Request:
        eos = self.target.tokenizer.eos_token_id
        return Request(
            prompt=self.chat_prompt(user_message),
            max_tokens=self.config.max_tokens,
            stop=tuple(self.config.stop),
            eos_token_ids=(eos,) if eos is not None else (),
        )

    def generate(self, user_messages: list[str]) -> list[Result]:
        return self.coordinator.generate([self.request(m) for m in user_messages])
