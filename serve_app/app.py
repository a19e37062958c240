"""The application: build_app(args) wires ServeConfig -> engine deployment -> ingress deployment.

`serve run serve_app/config.yaml` calls it with the file's `args:`; `serve run serve_app:app` with defaults.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_app.config import ServeConfig
from serve_app.ingress import OpenAIIngress, fastapi_app
from serve_app.server import EngineServer


def engine_deployment_options(config: ServeConfig) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        name="KVEngine",
        ray_actor_options={"num_cpus": config.engine_num_cpus, "num_gpus": config.engine_num_gpus},
        max_ongoing_requests=config.max_ongoing_requests,
        # The router holds a request in its caller when no replica has room; at most this many per
        # caller, past which Ray refuses it and the ingress answers 503 + Retry-After.
        max_queued_requests=config.max_waiting_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        health_check_period_s=10,
        request_router_config=RequestRouterConfig(request_router_class="serve_app.router:KVAwareRouter",
                                                  request_routing_stats_period_s=1.0),
    )
    if config.num_replicas is not None:
        options["num_replicas"] = config.num_replicas
    else:
        from serve_app.autoscaling import autoscaling_config

        options["autoscaling_config"] = autoscaling_config(config)
    return options


def build_app(args: dict[str, Any] | ServeConfig | None = None) -> serve.Application:
    config = args if isinstance(args, ServeConfig) else ServeConfig(**(args or {}))
    engine = serve.deployment(EngineServer, **engine_deployment_options(config)).bind(config.model_dump())
    ingress_cls = serve.ingress(fastapi_app)(OpenAIIngress)
    ingress = serve.deployment(ingress_cls, name="OpenAIIngress",
                               ray_actor_options={"num_cpus": config.ingress_num_cpus},
                               max_ongoing_requests=config.max_ongoing_requests * 4)
    return ingress.bind(engine, config.model_dump())
