"""Registers ``vllite serve``, ``vllite run-batch``, ``vllite disagg-proxy`` and the ``filesystem`` LoRA resolver.
Only this module loads at start-up; FastAPI, uvicorn and the engine are imported when a command runs."""

from __future__ import annotations

from typing import Any

from vllite.hookspecs import Register, hookimpl


class _LazyServeCommand:
    """The ``serve`` registry entry: the real command lives in ``vllite.plugins.openai_server.cli``."""

    help = "Serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn)."

    def add_arguments(self, parser: Any) -> None:
        from vllite.plugins.openai_server.cli import add_serve_arguments

        add_serve_arguments(parser)

    def run(self, args: Any) -> int:
        from vllite.plugins.openai_server.cli import run_server

        return run_server(args)


class _LazyProxyCommand:
    """The ``disagg-proxy`` registry entry: the command lives in ``vllite.plugins.openai_server.disagg_proxy``."""

    help = "Prefill/decode disaggregation: a proxy in front of kv_producer and kv_consumer servers."

    def add_arguments(self, parser: Any) -> None:
        from vllite.plugins.openai_server.disagg_proxy import add_proxy_arguments

        add_proxy_arguments(parser)

    def run(self, args: Any) -> int:
        from vllite.plugins.openai_server.disagg_proxy import run_proxy

        return run_proxy(args)


class _LazyRunBatchCommand:
    """The ``run-batch`` registry entry: the command lives in ``vllite.plugins.openai_server.run_batch``."""

    help = "Run a batch file in OpenAI's batch format (chat, completions, embeddings) offline, like vllm run-batch."

    def add_arguments(self, parser: Any) -> None:
        from vllite.plugins.openai_server.run_batch import add_run_batch_arguments

        add_run_batch_arguments(parser)

    def run(self, args: Any) -> int:
        from vllite.plugins.openai_server.run_batch import run_batch_command

        return run_batch_command(args)


@hookimpl
def vllite_register_commands(register: Register) -> None:
    """Registers ``serve``, ``run-batch`` and ``disagg-proxy``."""
    register("serve", _LazyServeCommand())
    register("run-batch", _LazyRunBatchCommand())
    register("disagg-proxy", _LazyProxyCommand())


@hookimpl
def vllite_register_lora_resolvers(register: Register) -> None:
    """Registers the ``filesystem`` LoRA resolver (``$VLLITE_LORA_RESOLVER_CACHE_DIR/NAME``), imported when used."""
    register("filesystem", "vllite.plugins.openai_server.lora:FilesystemResolver")
