"""Which tasks the served model answers (generating or pooling), and the 400 a route gives a model that does not
answer it. Read by the server context (every generating route) and the pooling routes."""

from __future__ import annotations

from typing import Any

from vllite.plugins.openai_server.http_errors import BadRequestError

#: The routes a pooling model answers, for the message a generating route gives it.
POOLING_ROUTES = "/v1/embeddings, /pooling, /classify, /score, /rerank"
#: The routes a generating model answers, for the message a pooling route gives it.
GENERATING_ROUTES = "/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages"


def supported_tasks(engine: Any) -> tuple[str, ...]:
    """The tasks the engine's model serves (``("generate",)`` for a generating model)."""
    tasks = getattr(engine.engine_info, "supported_tasks", None)
    return tuple(tasks) if tasks else ("generate",)


def check_generating(engine: Any) -> None:
    """400 for a generating route on a model that does not generate (a pooling model), naming its tasks."""
    tasks = supported_tasks(engine)
    if "generate" not in tasks:
        raise BadRequestError(
            f"This model does not generate text: its tasks are {', '.join(tasks)}. "
            f"Use the pooling routes ({POOLING_ROUTES}).",
            param="model",
        )
