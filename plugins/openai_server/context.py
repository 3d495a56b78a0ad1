"""What every route needs: the engine, the server's settings, and the facts computed once at start-up."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllite.lora import LoRARequest
from vllite.plugins.openai_server.http_errors import ModelNotFoundError
from vllite.plugins.openai_server.lora import LoRAModule, ServedLoRAs
from vllite.plugins.openai_server.tasks import check_generating

logger = logging.getLogger("vllite.server")


@dataclass(frozen=True)
class ServerSettings:
    """The server's flags, as ``vllite serve`` parsed them."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_log_len: int | None = None
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    tool_parser_plugins: tuple[str, ...] = ()  # --tool-parser-plugin files, loaded before the parsers resolve
    log_requests: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()  # --lora-modules, loaded when the server starts
    # The operations routes (/sleep, /pause, ...): $VLLITE_SERVER_DEV_MODE=1 or $VLLM_SERVER_DEV_MODE=1.
    dev_mode: bool = field(default_factory=lambda: server_dev_mode())
    enable_server_load_tracking: bool = False  # /load counts the requests in flight on the model's routes
    # CORS (vLLM's flags and defaults: every origin, method and header; no credentials).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # --root-path: the path prefix a proxy in front of the server strips


#: The environment switches that turn the operations routes on (vLLM's name is accepted too).
DEV_MODE_ENVS = ("VLLITE_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE")


def server_dev_mode() -> bool:
    """Whether ``$VLLITE_SERVER_DEV_MODE`` (or vLLM's ``$VLLM_SERVER_DEV_MODE``) is on (``1`` / ``true``)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in DEV_MODE_ENVS)


class ServerContext:
    """The engine behind the routes and the facts they share: tokenizer, limits, defaults, tool and reasoning
    parsers, metrics.

    ``model_defaults`` are the sampling defaults of the model's generation config; a request field left unset
    takes them (vLLM's ``--generation-config auto``).
    """

    def __init__(self, engine: Any, settings: ServerSettings, *, metrics: Any = None) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.engine_info.max_model_len
        self.max_logprobs = engine.config.model_config.max_logprobs
        self.model_root = engine.config.model_config.model
        self.model_defaults: dict[str, Any] = dict(engine.frontend.default_sampling_fields)
        self.structured_outputs_config = getattr(engine.config, "structured_outputs_config", None)
        self.tool_parser_class = resolve_tool_parser(settings.tool_call_parser)
        self.reasoning_parser_class = resolve_reasoning_parser(settings.reasoning_parser)
        self.loras = ServedLoRAs.for_engine(engine, settings.served_model_names, str(self.model_root))

    @property
    def model_name(self) -> str:
        """The first served name: what responses report."""
        return self.settings.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name a request asks for (its own, or the default when it names none): a base model's or a
        LoRA adapter's; 404 listing the served names for another. A generating route uses :meth:`resolve_model`."""
        if name is None or name in self.settings.served_model_names or name in self.loras:
            return name or self.model_name
        raise ModelNotFoundError(name, (*self.settings.served_model_names, *self.loras.names()))

    async def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """:meth:`check_model` for a generating route: the served name, and the adapter it names (``None``: the
        base model). With runtime LoRA updates on, a name not served yet is offered to the LoRA resolvers first.
        400 naming the model's tasks on a model that does not generate (a pooling model)."""
        check_generating(self.engine)
        if name is not None and name not in self.settings.served_model_names:
            adapter = await self.loras.resolve(name)
            if adapter is not None:
                return name, adapter
        return self.check_model(name), None

    def log_prompt(self, request_id: str, prompt: Any, params: Any) -> None:
        """Logs an accepted request, its prompt cut to ``--max-log-len`` characters (a text) or tokens (token ids);
        ``prompt`` may be one prompt or a list of them (a completion request's), each cut."""
        if not self.settings.log_requests:
            return
        limit = self.settings.max_log_len
        if limit is not None:
            is_list = isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)
            prompt = [p[:limit] for p in prompt] if is_list else prompt[:limit]
        logger.info("Received request %s: prompt: %r, params: %s", request_id, prompt, params)


def resolve_reasoning_parser(name: str | None) -> Any:
    """The registered reasoning parser ``name`` (``None``: none); an unknown name lists the registered ones."""
    if name is None:
        return None
    from vllite.plugins.reasoning.registry import resolve_reasoning_parser as resolve

    return resolve(name)


def resolve_tool_parser(name: str | None) -> type | None:
    """The registered tool parser ``name`` (``None``: none); ``ValueError`` if it cannot extract calls."""
    if name is None:
        return None
    from vllite.plugin_manager import resolve_component

    parser = resolve_component("tool_parsers", name)
    missing = [method for method in ("extract", "stream") if not callable(getattr(parser, method, None))]
    if missing:
        raise ValueError(
            f"--tool-call-parser {name!r} only names tools (it has no {' / '.join(missing)}), so it cannot "
            "return tool calls; the server needs a parser with extract() and stream() (see docs/plugins.md)."
        )
    return parser
