"""The pooling routes' inputs, checked before anything reaches the engine: which task the model serves, the inputs
as token ids (tokenized and truncated here, once), and each one's length and token ids against the model's limits.

Every failure is a :class:`~.http_errors.BadRequestError` (HTTP 400) naming the request field, raised before
the first input is submitted, so a bad request fails alone and leaves nothing running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.tasks import GENERATING_ROUTES, supported_tasks

if TYPE_CHECKING:
    from vllite.plugins.openai_server.context import ServerContext


def require_task(ctx: ServerContext, route: str, *wanted: str) -> str:
    """The first of ``wanted`` the model serves; 400 naming the route, the tasks it needs and the model's."""
    tasks = supported_tasks(ctx.engine)
    for task in wanted:
        if task in tasks:
            return task
    hint = f" Use {GENERATING_ROUTES}." if "generate" in tasks else ""
    raise BadRequestError(
        f"{route} needs a model serving the task {' or '.join(map(repr, wanted))}, and this model's tasks are "
        f"{', '.join(tasks)}.{hint}",
        param="model",
    )


def default_pooling_task(ctx: ServerContext, route: str) -> str:
    """The model's first pooling task (what ``/pooling`` runs when the request names none)."""
    pooling = [task for task in supported_tasks(ctx.engine) if task != "generate"]
    if not pooling:
        require_task(ctx, route, "embed", "classify", "token_embed", "token_classify")
    return pooling[0]


def input_list(value: Any, param: str = "input") -> list[str | list[int]]:
    """OpenAI's ``input`` as a list: one text, several texts, one token id list or several; 400 when empty."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequestError(f"{param} must not be an empty list.", param=param)
    if all(isinstance(item, int) for item in value):
        return [list(value)]
    return list(value)


def truncation_length(ctx: ServerContext, truncate_prompt_tokens: int | None) -> int | None:
    """The token count ``truncate_prompt_tokens`` keeps (``-1``: the context length); 400 for 0 or a count over
    the context length."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return int(ctx.max_model_len)
    if truncate_prompt_tokens < 1 or truncate_prompt_tokens > ctx.max_model_len:
        raise BadRequestError(
            f"truncate_prompt_tokens must be -1 (the context length) or between 1 and the model's context length "
            f"{ctx.max_model_len}, got {truncate_prompt_tokens}.",
            param="truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def need_tokenizer(ctx: ServerContext, param: str) -> Any:
    """The server's tokenizer; 400 on ``param`` when the server runs without one (text needs it)."""
    if ctx.tokenizer is None:
        raise BadRequestError(
            "Text inputs need a tokenizer, and this server has none (--skip-tokenizer-init): send token ids.",
            param=param,
        )
    return ctx.tokenizer


def tokenize_inputs(
    ctx: ServerContext,
    inputs: Sequence[str | list[int]],
    *,
    truncate_prompt_tokens: int | None,
    add_special_tokens: bool = True,
    param: str = "input",
    names: Sequence[str] | None = None,
) -> list[list[int]]:
    """Each input as checked token ids, as the engine would make them: texts tokenized, then (as every input)
    cut to their last ``truncate_prompt_tokens`` tokens; 400 for an empty input, a token id outside the
    vocabulary, or an input over the context length (``names[i]``: how the message names input ``i``; default
    ``input[i]``, or ``input`` alone)."""
    keep = truncation_length(ctx, truncate_prompt_tokens)
    token_lists: list[list[int]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            tokenizer = need_tokenizer(ctx, param)
            ids = [int(t) for t in tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"]]
        else:
            ids = [int(t) for t in item]
        if keep is not None:
            ids = ids[-keep:]
        where = names[index] if names is not None else f"{param}[{index}]" if len(inputs) > 1 else param
        check_token_ids(ctx, ids, where, param)
        token_lists.append(ids)
    return token_lists


def check_token_ids(ctx: ServerContext, ids: Sequence[int], where: str, param: str) -> None:
    """400 for an empty input, token ids outside the vocabulary, or more tokens than the context length."""
    if not ids:
        raise BadRequestError(f"{where} is empty: it has no tokens.", param=param)
    vocab = ctx.engine.engine_info.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"{where} has token ids out of the vocabulary [0, {vocab}): {bad[:5]}.", param=param)
    if len(ids) > ctx.max_model_len:
        raise BadRequestError(
            f"{where} has {len(ids)} tokens, more than the model's maximum context length of {ctx.max_model_len} "
            "tokens. Shorten it, or set truncate_prompt_tokens (-1: cut to the context length).",
            param=param,
        )


def check_dimensions(ctx: ServerContext, dimensions: int | None) -> None:
    """400 for a ``dimensions`` the model cannot return (the engine's rule: a Matryoshka model's sizes, else only
    its embedding width)."""
    if dimensions is None:
        return
    from vllite.engine.pooling import check_dimensions as engine_check

    try:
        if dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {dimensions}.")
        engine_check(ctx.engine.config.model_config.hf_text_config, dimensions)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="dimensions") from None
