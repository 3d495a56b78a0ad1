"""The ``p2p`` KV connector: a prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), each engine
core in its own process, the prompt's KV moving between them over ZMQ, as in vLLM's disaggregated-serving example.

The oracle is Hugging Face ``generate()`` (greedy, float32).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kv_connector_support import BLOCK, PROMPT, kv_llm
from kv_connector_support import model_path as model_path  # the fixture
from test_executor_support import (
    hf_greedy,
    single_thread,  # noqa: F401  (autouse fixture)
)

from vllite.kv_connector.config import KVTransferConfig
from vllite.kv_connector.factory import connector_class
from vllite.outputs import RequestOutput
from vllite.plugins.kv_connectors.p2p import P2PConnector
from vllite.sampling_params import SamplingParams
from vllite.testing.kv_connector_conformance import run_conformance

OTHER = [(7 * j) % 90 + 3 for j in range(18)]


@pytest.fixture(autouse=True)
def multiprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")


def _llm(model_path: Path, role: str, policy: str = "fail", **extra: Any) -> Any:
    kv = {
        "kv_connector": "p2p",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"p2p_timeout_s": 2.0, **extra},
    }
    return kv_llm(model_path, kv, max_model_len=48, num_gpu_blocks_override=32)


def _prefill(llm: Any, prompt: list[int]) -> RequestOutput:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


def _decode(llm: Any, prompt: list[int], kv_params: dict[str, Any] | None, max_tokens: int = 6) -> RequestOutput:
    extra = {"kv_transfer_params": kv_params} if kv_params is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


def _usage(llm: Any) -> float:
    return float(llm.llm_engine.engine_core.call_utility("get_kv_cache_usage"))


def _wait_usage_zero(llm: Any, timeout_s: float = 5.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (usage := _usage(llm)) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return usage


def test_registered_and_config_checked(model_path: Path) -> None:
    assert connector_class(KVTransferConfig("p2p")) is P2PConnector
    from test_executor_support import make_config

    from vllite.kv_connector.base import KVConnectorRole

    bad = KVTransferConfig("p2p", kv_connector_extra_config={"p2p_timeout_s": "soon"})
    with pytest.raises(ValueError, match="p2p_timeout_s"):
        P2PConnector(make_config(model_path), KVConnectorRole.SCHEDULER, bad)


def test_decode_engine_generates_from_received_kv(model_path: Path) -> None:
    expected = hf_greedy(model_path, PROMPT, 6)
    with _llm(model_path, "kv_producer") as prefill, _llm(model_path, "kv_consumer") as decode:
        first = _prefill(prefill, PROMPT)
        params = first.kv_transfer_params
        assert params is not None and params["num_tokens"] == len(PROMPT) - 1
        assert params["num_blocks"] == -(-(len(PROMPT) - 1) // BLOCK)
        assert first.outputs[0].token_ids == expected[:1]
        assert _usage(prefill) > 0  # the blocks wait for the consumer
        out = _decode(decode, PROMPT, params)
        assert out.outputs[0].token_ids == expected
        # Every prompt token but the last came from the producer: the decode engine computed only that one.
        assert out.num_cached_tokens == len(PROMPT) - 1
        assert _wait_usage_zero(prefill) == 0  # sent, so freed
        assert _wait_usage_zero(decode) == 0
        # A second pair of requests through the same engines, and a plain request on the decode engine.
        second = _prefill(prefill, OTHER)
        again = _decode(decode, OTHER, second.kv_transfer_params)
        assert again.outputs[0].token_ids == hf_greedy(model_path, OTHER, 6)
        assert again.num_cached_tokens == len(OTHER) - 1
        plain = _decode(decode, PROMPT[:10], None)
        assert plain.outputs[0].token_ids == hf_greedy(model_path, PROMPT[:10], 6)
        assert _wait_usage_zero(prefill) == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_producer_gone_before_the_fetch(model_path: Path, policy: str) -> None:
    expected = hf_greedy(model_path, PROMPT, 6)
    with _llm(model_path, "kv_consumer", policy=policy) as decode:
        # The producer holds the KV for up to p2p_send_timeout_s (60 s); a shutdown gives it up at once.
        with _llm(model_path, "kv_producer") as prefill:
            params = _prefill(prefill, PROMPT).kv_transfer_params
            assert params is not None
        assert prefill.llm_engine.engine_core.resources.proc.exitcode == 0  # exited by itself, not killed
        # The producer is shut down: its address answers nothing.
        start = time.monotonic()
        out = _decode(decode, PROMPT, params)
        assert time.monotonic() - start < 5.0
        if policy == "recompute":
            assert out.outputs[0].token_ids == expected
        else:
            assert out.outputs[0].finish_reason == "error"
        # The decode engine keeps serving.
        plain = _decode(decode, OTHER, None)
        assert plain.outputs[0].token_ids == hf_greedy(model_path, OTHER, 6)
        assert _wait_usage_zero(decode) == 0


def test_producer_passes_the_conformance_kit() -> None:
    """A producer alone (the kit runs one engine): every finished request's blocks are offered (a delayed free)
    and, with ``p2p_send_timeout_s`` 0, released on the next step; outputs equal the engine without a connector."""
    report = run_conformance(
        {"kv_connector": "p2p", "kv_role": "kv_producer", "kv_connector_extra_config": {"p2p_send_timeout_s": 0}}
    )
    assert report.num_delayed_frees > 0
