"""The admission gates (issue 43), with vLLM's names and defaults: ``scheduler_reserve_full_isl`` (on: a waiting
request is admitted only when its whole prompt fits in the free KV blocks, not just its first chunk) and
``watermark`` (0: the fraction of all KV blocks kept free when admitting while other requests run). Checked on the
scheduler with a scripted model runner, through ``LLM`` on the demo model and through ``vllite serve``; bad values
are refused naming the setting."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from vllite import LLM, EngineArgs, SamplingParams
from vllite.protocol import FinishReason
from vllite.sched import Scheduler
from vllite.testing import ScriptedModelRunner, make_config, make_request


def build(num_blocks: int, **config_kw) -> Scheduler:
    """4-token blocks, prefill chunks of at most 8 tokens."""
    config_kw.setdefault("long_prefill_token_threshold", 8)
    return Scheduler(make_config(block_size=4, max_num_batched_tokens=64, **config_kw), num_blocks, step_observer=None)


def add(s: Scheduler, rid: str, n: int, max_tokens: int = 4) -> None:
    s.add_request(make_request(s, rid, list(range(ord(rid) * 100, ord(rid) * 100 + n)), max_tokens=max_tokens))


def step(s: Scheduler, ex: ScriptedModelRunner) -> tuple[dict[str, int], list]:
    so = s.schedule()
    outputs = s.update_from_output(so, ex.execute(so))
    return dict(so.num_scheduled_tokens), [o for eco in outputs.values() for o in eco.outputs]


def run_out(s: Scheduler, ex: ScriptedModelRunner) -> dict[str, FinishReason]:
    finished: dict[str, FinishReason] = {}
    for _ in range(100):
        if not s.get_num_unfinished_requests():
            return finished
        finished.update({o.request_id: o.finish_reason for o in step(s, ex)[1] if o.finish_reason is not None})
    raise AssertionError("the requests did not finish")


# ---------------------------------------------------------------- scheduler_reserve_full_isl
def a_running_then_b_arrives(**config_kw) -> tuple[Scheduler, ScriptedModelRunner]:
    """8 usable blocks (32 tokens). A (8-token prompt) runs; B's 24-token prompt (6 blocks) arrives while A holds
    2 blocks and is about to take a third: 5 blocks stay free, enough for B's first chunk but not its prompt."""
    s, ex = build(9, **config_kw), ScriptedModelRunner()
    add(s, "A", 8)
    assert step(s, ex)[0] == {"A": 8}
    add(s, "B", 24)
    return s, ex


def test_gate_on_by_default_holds_back_a_prompt_that_does_not_fit_whole():
    assert make_config().scheduler_config.scheduler_reserve_full_isl is True  # vLLM's default
    s, ex = a_running_then_b_arrives()
    assert step(s, ex)[0] == {"A": 1}  # B is not admitted: its whole prompt does not fit
    assert [r.request_id for r in s.waiting] == ["B"] and s.kv_cache_manager.num_free_blocks == 5
    assert run_out(s, ex) == {"A": FinishReason.LENGTH, "B": FinishReason.LENGTH}
    assert s.num_preemptions_total == 0


def test_gate_off_admits_chunk_by_chunk_and_then_preempts():
    s, ex = a_running_then_b_arrives(scheduler_reserve_full_isl=False)
    assert step(s, ex)[0] == {"A": 1, "B": 8}  # eager: B's first chunk fits, so B is admitted
    assert run_out(s, ex) == {"A": FinishReason.LENGTH, "B": FinishReason.LENGTH}
    assert s.num_preemptions_total >= 1  # B ran out of blocks mid-prompt and was recomputed


def test_gate_fails_a_prompt_the_whole_cache_cannot_hold():
    s, ex = build(9), ScriptedModelRunner()
    add(s, "X", 40)  # 10 blocks > 8 usable: with the gate it would wait forever
    scheduled, outputs = step(s, ex)
    assert scheduled == {} and [o.finish_reason for o in outputs] == [FinishReason.ERROR]
    assert "cannot hold request 'X'" in outputs[0].error


