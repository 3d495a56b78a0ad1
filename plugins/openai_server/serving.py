"""Running ``vllite serve``: the server's settings from its flags, the socket, the engine client, and uvicorn until
a signal, with a graceful shutdown.

The server stops accepting connections at SIGINT / SIGTERM, lets the requests in flight run for
``--shutdown-timeout`` seconds, aborts those still running (each stream ends with ``finish_reason="abort"`` and
``[DONE]``) and stops the engine. A second signal exits at once. ``cli.run_server`` and each extra API server
(``api_servers``) run a server through these functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

from vllite.plugins.openai_server.context import ServerContext, ServerSettings

API_KEY_ENV = "VLLITE_API_KEY"
PROFILER_DIR_ENV = "VLLITE_TORCH_PROFILER_DIR"


def _header_list(flag: str, value: str | None) -> tuple[str, ...]:
    """A CORS flag's value: a JSON list of strings (vLLM's form) or comma-separated; ``None``: ``("*",)``."""
    if value is None:
        return ("*",)
    text = value.strip()
    if text.startswith(("[", "{", '"')):  # JSON (vLLM takes a JSON list)
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not a valid JSON list: {exc}.") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ValueError(f"{flag} must be a JSON list of strings, got {value!r}.")
    else:
        items = [item.strip() for item in text.split(",") if item.strip()]
    return tuple(items)


def _check_tls(args: argparse.Namespace) -> None:
    """The TLS flags: key and certificate go together, every file exists, ``--ssl-cert-reqs`` is 0, 1 or 2."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve https.")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')}: no such file {path!r}.")
    if args.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {args.ssl_cert_reqs}.")
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 checks client certificates: give --ssl-ca-certs too.")


def _root_path(value: str | None) -> str:
    if not value:
        return ""
    if not value.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {value!r}.")
    return value.rstrip("/")


