"""``vllite run-batch -i INPUT -o OUTPUT --model M``: OpenAI's batch file format, run offline (as ``vllm run-batch``).

Each input line is one request, ``{"custom_id", "method": "POST", "url", "body"}``, for ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings`` (and, for a pooling model, ``/score`` and ``/rerank``). Each output line is
OpenAI's batch output object, in input order::

    {"id": "vllite-…", "custom_id": "…", "response": {"status_code": 200, "request_id": "vllite-batch-…",
     "body": {…the route's answer…}}, "error": null}

A line that fails (not JSON, a missing or wrong field, an unknown url, ``stream: true``, a request the engine
rejects) gets its own record, ``response.status_code`` the HTTP status the server would give, ``response.body``
the server's error object, and ``error`` OpenAI's ``{"code", "message", "param", "line"}``; the other lines are
processed. ``INPUT`` and ``OUTPUT`` are local paths or http(s) URLs (read with GET; written with one PUT at the
end). Requests run concurrently, at most twice ``--max-num-seqs`` at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import urllib.request
import uuid
from collections import deque
from collections.abc import Iterator
from typing import IO, Any

import msgspec
import pydantic

from vllite.plugins.openai_server.http_errors import BatchLineError

logger = logging.getLogger("vllite.server")

#: The urls a line may name (the score and rerank urls match on their suffix, as vLLM's).
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/score", "/rerank")


class BatchRequestInput(pydantic.BaseModel):
    """One input line (OpenAI's batch request object)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """``vllite run-batch``'s flags (vLLM's names), then every engine flag."""
    from vllite.engine_args import EngineArgs
    from vllite.plugins.commands.engine_flags import add_vllm_only_flags

    batch = parser.add_argument_group("batch")
    add = batch.add_argument
    add("-i", "--input-file", required=True, help="The batch input: a JSONL file path, or an http(s) URL to GET.")
    add("-o", "--output-file", required=True, help="Where results go: a file path, or an http(s) URL to PUT.")
    add("--output-tmp-dir", default=None, help="Where the output is kept before it is uploaded to an URL.")
    add("--served-model-name", nargs="+", default=None, help="Names the requests' 'model' may give.")
    add("--chat-template", default=None, help="A Jinja chat template, or a file holding one, over the tokenizer's.")
    add("--enable-log-requests", action="store_true", help="Log every request's prompt and parameters.")
    add("--max-log-len", type=int, default=None, help="Characters or tokens of a prompt to log (default: all).")
    EngineArgs.add_cli_args(parser)
    add_vllm_only_flags(parser)


def run_batch_command(args: argparse.Namespace) -> int:
    """Runs the batch of ``args.input_file`` into ``args.output_file``; 0 when every line was answered (a line that
    failed is answered with its error record)."""
    from vllite.assets import default_model_path
    from vllite.engine.tokenizer import load_chat_template
    from vllite.engine_args import EngineArgs
    from vllite.plugins.commands.engine_flags import check_engine_args
    from vllite.plugins.openai_server.context import ServerSettings
    from vllite.plugins.openai_server.serving import demo_model_defaults, run_event_loop

    model_path = str(args.model or default_model_path())
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}.")
    settings = ServerSettings(
        served_model_names=tuple(args.served_model_name or [model_path if args.model else "vllite-demo"]),
        chat_template=load_chat_template(args.chat_template),
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        dev_mode=False,
    )
    engine_args = EngineArgs.from_cli_args(args)
    check_engine_args(engine_args)
    demo_model_defaults(engine_args)
    lines = _read_lines(args.input_file)  # an unreadable input fails before the engine starts
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        with _Output(args.output_file, args.output_tmp_dir) as sink:
            counts: list[tuple[int, int]] = []

            async def main() -> None:
                counts.append(await run_batch(engine, settings, lines, sink))

            run_event_loop(main())
    finally:
        engine.shutdown()
    total, failed = counts[0]
    print(f"vllite run-batch: {total} requests, {failed} failed; results in {args.output_file}", file=sys.stderr)
    return 0


async def run_batch(engine: Any, settings: Any, lines: Iterator[str], sink: IO[str]) -> tuple[int, int]:
    """Runs every line against ``engine`` and writes one output line each, in input order; returns (lines, failed)."""
    from vllite.plugins.openai_server.context import ServerContext

    ctx = ServerContext(engine, settings)
    limit = asyncio.Semaphore(2 * engine.config.scheduler_config.max_num_seqs)
    pending: deque[asyncio.Task[dict[str, Any]]] = deque()
    total = failed = 0

    async def one(number: int, line: str) -> dict[str, Any]:
        try:
            return await run_line(ctx, number, line)
        finally:
            limit.release()

    def flush() -> None:  # writes the finished lines at the head, keeping the input order
        nonlocal failed
        while pending and pending[0].done():
            record = pending.popleft().result()
            failed += record["error"] is not None
            sink.write(json.dumps(record) + "\n")

    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        await limit.acquire()
        pending.append(asyncio.ensure_future(one(number, line)))
        total += 1
        flush()
    while pending:
        await asyncio.wait({pending[0]})
        flush()
    return total, failed


async def run_line(ctx: Any, number: int, line: str) -> dict[str, Any]:
    """The output record of input line ``number``."""
    custom_id: str | None = None
    try:
        raw = _parse_json(line)
        custom_id = raw.get("custom_id") if isinstance(raw.get("custom_id"), str) else None
        request = _validate_line(raw)
        custom_id = request.custom_id
        if request.method.upper() != "POST":
            raise BatchLineError(400, f"method must be POST, got {request.method!r}.", "method")
        body = await _answer(ctx, request)
    except Exception as exc:  # every failure becomes this line's error record; the batch goes on
        return _error_record(custom_id, number, exc)
    return {
        "id": f"vllite-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"vllite-batch-{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


async def _answer(ctx: Any, request: BatchRequestInput) -> Any:
    """The route's answer to ``request.body``, as JSON values."""
    from vllite.plugins.openai_server.chat import create_chat_completion
    from vllite.plugins.openai_server.completions import create_completion
    from vllite.plugins.openai_server.pooling import protocol as pooling_protocol
    from vllite.plugins.openai_server.pooling import serving as pooling_serving
    from vllite.plugins.openai_server.protocol import ChatCompletionRequest, CompletionRequest
    from vllite.plugins.openai_server.responses import encode

    url = request.url.rstrip("/")
    if request.body.get("stream"):
        raise BatchLineError(400, "Request must not be sent in stream mode.", "body.stream")
    work: Any
    if url == "/v1/chat/completions":
        work = create_chat_completion(ctx, _validate(ChatCompletionRequest, request.body))
    elif url == "/v1/completions":
        work = create_completion(ctx, _validate(CompletionRequest, request.body))
    elif url == "/v1/embeddings":
        work = pooling_serving.create_embedding(ctx, _validate(pooling_protocol.EmbeddingRequest, request.body))
    elif url.endswith("/score"):
        work = pooling_serving.create_score(ctx, _validate(pooling_protocol.ScoreRequest, request.body))
    elif url.endswith("/rerank"):
        work = pooling_serving.create_rerank(ctx, _validate(pooling_protocol.RerankRequest, request.body))
    else:
        raise BatchLineError(404, f"URL {request.url} is not supported; supported: {', '.join(URLS)}.", "url")
    return msgspec.json.decode(encode(await work))


def _parse_json(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchLineError(400, f"The line is not valid JSON: {exc}.") from None
    if not isinstance(value, dict):
        raise BatchLineError(400, f"The line must be a JSON object, got {type(value).__name__}.")
    return value


def _validate_line(raw: dict[str, Any]) -> BatchRequestInput:
    """The line as a batch request; a ``BatchLineError`` naming each missing, unknown or mistyped field."""
    try:
        return BatchRequestInput.model_validate(raw)
    except pydantic.ValidationError as exc:
        parts, params = [], []
        for error in exc.errors():
            field = ".".join(str(p) for p in error.get("loc", ()))
            if error.get("type") == "missing":
                parts.append(f"Missing required field {field!r}.")
            elif error.get("type") == "extra_forbidden":
                parts.append(f"Unknown field {field!r}: a batch line has custom_id, method, url and body.")
            else:
                parts.append(f"{field}: {error.get('msg', 'invalid value')} (got {repr(error.get('input'))[:80]}).")
            params.append(field)
        raise BatchLineError(400, " ".join(parts), params[0] if params else None) from None


def _validate(model: type[Any], value: Any, prefix: str = "body.") -> Any:
    """``value`` as ``model``; a ``BatchLineError`` naming the bad fields (``body.temperature``, ``url``)."""
    from fastapi.exceptions import RequestValidationError

    from vllite.plugins.openai_server.http_common import describe_validation_error

    try:
        return model.model_validate(value)
    except pydantic.ValidationError as exc:
        message, param = describe_validation_error(RequestValidationError(exc.errors()))
        raise BatchLineError(400, message, f"{prefix}{param}" if param else None) from None


def _error_record(custom_id: str | None, number: int, exc: Exception) -> dict[str, Any]:
    """OpenAI's output record for a line that failed with ``exc``."""
    from vllite.plugins.openai_server.errors import classify, error_response

    if isinstance(exc, BatchLineError):
        status, param, body = exc.status, exc.param, error_response(exc.status, str(exc), exc.param)
    else:
        status, body = classify(exc)
        param = body.error.param
    message = body.error.message
    code = "invalid_request" if status == 400 else "not_found" if status == 404 else "server_error"
    return {
        "id": f"vllite-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"vllite-batch-{uuid.uuid4().hex}",
            "body": msgspec.json.decode(msgspec.json.encode(body)),
        },
        "error": {"code": code, "message": message, "param": param, "line": number},
    }


# ---------------------------------------------------------------------------------------------- files and URLs
def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _read_lines(path: str) -> Iterator[str]:
    """The input's lines: a local file read as it goes, or an URL's body (GET)."""
    if _is_url(path):
        with urllib.request.urlopen(path, timeout=300) as response:
            text = response.read().decode("utf-8")
        return iter(text.splitlines())
    if not os.path.isfile(path):
        raise ValueError(f"--input-file: no such file {path!r}.")
    return _file_lines(path)


def _file_lines(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        yield from f


class _Output:
    """The output file; for an URL, a temporary file PUT to it on a clean exit."""

    def __init__(self, path: str, tmp_dir: str | None) -> None:
        self.path = path
        self.tmp_dir = tmp_dir
        self.file: IO[str] | None = None

    def __enter__(self) -> IO[str]:
        if _is_url(self.path):
            self.file = tempfile.NamedTemporaryFile(
                "w+", encoding="utf-8", dir=self.tmp_dir, prefix="vllite_batch_", suffix=".jsonl"
            )
        else:
            self.file = open(self.path, "w", encoding="utf-8")
        return self.file

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        assert self.file is not None
        try:
            if _is_url(self.path) and exc_type is None:
                self.file.flush()
                self.file.seek(0)
                data = self.file.read().encode("utf-8")
                upload = urllib.request.Request(self.path, data=data, method="PUT")
                upload.add_header("Content-Type", "application/jsonl")
                with urllib.request.urlopen(upload, timeout=300) as response:
                    if response.status >= 300:
                        raise OSError(f"Uploading the output to {self.path} failed: HTTP {response.status}.")
        finally:
            self.file.close()
