"""Agent-trace replay against a live OpenAI-compatible server: :class:`HttpBackend` (``--engine http://HOST:PORT``).

Each turn becomes one non-streaming ``POST /v1/completions`` with the token-id prompt, ``max_tokens``,
``temperature: 0``, ``ignore_eos: true`` and ``return_token_ids: true`` (vLLM extras that ``vllite serve``
accepts), and the turn's Continuum fields (``job_id``, ``is_last_step``, ``this_func_call``: what
:func:`~vllite.plugins.bench.agent_bench.turn_params` puts in ``extra_args``) as top-level body fields. Requests run
on an asyncio loop in a background thread; finished turns come back through a queue that :meth:`step` waits on
briefly. Time is wall time.

The server runs whatever scheduler it was started with, so the replay's scheduler name is only a label: replay
once per server (``vllite serve --scheduler-cls continuum``, then ``fcfs``) and compare. What only the engine
sees is read from the server's Prometheus ``/metrics`` where it exports it (prefix-cache queries and hits,
preemptions, KV blocks; vLLM's metric names with any ``prefix:``); what it does not export — and scheduler time
per step, always — is reported as absent (``None``), never guessed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import queue
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from vllite.plugins.bench.agent_bench import StepEvents
from vllite.plugins.bench.errors import BenchReplayError
from vllite.sampling_params import SamplingParams

if TYPE_CHECKING:
    import aiohttp

#: One turn may take this long before it counts as failed.
REQUEST_TIMEOUT_S = 6 * 3600

_METRIC_LINE = re.compile(r"^(?:[A-Za-z_]\w*:)?(\w+?)(?:_total)?(\{[^}]*\})?\s+(\S+)")


def is_http_engine(engine: str) -> bool:
    """Whether an ``--engine`` value names a server (``http://`` or ``https://`` URL)."""
    return engine.startswith(("http://", "https://"))


def demo_vocab_size() -> int:
    """The vocabulary size of vllite's demo model: the default range of the replay's random prompt token ids."""
    from vllite.assets import DEMO_MODEL_DIR

    return int(json.loads((DEMO_MODEL_DIR / "config.json").read_text(encoding="utf-8"))["vocab_size"])


def parse_prometheus(text: str) -> dict[str, float]:
    """Sums of the samples of each metric in a Prometheus text page, keyed by name without a ``prefix:`` and
    ``_total`` (``vllm:prefix_cache_hits_total`` → ``prefix_cache_hits``); ``cache_config_info``'s
    ``num_gpu_blocks`` label becomes ``num_gpu_blocks``."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match:
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == "cache_config_info" and labels:
            blocks = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if blocks:
                values["num_gpu_blocks"] = float(blocks.group(1))
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def request_body(model: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    """The ``/v1/completions`` body of one turn: forced length, greedy, token ids back, Continuum fields."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "ignore_eos": params.ignore_eos,
        "return_token_ids": True,
    }
    body.update(params.extra_args or {})
    return body


