"""The one validated configuration of a ddtree Serve application.

`ddtree serve --config FILE`, `serve run` / `serve deploy` (the `args` of the application in a
Serve config YAML) and the Python builder all map onto `ServeConfig`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config import ModelPairConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class AutoscalingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas (model instances).")
    max_replicas: int = Field(1, ge=1, description="Most engine replicas.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica that autoscaling aims for."
    )

    @model_validator(mode="after")
    def _order(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class ServeConfig(ModelPairConfig):
    """A model pair plus how it is served."""

    model_name: str | None = Field(
        None, description="The id clients pass as `model`; default: the target's name."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="Completion tokens when a request names no max_tokens (capped by the context)."
    )
    max_ongoing_requests: int = Field(
        8, ge=1, description="Requests one engine replica holds at once; its rounds interleave."
    )
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each engine replica.")
    engine_num_gpus: float = Field(
        0.0, ge=0, description="GPUs Ray reserves for each engine replica at tp: 1 (at tp > 1 the "
        "replica's placement group reserves one GPU per shard instead)."
    )

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name
