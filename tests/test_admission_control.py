"""Admission control (issue 43, item 6): vLLM's ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``.

A real ``vllite serve`` (the demo model, dev mode for ``/pause``) refuses a request with HTTP 503 and vLLM's error
body when the requests in flight plus the new one's ``n`` would exceed ``--max-num-queued-reqs``, or when the
prompt tokens of the requests still waiting for their first token reach ``--max-num-queued-tokens``; the others
are served, and ``admission_rejections_total{reason=...}`` counts each refusal once. The engine is paused
(``keep``) while the limits are probed, so that no request can start or finish meanwhile: nothing depends on timing.
Negative limits are refused naming the flag.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest
from http_client import request

from vllite.engine_args import EngineArgs
from vllite.plugins.openai_server.testing import RemoteServer

openai = pytest.importorskip("openai")

PROMPT_IDS = [11, 12, 13, 14, 15]  # 5 prompt tokens, as ids: exactly what the token limit counts
MAX_QUEUED_REQS = 3
MAX_QUEUED_TOKENS = 6  # one waiting prompt (5) is under it; two (10) reach it
BUSY = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
BACKLOG = "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", "demo", "--max-model-len", "256", "--max-num-seqs", "1"]
    args += ["--max-num-queued-reqs", str(MAX_QUEUED_REQS), "--max-num-queued-tokens", str(MAX_QUEUED_TOKENS)]
    with RemoteServer(args, env={"VLLITE_SERVER_DEV_MODE": "1"}) as remote:
        yield remote


def rejections(url: str) -> dict[str, float]:
    """``vllite:admission_rejections_total`` by ``reason``, scraped from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = request("GET", url + "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "vllite:admission_rejections":
            return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no vllite:admission_rejections in /metrics")


async def _refused(client, count: int, n: int) -> list:
    """``count`` concurrent completions of ``n`` samples each; each outcome (a completion or the error)."""
    calls = [
        client.completions.create(model="demo", prompt=PROMPT_IDS, max_tokens=2, n=n, temperature=1.0)
        for _ in range(count)
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


def _assert_503(outcome, message: str) -> None:
    assert isinstance(outcome, openai.APIStatusError), outcome
    assert outcome.status_code == 503
    body = outcome.body
    assert body == {"message": message, "type": "Service Unavailable", "param": None, "code": 503}


async def _probe(url: str) -> tuple[list, list, list]:
    """While the engine is paused: two waiting streams admitted, then refusals by each limit; then resume and serve."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)  # no retries: one 503 each
    assert request("POST", url + "/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    try:
        # The stream's headers come once the request is admitted; paused, it waits for its first token.
        first = await client.completions.create(model="demo", prompt=PROMPT_IDS, max_tokens=3, stream=True)
        # 1 in flight + n=3 > 3: refused by the request limit (3 slots each, as vLLM counts n > 1), all of them.
        by_reqs = await _refused(client, count=3, n=3)
        # 1 in flight + 1 <= 3 and 5 waiting prompt tokens < 6: admitted.
        second = await client.completions.create(model="demo", prompt=PROMPT_IDS, max_tokens=3, stream=True)
        # 2 + 1 <= 3, but 10 waiting prompt tokens >= 6: refused by the token limit.
        by_tokens = await _refused(client, count=2, n=1)
    finally:
        assert request("POST", url + "/resume").status_code == 200
    served = []
    for stream in (first, second):
        served.append([chunk async for chunk in stream])
    served.append(await _refused(client, count=1, n=3))  # nothing in flight now: admitted, all 3 slots
    await client.close()
    return by_reqs, by_tokens, served


def test_requests_over_the_limits_get_503_and_are_counted_by_reason(server):
    assert rejections(server.url) == {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}
    by_reqs, by_tokens, (first, second, after) = asyncio.run(_probe(server.url))
    for outcome in by_reqs:
        _assert_503(outcome, BUSY)
    for outcome in by_tokens:
        _assert_503(outcome, BACKLOG)
    for stream in (first, second):  # the admitted requests are served in full once the engine resumes
        assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == ["length"]
    (completion,) = after
    assert not isinstance(completion, BaseException), completion
    assert [c.finish_reason for c in completion.choices] == ["length"] * 3
    assert rejections(server.url) == {"max_num_queued_reqs": 3.0, "max_num_queued_tokens": 2.0}


@pytest.mark.parametrize("field", ["max_num_queued_reqs", "max_num_queued_tokens"])
def test_negative_limits_are_refused_naming_the_flag(field):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{field} \\({flag}\\) must be >= 0"):
        EngineArgs(**{field: -1}).create_engine_config()
    assert getattr(EngineArgs().create_engine_config().scheduler_config, field) is None  # default: no limit
    result = subprocess.run(
        [sys.executable, "-m", "vllite.cli", "serve", "--port", "0", flag, "-1"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"vllite: error: {field} ({flag}) must be >= 0 (or unset: no limit), got -1."
    )


def test_zero_limits_refuse_everything_and_running_requests_hold_no_token_backlog():
    """vLLM's arithmetic, on the frontend's own request states: ``n`` counts as ``n`` slots; a request that has
    produced its first output (running) counts toward the request limit but not the token backlog."""
    from vllite.plugins.engine_proc.admission import MaxQueuedTokensError, QueueOverflowError, check_admission

    states = {"a": SimpleNamespace(prompt_len=100, is_prefilling=False)}  # running
    states["b"] = SimpleNamespace(prompt_len=7, is_prefilling=True)  # waiting for its first token
    processor = SimpleNamespace(request_states=states, get_num_unfinished_requests=lambda: len(states))

    def limits(reqs=None, tokens=None):
        return SimpleNamespace(max_num_queued_reqs=reqs, max_num_queued_tokens=tokens)

    check_admission(limits(), processor, n=1000)  # no limits
    check_admission(limits(reqs=4, tokens=8), processor, n=2)  # 2 + 2 <= 4 slots; backlog 7 < 8
    with pytest.raises(QueueOverflowError):
        check_admission(limits(reqs=4), processor, n=3)
    with pytest.raises(MaxQueuedTokensError):
        check_admission(limits(tokens=7), processor)
    with pytest.raises(QueueOverflowError):  # the request limit is checked first
        check_admission(limits(reqs=2, tokens=7), processor)
    empty = SimpleNamespace(request_states={}, get_num_unfinished_requests=lambda: 0)
    for zero, error in ((limits(reqs=0), QueueOverflowError), (limits(tokens=0), MaxQueuedTokensError)):
        with pytest.raises(error):
            check_admission(zero, empty)