class HttpBackend:
    """A live server as a replay backend: wall time, one aiohttp session on a background event loop."""

    virtual = False

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        vocab_size: int | None = None,
        poll_s: float = 0.002,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.vocab_size = vocab_size or demo_vocab_size()
        self.poll_s = poll_s
        key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLITE_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._done: queue.Queue[tuple[str, list[int], str | None]] = queue.Queue()
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._in_flight = 0
        self._session: aiohttp.ClientSession | None = None
        self.model: str = ""
        self.max_model_len: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-http", daemon=True)
        self._thread.start()
        try:
            self._call(self._open())
            self.model, self.max_model_len = self._call(self._model_card(model))
            self._warm_up()
            self.baseline = self.server_metrics()
        except BaseException:
            self.shutdown()
            raise
        self.num_gpu_blocks: int | None = None
        if self.baseline and "num_gpu_blocks" in self.baseline:
            self.num_gpu_blocks = int(self.baseline["num_gpu_blocks"])
        self._t0 = time.monotonic()

    # -------------------------------------------------------------------------------------- loop plumbing
    def _call(self, coro: Any, timeout: float | None = 300.0) -> Any:
        """Runs ``coro`` on the background loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0),  # every in-flight turn gets a connection
            headers=self._headers,
        )

    async def _get(self, path: str) -> tuple[int, str]:
        assert self._session is not None
        async with self._session.get(self.base_url + path) as response:
            return response.status, await response.text()

    async def _model_card(self, model: str | None) -> tuple[str, int | None]:
        """The model to name (``model``, else the server's first) and its ``max_model_len`` if listed."""
        try:
            status, text = await self._get("/v1/models")
        except Exception as exc:
            raise BenchReplayError(f"GET {self.base_url}/v1/models failed: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise BenchReplayError(f"GET {self.base_url}/v1/models: HTTP {status}: {text[:300]}")
        cards = json.loads(text).get("data") or []
        card = next((c for c in cards if model is None or c.get("id") == model), None)
        if card is None:
            if model is not None:
                return model, None
            raise BenchReplayError(f"{self.base_url}/v1/models lists no model; pass --model.")
        return str(card["id"]), card.get("max_model_len")

    async def _post(self, request_id: str, body: dict[str, Any]) -> None:
        """One turn; its outcome goes to the queue whatever happens (tokens, or an error's text)."""
        assert self._session is not None
        tokens: list[int] = []
        error: str | None = None
        try:
            async with self._session.post(self.base_url + "/v1/completions", json=body) as response:
                text = await response.text()
            if response.status != 200:
                error = f"HTTP {response.status}: {text[:500]}"
            else:
                choice = json.loads(text)["choices"][0]
                if choice.get("token_ids") is None:
                    error = "the response has no token_ids (the server must support return_token_ids)"
                else:
                    tokens = [int(t) for t in choice["token_ids"]]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        self._done.put((request_id, tokens, error))

    def _warm_up(self) -> None:
        """One short request before the clock starts (connection set-up, first-request costs)."""
        self.submit("bench-warmup", list(range(1, 17)), SamplingParams(max_tokens=2, ignore_eos=True))
        _, _, error = self._done.get(timeout=REQUEST_TIMEOUT_S)
        self._in_flight -= 1
        if error is not None:
            raise BenchReplayError(f"The warm-up request to {self.base_url} failed: {error}")

    def server_metrics(self) -> dict[str, float] | None:
        """The server's Prometheus counters (:func:`parse_prometheus`); None without a ``/metrics`` page."""
        try:
            status, text = self._call(self._get("/metrics"), timeout=30.0)
        except Exception:
            return None
        return parse_prometheus(text) if status == 200 else None

    # -------------------------------------------------------------------------------------- backend API
    def now(self) -> float:
        """Wall time since the backend was ready, in seconds."""
        return time.monotonic() - self._t0

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Sends the turn as a ``/v1/completions`` request (returns at once)."""
        body = request_body(self.model, prompt, params)
        future = asyncio.run_coroutine_threadsafe(self._post(request_id, body), self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        self._in_flight += 1

    def has_work(self) -> bool:
        """Whether any turn is in flight."""
        return self._in_flight > 0

    def step(self) -> tuple[StepEvents, bool]:
        """The turns finished since the last call (waits up to ``poll_s`` for one); a failed turn raises
        :class:`~vllite.plugins.bench.errors.BenchReplayError` with the server's answer."""
        try:
            finished = [self._done.get(timeout=self.poll_s)]
        except queue.Empty:
            return [], False
        while True:
            try:
                finished.append(self._done.get_nowait())
            except queue.Empty:
                break
        events: StepEvents = []
        for request_id, tokens, error in finished:
            self._in_flight -= 1
            if error is not None:
                raise BenchReplayError(f"Request {request_id} to {self.base_url} failed: {error}")
            events.append((request_id, tokens, True))
        return events, True

    def wait_until(self, when: float) -> None:
        """Sleeps until ``when`` (wall time since the start)."""
        delay = when - self.now()
        if delay > 0:
            time.sleep(delay)

    def idle_tick(self) -> None:
        """Nothing: :meth:`step` already waited for the server."""

    def engine_figures(self) -> dict[str, Any]:
        """Prefix-cache hit rate, preemptions and KV blocks from ``/metrics`` deltas since the warm-up; ``None``
        where the server does not export them. Steps and scheduler time are never visible over HTTP: ``None``."""
        after = self.server_metrics()
        before = self.baseline or {}
        figures: dict[str, Any] = {
            "prefix_hit_rate": None,
            "preemptions": None,
            "steps": None,
            "sched_ms_per_step": None,
            "sched_cpu_ms_per_step": None,
        }
        if after is None or self.baseline is None:
            return figures
        if "prefix_cache_queries" in after and "prefix_cache_hits" in after:
            queries = after["prefix_cache_queries"] - before.get("prefix_cache_queries", 0.0)
            hits = after["prefix_cache_hits"] - before.get("prefix_cache_hits", 0.0)
            figures["prefix_hit_rate"] = hits / queries if queries > 0 else None
        if "num_preemptions" in after:
            figures["preemptions"] = int(after["num_preemptions"] - before.get("num_preemptions", 0.0))
        return figures

    def shutdown(self) -> None:
        """Cancels the turns still in flight, closes the session and stops the loop thread."""
        if not self._thread.is_alive():
            return
        for future in list(self._pending):
            future.cancel()
        if self._session is not None:
            try:
                self._call(self._session.close(), timeout=30.0)
            except Exception:
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30.0)
        if not self._thread.is_alive():
            self._loop.close()
