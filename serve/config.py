"""The one validated configuration of a ddtree Serve application.

`ddtree serve --config FILE`, `serve run` / `serve deploy` (the `args` of the application in a
Serve config YAML) and the Python builder all map onto `ServeConfig`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from ray.serve.config import AutoscalingConfig

from ..config import ModelPairConfig, parse_budget

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ServeConfig(ModelPairConfig):
    """A model pair plus how it is served."""

    model_name: str | None = Field(
        None, description="The id clients pass as `model`; default: the target's name."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="Completion tokens when a request names no max_tokens (capped by the context)."
    )
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests Serve hands one engine replica at once; None = what its "
        "scheduler holds (max_num_seqs running + max_waiting waiting)."
    )
    autoscaling: AutoscalingConfig = Field(
        default_factory=AutoscalingConfig, description="The engine deployment's autoscaling: Ray Serve's own "
        "AutoscalingConfig (min_replicas, max_replicas, target_ongoing_requests, upscale_delay_s, "
        "downscale_delay_s, look_back_period_s, metrics_interval_s, smoothing factors, ...), with Ray's "
        "defaults (1 replica); unknown fields are an error."
    )
    engine_num_cpus: float | None = Field(
        None, ge=0, description="CPUs Ray reserves for each engine replica; the replica's intra-op threads "
        "are as many (unless `threads` is set). None = at tp: 1, every CPU of the largest node Ray knows "
        "(the machine's cores under `ddtree serve`): one replica a node, decoding on all its cores, the "
        "ingress and Serve's proxy reserving none (docs/deployment.md); at tp > 1, 1 (the shards hold the "
        "model and reserve their own bundles). Set it below a node's CPUs for several replicas a node."
    )
    engine_num_gpus: float = Field(
        0.0, ge=0, description="GPUs Ray reserves for each engine replica at tp: 1 (at tp > 1 the "
        "replica's placement group reserves one GPU per shard instead)."
    )

    # Limits: checked before any work; a request past one gets a 4xx in OpenAI's error shape.
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body, in bytes; a larger one gets 413 before "
        "it is read whole."
    )
    max_messages: int = Field(256, ge=1, description="Most messages in one chat request.")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Most prompt tokens; None = what the model's context holds."
    )
    max_output_tokens: int = Field(
        4096, ge=1, description="Largest `max_tokens` a request may ask for (the context caps it too)."
    )
    max_budget: int = Field(
        64, ge=0, description="Largest per-request `speculation.budget`: a verify pass holds budget + 1 "
        "rows (static shapes) and the drafter's top-K per depth, so this bounds a request's memory. "
        "Raise it only with the memory to match."
    )
    stream_interval: int = Field(
        1, ge=1, description="Fewest new tokens a streamed delta carries, but the first and the last: "
        "1 sends each step's tokens as it ends; more sends fewer, larger SSE events (less serving work "
        "a token, coarser streaming), as vLLM's --stream-interval."
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After, in seconds, of a 429 or 503.")
    graceful_shutdown_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, how long in-flight requests may run to completion; new "
        "ones get 503 meanwhile."
    )
    # Security.
    api_key: list[SecretStr] = Field(
        default_factory=list, description="API keys: when any is set, every route but /health needs "
        "`Authorization: Bearer <key>` with one of them (401 otherwise). One key or a list; "
        "`DDTREE_API_KEY` (comma-separated) in the ingress's environment adds keys."
    )

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _ray_autoscaling_fields(cls, v):
        # Ray's model ignores a field it does not know: a misspelt delay would be dropped unseen
        unknown = sorted(set(v) - set(AutoscalingConfig.model_fields)) if isinstance(v, dict) else []
        if unknown:
            raise ValueError(f"autoscaling has no field {', '.join(unknown)}: it takes the fields of Ray Serve's "
                             f"AutoscalingConfig ({', '.join(AutoscalingConfig.model_fields)})")
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _one_or_more_keys(cls, v):
        keys = [v] if isinstance(v, (str, SecretStr)) else list(v or [])
        if any(not (k.get_secret_value() if isinstance(k, SecretStr) else k) for k in keys):
            raise ValueError("an API key is empty; leave api_key unset to serve without keys")
        return keys

    @model_validator(mode="after")
    def _budget_within_cap(self):
        if self.budget != "auto":
            try:
                parse_budget(self.budget, self.max_budget)
            except ValueError as err:
                raise ValueError(f"budget: {err}; raise max_budget or lower budget") from None
        return self

    @property
    def engine_capacity(self) -> int:
        """Requests one engine replica holds: running plus its bounded waiting queue."""
        return self.max_ongoing_requests or self.max_num_seqs + self.max_waiting

    @property
    def max_inflight_requests(self) -> int:
        """Generation requests the ingress admits at once: what the engine replicas hold; the next
        one gets 429 with Retry-After, so no queue grows silently anywhere."""
        return self.engine_capacity * self.autoscaling.max_replicas

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name
