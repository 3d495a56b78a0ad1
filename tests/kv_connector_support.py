"""Shared by the KV-connector tests: their block size and prompt, the tiny model (the ``model_path`` fixture, which
a test module imports as ``from kv_connector_support import model_path as model_path``), and engines built with a
KV connector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_executor_support import make_model

from vllite.sampling_params import SamplingParams

BLOCK = 4
PROMPT = [11, 23, 5, 78, 42, 9, 60, 31, 17, 88, 4, 53, 27, 70, 36, 8, 91, 14, 66, 20, 3, 49, 82]  # 23 tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama model, made once per test module."""
    return make_model("llama", tmp_path_factory.mktemp("models") / "llama")


def kv_llm(model_path: Path, kv: dict[str, Any], **settings: Any) -> Any:
    """An ``LLM`` of ``model_path`` (float32, ``BLOCK``-token blocks, no tokenizer) with ``kv`` as its
    ``kv_transfer_config``; ``settings`` are further engine arguments."""
    from vllite import LLM

    return LLM(
        str(model_path),
        dtype="float32",
        block_size=BLOCK,
        skip_tokenizer_init=True,
        kv_transfer_config=json.dumps(kv),
        **settings,
    )


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int = 6) -> list[Any]:
    """The outputs of ``prompts`` (token ids), greedy, ``max_tokens`` tokens each."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
