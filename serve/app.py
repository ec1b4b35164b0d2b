"""The builder: one validated ServeConfig -> the ddtree Serve application.

    serve run ddtree.serve.app:build_app budget=16          # or a config YAML under cluster/
"""

from __future__ import annotations

import logging
import os

import ray
from ray import serve
from ray.serve import Application

from .config import ServeConfig
from .engine_server import EngineServer
from .openai_api import OpenAIIngress

logger = logging.getLogger("ray.serve")

# Room at the ingress beyond the generation requests it admits: /health, /v1/models and the
# 429s themselves must reach it while it is full, or Serve would queue them silently.
INGRESS_HEADROOM = 32


def engine_cpus(config: ServeConfig) -> float:
    """The CPUs Ray reserves for each engine replica, which are also its intra-op threads
    (ddtree.engine.engine_threads): `engine_num_cpus` when set; else, at tp: 1, every CPU of the
    largest node Ray knows (where Ray is not started yet, as under `serve run`'s import, the cores
    this process may run on), so one replica decodes on a whole node's cores, as the engine does
    in process; at tp > 1, 1 (the replica only schedules; its shards reserve their own bundles).

    The ingress replica and Serve's HTTP proxy reserve no CPU: their work is one SSE event per
    stream per step, done between and beside the engine's steps."""
    if config.engine_num_cpus is not None:
        return config.engine_num_cpus
    if config.tp > 1:
        return 1.0
    if ray.is_initialized():
        nodes = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]]
        if nodes and max(nodes) >= 1:
            return float(int(max(nodes)))
    return float(len(os.sched_getaffinity(0)))


def build_app(args: dict | ServeConfig | None = None) -> Application:
    """Serve's application builder. `args` are ServeConfig fields (from a config YAML's `args`,
    `serve run ... key=value`, or Python)."""
    config = args if isinstance(args, ServeConfig) else ServeConfig.model_validate(args or {})
    engine_options = {
        "name": "DDTreeEngine",
        "max_ongoing_requests": config.engine_capacity,
        "autoscaling_config": config.autoscaling.model_dump(exclude_unset=True),
        "ray_actor_options": {
            "num_cpus": engine_cpus(config),
            "num_gpus": config.engine_num_gpus if config.tp == 1 else 0,
        },
        # the first replica loads (and maybe de-quantizes) the model: give it time
        "health_check_timeout_s": 120,
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
    }
    # The ingress admits what the engine replicas hold (429 past that, in OpenAI's shape); Serve's
    # own limits on the ingress sit above it, so they only catch what the ingress cannot answer in
    # time, and then loudly (429 + Retry-After) instead of in an unbounded silent queue.
    ingress_options = {
        "name": "OpenAIIngress",
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": config.max_inflight_requests + INGRESS_HEADROOM,
        # the proxy's router holds a burst here while it assigns it to the ingress: room for a
        # whole admission's worth arriving at once (64 streams in one burst overflowed 32)
        "max_queued_requests": config.max_inflight_requests + INGRESS_HEADROOM,
        "backpressure_config": {"status_code": 429, "retry_after_s": config.retry_after_s},
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
    }
    logger.info("ddtree app: %s; engine %s; ingress %s", config.model_dump(), engine_options, ingress_options)
    engine = serve.deployment(EngineServer).options(**engine_options).bind(config.model_dump(), replica=True)
    return OpenAIIngress.options(**ingress_options).bind(config.model_dump(), engine)