# ---------------------------------------------------------------- watermark
def a_running_then_b(watermark: float) -> tuple[Scheduler, ScriptedModelRunner, dict[str, int]]:
    """10 blocks (9 usable), A (8 tokens) running and holding 3 blocks; B (20 tokens, 5 blocks) arrives."""
    s, ex = build(10, watermark=watermark), ScriptedModelRunner()
    add(s, "A", 8)
    step(s, ex)
    add(s, "B", 20)
    return s, ex, step(s, ex)[0]


def test_watermark_keeps_blocks_free_while_others_run():
    s, ex, scheduled = a_running_then_b(0.0)
    assert scheduled == {"A": 1, "B": 8} and s.kv_cache_manager.num_free_blocks == 4  # B's prompt: 5 of 6 blocks
    s, ex, scheduled = a_running_then_b(0.2)  # int(0.2 * 10) = 2 blocks must stay free: 5 + 2 > 6
    assert s.watermark_blocks == 2
    assert scheduled == {"A": 1} and s.kv_cache_manager.num_free_blocks == 6
    assert run_out(s, ex) == {"A": FinishReason.LENGTH, "B": FinishReason.LENGTH}


def test_watermark_does_not_hold_back_a_lone_request():
    s, ex = build(10, watermark=0.5), ScriptedModelRunner()
    add(s, "C", 32)  # 8 of the 9 usable blocks (9 with its outputs) while 5 are to stay free: nothing else runs
    assert step(s, ex)[0] == {"C": 8}
    assert run_out(s, ex) == {"C": FinishReason.LENGTH}


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize("value", [1.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_bad_watermark_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"watermark must be a number in \[0, 1\)"):
        EngineArgs(watermark=value).create_engine_config()


def test_bad_reserve_full_isl_is_refused_naming_it():
    with pytest.raises(ValueError, match="scheduler_reserve_full_isl must be True or False"):
        EngineArgs(scheduler_reserve_full_isl="yes").create_engine_config()  # type: ignore[arg-type]


def test_cli_flags_with_vllms_spelling():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--no-scheduler-reserve-full-isl", "--watermark", "0.05"]))
    assert (args.scheduler_reserve_full_isl, args.watermark) == (False, 0.05)
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert (defaults.scheduler_reserve_full_isl, defaults.watermark) == (True, 0.0)


# ---------------------------------------------------------------- through LLM
def mixed_prompts() -> list[dict]:
    """Short and long prompts of distinct tokens (no prefix-cache hits), long ones first."""
    lengths = [180, 20, 150, 30, 120, 10, 170, 40]
    return [{"prompt_token_ids": [100 + 7 * i + j for j in range(n)]} for i, n in enumerate(lengths)]


def generate(**engine_kw) -> tuple[list[list[int]], int]:
    llm = LLM(max_model_len=512, num_gpu_blocks_override=33, max_num_batched_tokens=64, **engine_kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        outputs = llm.generate(mixed_prompts(), params, use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        return [o.outputs[0].token_ids for o in outputs], scheduler.num_preemptions_total
    finally:
        llm.shutdown()


def test_llm_gate_same_tokens_fewer_preemptions():
    eager_tokens, eager_preemptions = generate(scheduler_reserve_full_isl=False)
    gated_tokens, gated_preemptions = generate()
    watermark_tokens, _ = generate(watermark=0.1)
    assert gated_tokens == eager_tokens == watermark_tokens  # greedy tokens do not depend on admission
    assert eager_preemptions > 0, "the small KV cache was meant to force preemptions under eager admission"
    assert gated_preemptions < eager_preemptions


# ---------------------------------------------------------------- through vllite serve
def test_serve_takes_the_flags():
    from vllite.plugins.openai_server.testing import RemoteServer

    args = ["--no-scheduler-reserve-full-isl", "--watermark", "0.05", "--max-model-len", "256"]
    with RemoteServer(args, env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        with urllib.request.urlopen(server.url + "/server_info?config_format=json", timeout=60) as response:
            config = json.loads(response.read())["vllm_config"]["scheduler_config"]
        body = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["finish_reason"] == "length"
    assert (config["scheduler_reserve_full_isl"], config["watermark"]) == (False, 0.05)


def test_serve_refuses_a_bad_watermark():
    env = {**os.environ, "VLLITE_ENABLE_MULTIPROCESSING": "1"}
    argv = [sys.executable, "-m", "vllite.cli", "serve", "--port", "0", "--watermark", "1.5"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "watermark must be a number in [0, 1)" in result.stderr and "1.5" in result.stderr