def server_settings(args: argparse.Namespace, model_path: str) -> ServerSettings:
    """The server's settings, checked before any engine starts; ``ValueError`` names the bad flag."""
    from vllite.engine.tokenizer import load_chat_template

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME.")
    plugins = tuple(args.tool_parser_plugin or ())
    if plugins:
        from vllite.plugins.openai_server.parser_plugins import load_parser_plugin

        for path in plugins:
            load_parser_plugin(path)  # a file that fails to import stops here, naming it
    if args.tool_call_parser:
        from vllite.plugins.openai_server.context import resolve_tool_parser

        resolve_tool_parser(args.tool_call_parser)  # an unknown or name-only parser fails here, before the engine
    if args.reasoning_parser:
        from vllite.plugins.openai_server.context import resolve_reasoning_parser

        resolve_reasoning_parser(args.reasoning_parser)  # an unknown name fails here, listing the known ones
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}.")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}.")
    _check_tls(args)
    names = tuple(args.served_model_name or [model_path])
    from vllite.plugins.openai_server.lora import parse_lora_modules

    lora_modules = parse_lora_modules(args.lora_modules, enable_lora=args.enable_lora, served_model_names=names)
    return ServerSettings(
        served_model_names=names,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_log_len=args.max_log_len,
        chat_template=load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=bool(args.tool_call_parser),
        reasoning_parser=args.reasoning_parser,
        tool_parser_plugins=plugins,
        log_requests=args.enable_log_requests,
        lora_modules=lora_modules,
        enable_server_load_tracking=args.enable_server_load_tracking,
        allowed_origins=_header_list("--allowed-origins", args.allowed_origins),
        allowed_methods=_header_list("--allowed-methods", args.allowed_methods),
        allowed_headers=_header_list("--allowed-headers", args.allowed_headers),
        allow_credentials=args.allow_credentials,
        root_path=_root_path(args.root_path),
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ``ValueError`` saying so when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def demo_model_defaults(engine_args: Any) -> None:
    """Serving the demo model, structured outputs default to ``disable_any_whitespace``: a model that small, free to
    put whitespace between JSON tokens, pads a ``response_format`` reply with it until ``max_tokens``. A
    ``--structured-outputs-config`` that sets ``disable_any_whitespace`` wins; other models keep vLLM's default."""
    from pathlib import Path

    from vllite.assets import default_model_path

    demo = Path(default_model_path()).resolve()
    if engine_args.model is not None and Path(engine_args.model).resolve() != demo:
        return
    config = engine_args.structured_outputs_config
    if config is None:
        engine_args.structured_outputs_config = {"disable_any_whitespace": True}
    elif isinstance(config, dict) and "disable_any_whitespace" not in config:
        engine_args.structured_outputs_config = {**config, "disable_any_whitespace": True}


def start_engine(
    engine_args: Any, settings: ServerSettings, args: argparse.Namespace, config: Any = None
) -> tuple[Any, Any]:
    """The engine, and its Prometheus logger (``None`` with ``--disable-log-stats``); with
    ``--otlp-traces-endpoint``, a request tracer among its stat loggers (stats are then collected even with
    ``--disable-log-stats``, as tracing needs them). ``config``: an engine config made already (an API server
    joining the engine of API server 0) instead of one from ``engine_args``."""
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    def make(**kwargs: Any) -> AsyncLLM:
        if config is not None:
            return AsyncLLM(config=config, **kwargs)
        return AsyncLLM.from_engine_args(engine_args, **kwargs)

    demo_model_defaults(engine_args)
    name = settings.served_model_names[0]
    loggers: list[Any] = []
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    if endpoint:
        from vllite.plugins.openai_server.observability.tracing import RequestTracer, make_tracer_provider

        loggers.append(RequestTracer(make_tracer_provider(endpoint), model_name=name))
    if engine_args.disable_log_stats and not loggers:
        return make(), None
    metrics_index = None
    if not engine_args.disable_log_stats:
        from vllite.plugins.openai_server.observability.metrics import PrometheusStatLogger

        prefix, cache_config = getattr(args, "metrics_prefix", "vllite"), _cache_config_info(engine_args)
        metrics_index = len(loggers)
        loggers.append(lambda info: PrometheusStatLogger(name, info, prefix=prefix, cache_config=cache_config))
    engine_args.disable_log_stats = False
    engine = make(stat_loggers=loggers)
    return engine, engine.stat_loggers[metrics_index] if metrics_index is not None else None


def _cache_config_info(engine_args: Any) -> dict[str, Any]:
    """The cache settings ``cache_config_info`` shows (vLLM's field names; the block count is the engine's)."""
    return {
        "block_size": engine_args.block_size,
        "cache_dtype": getattr(engine_args, "kv_cache_dtype", "auto"),
        "enable_prefix_caching": engine_args.enable_prefix_caching,
        "gpu_memory_utilization": engine_args.gpu_memory_utilization or 0.9,
        "num_gpu_blocks_override": engine_args.num_gpu_blocks_override,
        "prefix_caching_hash_algo": engine_args.prefix_caching_hash_algo,
    }


def run_event_loop(main: Any) -> None:
    """Runs ``main`` on uvloop where it is installed (a faster loop and socket transport), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def serve(
    build_app: Callable[[ServerContext], Any],
    ctx: ServerContext,
    sock: socket.socket,
    args: argparse.Namespace,
    role: Any = None,
) -> None:
    """Serves the app ``build_app(ctx)`` on ``sock``; ``role`` (``api_servers.py``): this process's part among several
    API servers. The command (``cli``) passes ``app.build_app``: this module sits below the app."""
    import uvicorn

    app: Any = build_app(ctx)
    if role is not None:
        app = role.wrap(app)
    if getattr(args, "otlp_traces_endpoint", None):
        from vllite.plugins.openai_server.observability.tracing import TraceContextMiddleware

        app = TraceContextMiddleware(app)  # the client's traceparent becomes the parent of the request's span
    _log_to_stderr(args.uvicorn_log_level)
    await ctx.loras.load_static(ctx.settings.lora_modules)  # a bad adapter stops the start-up, naming it
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        lifespan="off",
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
        timeout_keep_alive=5,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    server = _graceful_server(config, ctx, args.shutdown_timeout)
    if role is not None:
        role.started(server)
        if not role.banner:
            await server.serve(sockets=[sock])
            return
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if args.ssl_certfile else "http"
    print(
        f"vllite: serving {ctx.model_name!r} on {scheme}://{shown}:{port} (OpenAI API under /v1; Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    await server.serve(sockets=[sock])


def _graceful_server(config: Any, ctx: ServerContext, grace_s: float) -> Any:
    """uvicorn's server, plus: on the first signal, abort the requests still running after ``grace_s``."""
    import uvicorn

    loop = asyncio.get_running_loop()

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals once it has stopped, which would kill this process before the
            # engine is shut down; the shutdown is handled here, so the process exits normally instead.
            self._captured_signals.clear()
            if first:
                loop.call_soon_threadsafe(loop.call_later, grace_s, _abort_all, ctx)

    return GracefulServer(config)


def _abort_all(ctx: ServerContext) -> None:
    """Aborts every request in flight: their streams end with ``finish_reason="abort"``."""
    request_ids = list(ctx.engine.output_processor.external_req_ids)
    if request_ids:
        _pending.add(task := asyncio.ensure_future(ctx.engine.abort(request_ids)))
        task.add_done_callback(_pending.discard)


_pending: set[asyncio.Future] = set()  # keeps the abort task alive until it has run


def _log_to_stderr(level: str) -> None:
    """The server's own log lines (accepted and aborted requests) go to stderr at uvicorn's level."""
    import logging

    server_logger = logging.getLogger("vllite.server")
    if not server_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [vllite.server] %(message)s"))
        server_logger.addHandler(handler)
        server_logger.propagate = False
    server_logger.setLevel(logging.getLevelName(level.upper()) if level != "trace" else logging.DEBUG)
