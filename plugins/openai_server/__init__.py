"""The OpenAI-compatible HTTP server (``vllite serve``): FastAPI + uvicorn in front of one ``AsyncLLM``.

Modules: the command (``plugin`` registers ``serve``; ``cli``: flags, start-up, graceful shutdown; ``serving``);
the application (``app`` assembles the routers, ``http_common`` holds what they share, ``context``, ``errors``
and ``http_errors``, ``event_stream``); the generation API (``protocol``, ``responses``, ``sampling``, ``streams``,
``completions``, ``chat``, ``chat_template``, ``tool_choice``, ``reasoning``, ``logprobs``, ...); and one subpackage
per API family: ``responses_api``, ``anthropic``, ``realtime``, ``pooling``, ``ops`` (operations routes) and
``observability`` (metrics, tracing). ``vllite bench serve`` lives in ``vllite.plugins.bench``.
"""

from vllite import deprecated_aliases

# Modules that moved into this package's subpackages (or to vllite.plugins.bench) keep their old names for one
# release (DeprecationWarning).
for _new, _pairs in {
    "vllite.plugins.bench": "bench:serve bench_client:serve_client bench_config:serve_config "
    "bench_metrics:serve_metrics bench_requests:serve_requests",
    f"{__name__}.anthropic": "anthropic_messages:messages anthropic_protocol:protocol anthropic_routes:routes "
    "anthropic_stream:stream",
    f"{__name__}.responses_api": "responses_api_input:input responses_api_protocol:protocol "
    "responses_api_stream:stream response_store:store",
    f"{__name__}.realtime": "realtime_protocol:protocol realtime_sampling:sampling realtime_turns:turns",
    f"{__name__}.pooling": "pooling_prompts:prompts pooling_protocol:protocol pooling_routes:routes "
    "pooling_serving:serving",
    f"{__name__}.ops": "ops_routes:routes server_load:load server_info:info kv_events_route:kv_events "
    "sagemaker:sagemaker",
    f"{__name__}.observability": "metrics:metrics metric_specs:metric_specs tracing:tracing",
}.items():
    deprecated_aliases.register_moves(__name__, _new, _pairs)
