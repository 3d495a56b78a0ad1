"""``vllite serve [MODEL]``: the flags, and the command that checks them, binds the socket and runs the server.

Start-up checks every server flag before the engine starts, binds the socket (a port in use is one clear error),
starts one ``AsyncLLM`` and serves it (``serving``) until SIGINT / SIGTERM; ``--api-server-count`` starts more API
server processes (``api_servers``).
"""

from __future__ import annotations

import argparse
import os
import ssl
from typing import Any

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.serving import (
    API_KEY_ENV,
    PROFILER_DIR_ENV,
    bind_socket,
    demo_model_defaults,
    run_event_loop,
    serve,
    server_settings,
    start_engine,
)

__all__ = ["add_serve_arguments", "bind_socket", "demo_model_defaults", "run_server", "server_settings"]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``vllite serve``'s flags: vLLM's names, then every engine flag ``vllite generate`` takes."""
    from vllite.engine_args import EngineArgs
    from vllite.plugins.commands.engine_flags import add_vllm_only_flags

    parser.add_argument("model_tag", nargs="?", default=None, help="Model folder or Hub id (default: the demo model).")
    server = parser.add_argument_group("server")
    add = server.add_argument
    add("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1; 0.0.0.0 for every interface).")
    add("--port", type=int, default=8000, help="Port (default 8000; 0 picks a free one and prints it).")
    add(
        "--api-key",
        default=None,
        help=f"Require 'Authorization: Bearer KEY' on every route but the health probes (also ${API_KEY_ENV}).",
    )
    add("--served-model-name", nargs="+", default=None, help="Names the API answers to (default: the model as given).")
    add("--chat-template", default=None, help="A Jinja chat template, or a file holding one, over the tokenizer's.")
    add(
        "--trust-request-chat-template",
        action="store_true",
        help="Let requests bring their own chat_template (off: such requests get 400).",
    )
    _add_parser_arguments(add)
    add("--enable-log-requests", action="store_true", help="Log every request's prompt and parameters.")
    add(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters to serve (needs --enable-lora): NAME=PATH or JSON {"name", "path", "base_model_name"}.',
    )
    add("--max-log-len", type=int, default=None, help="Characters or tokens of a prompt to log (default: all).")
    add("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    add("--disable-uvicorn-access-log", action="store_true", help="Do not log one line per HTTP request.")
    add(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="Seconds requests in flight may run after SIGINT/SIGTERM before they are aborted (default 10).",
    )
    add(
        "--metrics-prefix",
        default="vllite",
        choices=["vllite", "vllm"],
        help="Prefix of the /metrics names: vllite (default) or vllm (vLLM's names, for dashboards built for vLLM).",
    )
    add(
        "--api-server-count",
        "-asc",
        type=int,
        default=None,
        help="API-server processes sharing one engine process and the port (default 1); see docs/serving.md.",
    )
    add(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="Send one OpenTelemetry span per request to this OTLP collector (e.g. http://host:4318/v1/traces).",
    )
    add_http_arguments(server)
    EngineArgs.add_cli_args(parser)
    add_vllm_only_flags(parser)
    parser.set_defaults(disable_log_stats=False)  # a server reports metrics unless told not to


def _add_parser_arguments(add: Any) -> None:
    """The tool-call and reasoning parser flags (vLLM's names)."""
    add(
        "--tool-call-parser",
        default=None,
        help="Tool-call parser for tool_choice auto (vLLM's names: hermes, qwen3_coder, mistral, llama3_json, ...).",
    )
    add(
        "--tool-parser-plugin",
        action="append",
        default=None,
        metavar="FILE",
        help="A Python file whose vllite hooks register tool (or reasoning) parsers; may be repeated.",
    )
    add(
        "--reasoning-parser",
        default=None,
        help="Split replies into reasoning_content and content (vLLM's names: deepseek_r1, qwen3, granite, ...).",
    )
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Accepted for vLLM compatibility; --tool-call-parser alone enables tool_choice='auto'.",
    )


def add_http_arguments(group: Any) -> None:
    """vLLM's HTTP flags: CORS, TLS, the root path, load tracking and the profiler directory."""
    add = group.add_argument
    add(
        "--allowed-origins", default=None, help='CORS: allowed origins, a JSON list or comma-separated (default ["*"]).'
    )
    add(
        "--allowed-methods", default=None, help='CORS: allowed methods, a JSON list or comma-separated (default ["*"]).'
    )
    add(
        "--allowed-headers", default=None, help='CORS: allowed headers, a JSON list or comma-separated (default ["*"]).'
    )
    add("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, authorization headers).")
    add(
        "--ssl-keyfile",
        default=None,
        help="TLS: the server's private key file (PEM); serves https with --ssl-certfile.",
    )
    add("--ssl-certfile", default=None, help="TLS: the server's certificate chain file (PEM).")
    add("--ssl-ca-certs", default=None, help="TLS: CA certificates that client certificates are checked against.")
    add(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        help="TLS: whether a client certificate is required (Python's ssl.CERT_*: 0 none, 1 optional, 2 required).",
    )
    add("--root-path", default=None, help="The path prefix a proxy in front of the server routes under (FastAPI's).")
    add(
        "--enable-server-load-tracking",
        action="store_true",
        help="Count the requests in flight on the model's routes; GET /load reports it.",
    )
    add(
        "--profiler-dir",
        default=None,
        help=f"Where /start_profile's torch.profiler traces go (dev mode; also ${PROFILER_DIR_ENV}).",
    )


def run_server(args: argparse.Namespace) -> int:
    """Runs ``vllite serve`` until a signal stops it; returns the exit code."""
    from vllite.assets import default_model_path
    from vllite.engine_args import EngineArgs
    from vllite.plugins.commands.engine_flags import check_engine_args
    from vllite.plugins.openai_server.api_servers import ApiServers, resolve_api_server_count
    from vllite.plugins.openai_server.app import build_app
    from vllite.plugins.openai_server.parser_plugins import share_tool_parser

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"Two models given: {args.model_tag!r} and --model {args.model!r}; give one.")
    if args.model_tag:
        args.model = args.model_tag
    model_path = str(args.model or default_model_path())
    settings = server_settings(args, model_path if args.model else "vllite-demo")
    engine_args = EngineArgs.from_cli_args(args)
    share_tool_parser(engine_args, settings.tool_call_parser)  # Continuum names tools with the server's parser
    check_engine_args(engine_args)  # a mistake that needs no model fails in a second, before the engine starts
    count = resolve_api_server_count(args, engine_args)
    if args.profiler_dir:  # read by the engine process (it inherits this environment) when a trace starts
        os.environ[PROFILER_DIR_ENV] = os.path.abspath(os.path.expanduser(args.profiler_dir))
    sock = bind_socket(args.host, args.port)
    servers = ApiServers(count, args, sock, build_app)  # --api-server-count: this process is API server 0 of `count`
    try:
        engine, metrics = start_engine(engine_args, settings, args)
        try:
            servers.start(engine)
            ctx = ServerContext(engine, settings, metrics=metrics)
            run_event_loop(serve(build_app, ctx, sock, args, servers))
        finally:
            servers.stop()
            engine.shutdown()
    finally:
        sock.close()
        servers.cleanup()
    return 0
