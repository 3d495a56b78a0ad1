"""Plugins load in the engine-core child process: a scheduler and a logits processor from a throwaway
distribution on ``sys.path`` are active across the process boundary (real executor, tiny random model)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.plugin_utils import forget_modules, make_distribution
from tests.test_engine_proc import Collector, ensure_engine_proc_plugin
from vllite.engine_args import EngineArgs
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams

FORCED_TOKEN = 7

SCHED_SOURCE = """
from vllite.hookspecs import hookimpl
from vllite.policies.fcfs import FCFSScheduler


class TaggingScheduler(FCFSScheduler):
    pass


@hookimpl
def vllite_register_schedulers(register):
    register("tagging", TaggingScheduler)
"""

LOGITSPROC_SOURCE = f"""
import torch
from vllite.logits_processor import LogitsProcessor


class ForceToken(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        logits[:] = float("-inf")
        logits[:, {FORCED_TOKEN}] = 0.0
        return logits
"""


@pytest.fixture
def throwaway_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from vllite.plugin_manager import reset_plugin_manager

    root = make_distribution(
        tmp_path / "site",
        "throwaway-engine-plugins",
        {"vllite": {"tw_sched": "tw_sched_mod"}, "vllm.logits_processors": {"force7": "tw_lp_mod:ForceToken"}},
        {"tw_sched_mod": SCHED_SOURCE, "tw_lp_mod": LOGITSPROC_SOURCE},
    )
    monkeypatch.syspath_prepend(str(root))
    reset_plugin_manager()
    yield root
    forget_modules("tw_sched_mod", "tw_lp_mod")
    reset_plugin_manager()


def test_scheduler_and_logits_processor_from_a_distribution_run_in_the_child(throwaway_dist, tmp_path):
    pytest.importorskip("transformers")
    from test_executor_support import make_model

    from vllite.plugins.engine_proc.client import SyncMPClient

    ensure_engine_proc_plugin()
    model = make_model("llama", tmp_path / "llama")
    config = EngineArgs(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        max_model_len=64,
        num_gpu_blocks_override=32,
        block_size=4,
        scheduler_cls="tagging",
    ).create_engine_config()
    client = SyncMPClient(config)
    try:
        assert client.call_utility("get_engine_info")["scheduler"] == "TaggingScheduler"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        client.add_request(EngineCoreRequest("p-1", [3, 4, 5, 6], params, None, time.time()))
        col = Collector(client)
        col.until_finished("p-1")
        assert col.tokens["p-1"] == [FORCED_TOKEN] * 6
    finally:
        client.shutdown()
