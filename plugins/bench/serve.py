"""``vllite bench serve``: a load generator for any OpenAI-compatible server (vllite's ``vllite serve``, vLLM, ...).

It sends streaming ``/v1/completions`` (or ``--endpoint /v1/chat/completions``) requests on one aiohttp session,
at ``--request-rate`` req/s (gamma-renewal arrivals of shape ``--burstiness``; ``inf`` = all at once), at most
``--max-concurrency`` in flight, for ``--num-prompts`` requests or ``--duration`` seconds, and reports what
``vllm bench serve`` reports: request and token throughput and the mean / median / percentiles of TTFT, TPOT, ITL
and end-to-end latency (:mod:`~vllite.plugins.bench.serve_metrics`). Prompts are random tokens
(``--random-input-len`` / ``--random-output-len`` / ``--random-range-ratio``; sent as token-id lists unless
``--tokenizer`` turns them into text) or ``--dataset-path`` JSON lines. One warm-up request runs before the clock
starts. Failed requests are counted and the first error shown; they never stop the run.

Python API: :func:`bench_serve` (``ServeBenchConfig`` in, the figures as a dict out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.plugins.bench.errors import ServeBenchError
from vllite.plugins.bench.serve_client import RequestResult, stream_request
from vllite.plugins.bench.serve_config import ServeBenchConfig, config_from_args
from vllite.plugins.bench.serve_metrics import format_table, summarize
from vllite.plugins.bench.serve_requests import BenchRequest, JsonlDataset, RandomDataset, iter_arrivals

if TYPE_CHECKING:
    import aiohttp

#: One request may take this long (the whole run has no limit but ``--duration``).
REQUEST_TIMEOUT_S = 6 * 3600


def demo_vocab_size() -> int:
    """The vocabulary size of vllite's demo model (the default range of random prompt token ids)."""
    from vllite.assets import DEMO_MODEL_DIR

    return int(json.loads((DEMO_MODEL_DIR / "config.json").read_text(encoding="utf-8"))["vocab_size"])


