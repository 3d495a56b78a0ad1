"""The FastAPI application: OpenAI's routes in front of one ``AsyncLLM``, plus health, version, tokenizer and
Prometheus routes.

``build_app(ctx)`` wires the routes to a :class:`ServerContext`; the server (``cli``) owns the engine's life.
A request whose client disconnects is cancelled at once, streaming or not, which aborts it in the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllite.exceptions import VlliteError
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import classify, error_response
from vllite.plugins.openai_server.http_common import (
    api_key_check,
    cancel_on_disconnect,
    check_alive,
    data_parallel_rank_header,
    describe_validation_error,
    health_response,
    json_response,
    respond,
)
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from vllite.plugins.openai_server.responses import ModelCard, ModelList
from vllite.version import __version__

JSON = "application/json"
logger = logging.getLogger("vllite.server")


def build_app(ctx: ServerContext) -> FastAPI:
    """The application serving ``ctx.engine``."""
    from fastapi.middleware.cors import CORSMiddleware

    from vllite.plugins.openai_server.ops.load import ServerLoad, ServerLoadMiddleware, load_router

    settings = ctx.settings
    app = FastAPI(
        title="vllite",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        root_path=settings.root_path,
    )
    app.state.ctx = ctx
    _add_error_handlers(app)
    app.include_router(_v1_router(ctx))
    from vllite.plugins.openai_server.anthropic.routes import anthropic_router

    app.include_router(anthropic_router(ctx))  # /v1/messages: Anthropic's key headers and error shape
    from vllite.plugins.openai_server.realtime.session import realtime_router

    app.include_router(realtime_router(ctx))  # /v1/realtime (WebSocket): one session per connection
    app.include_router(_plain_router(ctx))
    from vllite.plugins.openai_server.pooling.routes import pooling_router

    app.include_router(pooling_router(ctx))  # /pooling, /classify, /score, /rerank, /v2/rerank
    from vllite.plugins.openai_server.ops.sagemaker import sagemaker_router

    app.include_router(sagemaker_router(ctx, [api_key_check(ctx)]))  # /ping, /invocations
    app.state.server_load = load = ServerLoad(settings.enable_server_load_tracking)
    app.include_router(load_router(load))  # /load
    from vllite.plugins.openai_server.ops.kv_events import kv_events_router

    app.include_router(kv_events_router(ctx), dependencies=[Depends(api_key_check(ctx))])  # /kv_event_sources
    if settings.dev_mode:
        from vllite.plugins.openai_server.ops.routes import ops_router

        logger.warning("Development routes are on (/sleep, /pause, /collective_rpc, ...): not for production use.")
        app.include_router(ops_router(ctx, [api_key_check(ctx)]))
    app.add_middleware(ServerLoadMiddleware, load=load)
    app.add_middleware(
        CORSMiddleware,  # outermost: preflight requests are answered before the API-key check
        allow_origins=list(settings.allowed_origins),
        allow_methods=list(settings.allowed_methods),
        allow_headers=list(settings.allowed_headers),
        allow_credentials=settings.allow_credentials,
    )
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_validation_error(exc, request.headers.get("content-type"))
        return json_response(error_response(400, message, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return json_response(error_response(exc.status_code, str(exc.detail)), exc.status_code)

    async def expected_error(_: Request, exc: Exception) -> Response:
        status, body = classify(exc)
        return json_response(body, status)

    # Errors a route raises on purpose are answered here, by the app: an ``Exception`` handler alone runs in
    # Starlette's outermost middleware, which re-raises after answering, so uvicorn would log a traceback and drop
    # the keep-alive connection under the client (the openai client sees "Connection reset by peer").
    for expected in (VlliteError, ValueError, TypeError):
        app.add_exception_handler(expected, expected_error)

    @app.exception_handler(Exception)
    async def any_error(_: Request, exc: Exception) -> Response:
        status, body = classify(exc)
        return json_response(body, status)


def _v1_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(ctx))])

    @router.get("/models")
    async def list_models() -> Response:
        cards = [
            ModelCard(id=name, root=str(ctx.model_root), max_model_len=ctx.max_model_len)
            for name in ctx.settings.served_model_names
        ]
        cards += [
            ModelCard(id=name, root=lora.lora_path, max_model_len=ctx.max_model_len, parent=ctx.loras.parent_of(lora))
            for name, lora in ctx.loras.adapters.items()
        ]
        return json_response(ModelList(data=cards))

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        from vllite.plugins.openai_server.completions import create_completion

        check_alive(ctx)
        rank = data_parallel_rank_header(request)
        return respond(await cancel_on_disconnect(request, create_completion(ctx, body, data_parallel_rank=rank)))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        from vllite.plugins.openai_server.chat import create_chat_completion

        check_alive(ctx)
        rank = data_parallel_rank_header(request)
        chat = create_chat_completion(ctx, body, data_parallel_rank=rank)
        return respond(await cancel_on_disconnect(request, chat))

    from vllite.plugins.openai_server.responses_api.routes import add_responses_routes

    add_responses_routes(router, ctx)  # /v1/responses: create, retrieve, delete, cancel
    from vllite.plugins.openai_server.pooling.routes import add_v1_pooling_routes

    add_v1_pooling_routes(router, ctx)  # /v1/embeddings, /v1/score, /v1/rerank
    if ctx.loras.runtime_updating:
        _add_lora_routes(router, ctx)
    return router


def _add_lora_routes(router: APIRouter, ctx: ServerContext) -> None:
    """vLLM's runtime adapter routes (only with ``VLLITE_ALLOW_RUNTIME_LORA_UPDATING=1``)."""

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        check_alive(ctx)
        await ctx.loras.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        from vllite.plugins.openai_server.http_errors import LoRANotFoundError

        check_alive(ctx)
        try:
            await ctx.loras.unload(body.lora_name)
        except LoRANotFoundError as exc:
            return json_response(error_response(404, str(exc), "lora_name"), 404)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _plain_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return health_response(ctx)

    @router.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @router.get("/metrics")
    async def metrics() -> Response:
        if ctx.metrics is None:
            return json_response(error_response(404, "Metrics are off (--disable-log-stats)."), 404)
        await refresh_engine_gauges(ctx)
        body, content_type = ctx.metrics.render()
        return Response(content=body, media_type=content_type)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        token_ids = _tokenize(ctx, body)
        result: dict[str, Any] = {"count": len(token_ids), "max_model_len": ctx.max_model_len, "tokens": token_ids}
        if body.return_token_strs:
            result["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(token_ids)
        return json_response(result)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        _need_tokenizer(ctx)
        vocab = ctx.engine.engine_info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"Token ids out of vocabulary [0, {vocab}): {bad[:5]}.", param="tokens")
        return json_response({"prompt": ctx.tokenizer.decode(body.tokens)})

    return router


def _need_tokenizer(ctx: ServerContext) -> None:
    if ctx.tokenizer is None:
        raise BadRequestError("This server was started without a tokenizer (--skip-tokenizer-init).")


def _tokenize(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    _need_tokenizer(ctx)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequestError("Give exactly one of 'prompt' and 'messages'.", param="prompt")
    if body.prompt is not None:
        return [int(t) for t in ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)]
    from vllite.plugins.openai_server.chat_template import render_messages

    assert body.messages is not None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    return render_messages(
        ctx,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=tools,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
    )


async def refresh_engine_gauges(ctx: ServerContext) -> None:
    """Sets the running / waiting / KV-usage gauges from the engine now (the step stats go stale once it idles)."""
    from vllite.protocol import SchedulerStats

    if ctx.engine.errored:
        return
    try:
        running, waiting = await ctx.engine.call_utility("get_request_counts")
        usage = await ctx.engine.call_utility("get_kv_cache_usage")
    except Exception:  # a dying engine: the gauges keep their last values
        return
    stats = SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage)
    ctx.metrics.record(stats, None)
    if ctx.loras.enabled:
        ctx.metrics.record_lora_states(ctx.loras.max_loras, *ctx.loras.request_states())
