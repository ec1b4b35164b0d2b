"""The builder: one validated ServeConfig -> the ddtree Serve application.

    serve run ddtree.serve.app:build_app budget=16          # or a config YAML under cluster/
"""

from __future__ import annotations

import logging

from ray import serve
from ray.serve import Application

from .config import ServeConfig
from .engine_server import EngineServer
from .openai_api import OpenAIIngress

logger = logging.getLogger("ray.serve")


def build_app(args: dict | ServeConfig | None = None) -> Application:
    """Serve's application builder. `args` are ServeConfig fields (from a config YAML's `args`,
    `serve run ... key=value`, or Python)."""
    config = args if isinstance(args, ServeConfig) else ServeConfig.model_validate(args or {})
    scaling = config.autoscaling
    engine_options = {
        "name": "DDTreeEngine",
        "max_ongoing_requests": config.max_ongoing_requests,
        "autoscaling_config": {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
        },
        "ray_actor_options": {
            "num_cpus": config.engine_num_cpus,
            "num_gpus": config.engine_num_gpus if config.tp == 1 else 0,
        },
        # the first replica loads (and maybe de-quantizes) the model: give it time
        "health_check_timeout_s": 120,
    }
    ingress_options = {"name": "OpenAIIngress", "ray_actor_options": {"num_cpus": 0}}
    logger.info("ddtree app: %s; engine %s; ingress %s", config.model_dump(), engine_options, ingress_options)
    engine = serve.deployment(EngineServer).options(**engine_options).bind(config.model_dump())
    return OpenAIIngress.options(**ingress_options).bind(config.model_dump(), engine)