# ---------------------------------------------------------------------------------------------- the run
def _run(main: Any) -> Any:
    """Runs ``main`` on uvloop where installed: the client's own CPU cost stays small next to the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def bench_serve(config: ServeBenchConfig, *, log: Any = print) -> dict[str, Any]:
    """Runs the benchmark, prints its table with ``log``, saves it if ``config.save_result``; returns the figures."""
    result = _run(benchmark(config))
    log(format_table(result, percentiles=config.metric_percentiles, metrics=config.percentile_metrics))
    if config.save_result:
        log(f"wrote {save_result(result, config)}")
    return result


def _check(config: ServeBenchConfig) -> None:
    if config.duration is not None and config.duration <= 0:
        raise ValueError(f"--duration must be > 0, got {config.duration}.")
    if config.num_prompts is not None and config.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {config.num_prompts}.")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {config.max_concurrency}.")
    unbounded = config.num_prompts is None and config.duration is not None
    if unbounded and math.isinf(config.request_rate) and config.max_concurrency is None:
        raise ValueError("--duration without --num-prompts needs a finite --request-rate or --max-concurrency.")


def _dataset(config: ServeBenchConfig) -> RandomDataset | JsonlDataset:
    tokenizer = None
    if config.tokenizer:
        from vllite.engine.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(config.tokenizer)
    if config.dataset_path:
        return JsonlDataset(config.dataset_path, config.random_output_len, tokenizer)
    return RandomDataset(
        config.random_input_len,
        config.random_output_len,
        range_ratio=config.random_range_ratio,
        vocab_size=config.vocab_size or demo_vocab_size(),
        seed=config.seed,
        tokenizer=tokenizer,
    )


def request_body(config: ServeBenchConfig, model: str, request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    """The streaming request body of ``request`` for the configured endpoint."""
    body: dict[str, Any] = {"model": model, "temperature": config.temperature, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if config.chat:
        if not isinstance(request.prompt, str):
            raise ValueError(
                "The chat endpoint needs text prompts: pass --tokenizer DIR (random prompts) or a --dataset-path "
                "of text prompts."
            )
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.max_tokens
    else:
        body["prompt"] = request.prompt
        body["max_tokens"] = request.max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    if config.return_token_ids:
        body["return_token_ids"] = True
    body.update(config.extra_body)
    return body


def _headers(config: ServeBenchConfig) -> dict[str, str]:
    key = config.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLITE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists (GET /v1/models)."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url) as response:
            text = await response.text()
            if response.status != 200:
                raise ServeBenchError(f"GET {url}: HTTP {response.status}: {text[:300]}")
            models = json.loads(text).get("data") or []
    except ServeBenchError:
        raise
    except Exception as exc:
        raise ServeBenchError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    if not models:
        raise ServeBenchError(f"GET {url} lists no model; pass --model.")
    return str(models[0]["id"])


async def benchmark(config: ServeBenchConfig) -> dict[str, Any]:
    """Warm-up, then the timed run; the figures of :func:`~.bench_metrics.summarize` plus per-request values."""
    import aiohttp

    _check(config)
    dataset = _dataset(config)
    random_prompts = isinstance(dataset, RandomDataset)
    ignore_eos = config.ignore_eos if config.ignore_eos is not None else random_prompts
    num_prompts = config.num_prompts if config.num_prompts is not None or config.duration else 100
    url = config.base_url.rstrip("/") + "/" + config.endpoint.lstrip("/")
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore limits concurrency, not the pool
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=_headers(config)) as session:
        model = config.model or await first_model(session, config.base_url)
        warm = dataset[-1] if random_prompts else dataset[0]
        warm = BenchRequest(warm.prompt, warm.prompt_len, min(warm.max_tokens, 16))
        warm_result = await stream_request(
            session, url, request_body(config, model, warm, ignore_eos), chat=config.chat
        )
        if not warm_result.success:
            raise ServeBenchError(f"The warm-up request to {url} failed: {warm_result.error}")
        results, lens, duration = await _timed_run(session, url, config, model, dataset, num_prompts, ignore_eos)
    summary = summarize(
        results, duration, prompt_lens=lens, percentiles=config.metric_percentiles, metrics=config.percentile_metrics
    )
    summary.update({
        "model": model, "base_url": config.base_url, "endpoint": config.endpoint,
        "request_rate": config.request_rate, "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency, "num_prompts": len(results),
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results], "errors": [r.error for r in results],
    })  # fmt: skip
    return summary


async def _timed_run(
    session: aiohttp.ClientSession,
    url: str,
    config: ServeBenchConfig,
    model: str,
    dataset: RandomDataset | JsonlDataset,
    num_prompts: int | None,
    ignore_eos: bool,
) -> tuple[list[RequestResult], list[int | None], float]:
    """Sends on the arrival schedule; returns the results, the prompt lengths and the duration (s)."""
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    # A burst with a concurrency limit is a closed loop: the sender waits for a slot, so an endless
    # --duration run never piles up waiting tasks. With a finite rate, arrivals keep their schedule.
    sender_waits = semaphore is not None and math.isinf(config.request_rate)

    async def send(body: dict[str, Any], holds_slot: bool) -> RequestResult:
        try:
            if semaphore is None or holds_slot:
                return await stream_request(session, url, body, chat=config.chat)
            async with semaphore:
                return await stream_request(session, url, body, chat=config.chat)
        finally:
            if holds_slot and semaphore is not None:
                semaphore.release()

    tasks: list[asyncio.Task[RequestResult]] = []
    lens: list[int | None] = []
    start = time.perf_counter()
    for index, at in enumerate(iter_arrivals(config.request_rate, config.burstiness, config.seed)):
        if num_prompts is not None and index >= num_prompts:
            break
        if config.duration is not None and at >= config.duration:
            break
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sender_waits and semaphore is not None:
            await semaphore.acquire()
        if config.duration is not None and time.perf_counter() - start >= config.duration:
            if sender_waits and semaphore is not None:
                semaphore.release()
            break
        request = dataset[index]
        lens.append(request.prompt_len)
        body = request_body(config, model, request, ignore_eos)
        tasks.append(asyncio.create_task(send(body, sender_waits)))
    results = list(await asyncio.gather(*tasks))
    return results, lens, time.perf_counter() - start


def save_result(result: dict[str, Any], config: ServeBenchConfig) -> Path:
    """Writes the figures, the per-request values and the configuration (less the API key) as JSON."""
    name = config.result_filename
    if not name:
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", str(result.get("model", "model")).rstrip("/").split("/")[-1])
        rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
        name = f"vllite-bench-serve-{rate}qps-{model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(config.result_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = asdict(config)
    settings.pop("api_key", None)
    payload = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": settings, **result}
    for values in (payload, settings):  # JSON has no infinity: "inf", as vLLM writes it
        if math.isinf(values["request_rate"]):
            values["request_rate"] = "inf"
    path.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    return path


def run_bench_command(args: argparse.Namespace) -> int:
    """``vllite bench serve``: runs, prints the table, saves if asked; exit 1 when no request succeeded."""
    result = bench_serve(config_from_args(args))
    return 0 if result["completed"] else 1
