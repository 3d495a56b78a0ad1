"""Fault isolation (issue 13): a plugin that raises while serving one request ends that request only.

Eight good requests run beside one bad one (marked by ``SamplingParams.extra_args["fault"]``) through plugins
that raise in one hook each: the scheduler policy's ``on_request_arrival``, ``on_request_admitted``,
``on_request_finished`` and ``on_step_start``, and a per-request logits processor's ``apply``. In-process, in the
engine-core process and through ``AsyncLLM``: the bad request finishes with ``finish_reason="error"`` and a message
naming the plugin and the hook (except ``on_step_start``, which cannot be pinned to a request: the step goes on
without it), the good ones equal their greedy reference, the engine serves the next round, and every KV block is
free at the end. Also: engine-side request checks (hostile frames), ``max_logprobs`` at submit, the ``n`` cap,
and a KV cache too small for one sequence.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from vllite.logits_processor import AdapterLogitsProcessor, LogitsProcessors
from vllite.protocol import EngineCoreRequest, FinishReason
from vllite.request import Request
from vllite.sampling_params import SamplingParams
from vllite.sched import Scheduler

MAX_TOKENS = 8
SCHED = f"{__name__}:RaisingScheduler"
LOGITSPROC = f"{__name__}:RaisingLogitsProcessor"
PROMPTS = [[10 + (7 * i + 3 * j) % 90 for j in range(5 + 3 * i)] for i in range(9)]
BAD = 4  # the index of the bad request among the nine


def _fault(request: Request) -> str | None:
    return (request.sampling_params.extra_args or {}).get("fault")


class RaisingScheduler(Scheduler):
    """FCFS, but each hook raises for a request whose ``extra_args["fault"]`` names it."""

    def on_request_arrival(self, request: Request) -> None:
        if _fault(request) == "on_request_arrival":
            raise RuntimeError("arrival hook failed")

    def on_request_admitted(self, request: Request) -> None:
        if _fault(request) == "on_request_admitted":
            raise KeyError("admitted hook failed")

    def on_request_finished(self, request: Request) -> bool:
        if _fault(request) == "on_request_finished":
            raise ValueError("finished hook failed")  # before freeing: the engine must free the blocks itself
        return super().on_request_finished(request)

    def on_step_start(self) -> None:
        if any(_fault(r) == "on_step_start" for r in self.requests.values()) and FAULT_RNG.random() < 0.5:
            raise RuntimeError("step hook failed")


class RaisingLogitsProcessor(AdapterLogitsProcessor):
    """Per-request: raises at output token ``extra_args["fault_at"]`` (default 2) of a request whose
    ``extra_args["fault"]`` is ``"apply"``."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        extra = params.extra_args or {}
        if extra.get("fault") != "apply":
            return None
        fault_at = int(extra.get("fault_at", 2))

        def raise_at_fault_token(output_ids, logits_row):
            if len(output_ids) >= fault_at:
                raise ZeroDivisionError("logits processor failed")
            return logits_row

        return raise_at_fault_token


FAULTS = {
    "on_request_arrival": "RaisingScheduler.on_request_arrival raised RuntimeError",
    "on_request_admitted": "RaisingScheduler.on_request_admitted raised KeyError",
    "on_request_finished": "RaisingScheduler.on_request_finished raised ValueError",
    "apply": "RaisingLogitsProcessor.apply raised ZeroDivisionError",
    "on_step_start": None,  # not pinned to a request: nothing fails
}


# Where a fault strikes is drawn at random (seeded, so a failure reproduces): the output token at which the
# logits processor raises, and the steps on which the step hook raises.
FAULT_RNG = random.Random(int(os.environ.get("VLLITE_FAULT_SEED", "13")))


def _params(fault: str | None = None) -> SamplingParams:
    extra = {"fault": fault, "fault_at": FAULT_RNG.randrange(MAX_TOKENS - 1)} if fault else None
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, extra_args=extra)


def _make_llm(monkeypatch: pytest.MonkeyPatch, multiprocess: bool, **kwargs):
    from vllite import LLM
    from vllite.testing import make_tiny_model_dir_cached

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1" if multiprocess else "0")
    return LLM(
        str(make_tiny_model_dir_cached("llama")),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=64,
        **kwargs,
    )


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    mp = pytest.MonkeyPatch()
    llm = _make_llm(mp, multiprocess=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
        mp.undo()


def _check_round(outs, fault: str, reference: list[list[int]]) -> None:
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        expected_error = FAULTS[fault] if i == BAD else None
        if expected_error is None:
            assert completion.finish_reason == "length" and completion.error is None, (fault, i, completion)
            assert completion.token_ids == reference[i], (fault, i)
        else:
            assert completion.finish_reason == "error", (fault, completion)
            assert expected_error in (completion.error or ""), completion.error
            assert f"{__name__}." in completion.error  # the plugin's full class path


def _run_rounds(llm, reference: list[list[int]]) -> None:
    for fault in FAULTS:
        params = [_params(fault if i == BAD else None) for i in range(len(PROMPTS))]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        _check_round(outs, fault, reference)
    # The engine serves new requests afterwards, with the same results.
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_faulty_plugins_in_process_fail_only_their_request(monkeypatch, reference):
    llm = _make_llm(monkeypatch, multiprocess=False, scheduler_cls=SCHED, logits_processors=[LOGITSPROC])
    try:
        _run_rounds(llm, reference)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert isinstance(scheduler, RaisingScheduler) and not scheduler.requests
        assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.fail_after_step
    finally:
        llm.shutdown()


def test_faulty_plugins_in_the_engine_process_fail_only_their_request(monkeypatch, reference):
    llm = _make_llm(monkeypatch, multiprocess=True, scheduler_cls=SCHED, logits_processors=[LOGITSPROC])
    try:
        assert llm.llm_engine.engine_info.scheduler == "RaisingScheduler"
        _run_rounds(llm, reference)
        assert llm.llm_engine.engine_core.call_utility("get_kv_cache_usage") == 0.0
        assert llm.llm_engine.engine_core.call_utility("get_request_counts") == [0, 0]
    finally:
        llm.shutdown()


def test_faulty_plugins_through_async_llm(reference):
    from vllite.plugins.engine_proc.async_llm import AsyncLLM
    from vllite.testing import make_tiny_model_dir_cached

    engine = AsyncLLM(
        model=str(make_tiny_model_dir_cached("llama")),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=64,
        scheduler_cls=SCHED,
        logits_processors=[LOGITSPROC],
    )

    async def one(i: int, fault: str | None):
        final = None
        async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, _params(fault), f"{fault}-{i}"):
            final = out
        return final

    async def main():
        for fault in ("on_request_arrival", "apply", "on_request_admitted"):
            outs = await asyncio.wait_for(
                asyncio.gather(*(one(i, fault if i == BAD else None) for i in range(len(PROMPTS)))), 60
            )
            _check_round(outs, fault, reference)
        outs = await asyncio.wait_for(asyncio.gather(*(one(i, None) for i in range(len(PROMPTS)))), 60)
        assert [o.outputs[0].token_ids for o in outs] == reference

    try:
        asyncio.run(main())
        assert engine.engine_core.call_utility("get_kv_cache_usage") == 0.0
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- pieces
def test_batch_level_processor_that_raises_fails_every_row_and_keeps_the_logits():
    import torch

    class Boom:
        def is_argmax_invariant(self):
            return False

        def apply(self, logits):
            logits[0, 0] = 5.0  # a half-written batch: every row must fail
            raise IndexError("row 7")

    procs = LogitsProcessors([Boom()])  # type: ignore[list-item]
    logits = torch.zeros(3, 4)
    assert procs.apply_non_argmax_invariant(logits).shape == (3, 4)
    failed = procs.take_failed_rows()
    assert sorted(failed) == [0, 1, 2] and "Boom.apply raised IndexError: row 7" in failed[0]
    assert procs.take_failed_rows() == {}


def _engine_core():
    from vllite.engine.core import EngineCore
    from vllite.engine_args import EngineArgs
    from vllite.testing import make_tiny_model_dir_cached

    config = EngineArgs(
        model=str(make_tiny_model_dir_cached("llama")),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=40,
    ).create_engine_config()
    return EngineCore(config)


HOSTILE = {
    "negative token id": ([3, -1, 5], {}),
    "token id past the vocabulary": ([3, 10**9], {}),
    "logprobs above the vocabulary": ([3, 4], {"logprobs": 10**6}),
    "prompt_logprobs above the vocabulary": ([3, 4], {"prompt_logprobs": 10**6}),
    "logit_bias key past the vocabulary": ([3, 4], {"logit_bias": {10**9: 1.0}}),
    "allowed_token_ids past the vocabulary": ([3, 4], {"allowed_token_ids": [10**9]}),
    "n above one at the engine": ([3, 4], {"n": 2}),
    "prompt longer than max_model_len": ([3] * 65, {}),
    "empty prompt": ([], {}),
}


def test_hostile_requests_are_rejected_with_an_error_output_and_the_engine_goes_on():
    core = _engine_core()
    try:
        for i, (prompt, kwargs) in enumerate(HOSTILE.values()):
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, **kwargs)
            core.add_request(EngineCoreRequest(f"bad-{i}", prompt, params, None, time.time()))
        core.add_request(EngineCoreRequest("good", [3, 4, 5], SamplingParams(max_tokens=3), None, time.time()))
        finished = {}
        for _ in range(20):
            outputs, _ = core.step()
            for out in (o for eco in outputs.values() for o in eco.outputs):
                if out.finished:
                    finished[out.request_id] = out
            if len(finished) == len(HOSTILE) + 1:
                break
        assert finished["good"].finish_reason == FinishReason.LENGTH
        for i, name in enumerate(HOSTILE):
            out = finished[f"bad-{i}"]
            assert out.finish_reason == FinishReason.ERROR and out.error and f"'bad-{i}'" in out.error, (name, out)
        assert core.scheduler.kv_cache_manager.usage == 0.0
    finally:
        core.shutdown()


def test_hostile_frame_to_the_engine_process_gets_an_error_output(monkeypatch):
    llm = _make_llm(monkeypatch, multiprocess=True)
    try:
        client = llm.llm_engine.engine_core
        params = SamplingParams(max_tokens=2, logprobs=10**6, temperature=0.0)
        client.add_request(EngineCoreRequest("hostile", [3, -5], params, None, time.time()))
        deadline = time.monotonic() + 30
        out = None
        while out is None and time.monotonic() < deadline:
            out = next((o for o in client.get_output().outputs if o.request_id == "hostile"), None)
        assert out is not None and out.finish_reason == FinishReason.ERROR and "prompt_token_ids" in out.error
        outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], _params(), use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "length"  # still serving
    finally:
        llm.shutdown()


def test_logprobs_above_max_logprobs_are_rejected_at_submit(monkeypatch):
    llm = _make_llm(monkeypatch, multiprocess=True, max_logprobs=5)
    try:
        for name in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=f"{name}=6.*max_logprobs=5"):
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(**{name: 6}), use_tqdm=False)
            with pytest.raises(ValueError, match=f"{name}=-1"):
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(**{name: -1}), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, logprobs=5), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) >= 5  # the engine is alive and serves the limit itself
    finally:
        llm.shutdown()


def test_logprobs_above_the_vocabulary_with_no_limit_are_rejected_at_submit(monkeypatch):
    llm = _make_llm(monkeypatch, multiprocess=False, max_logprobs=-1)
    try:
        vocab = llm.llm_engine.engine_info.vocab_size
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(logprobs=vocab + 1), use_tqdm=False)
        out = llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False
        )
        assert len(out[0].outputs[0].logprobs[0]) >= vocab
    finally:
        llm.shutdown()


def test_n_is_capped():
    from vllite.sampling_params import MAX_N

    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be an integer in \[1, 128\]"):
        SamplingParams(n=100_000)


def test_kv_cache_override_too_small_for_a_fixed_max_model_len_fails_at_start_up():
    from vllite.engine.core import EngineCore
    from vllite.engine_args import EngineArgs
    from vllite.exceptions import KVCacheMemoryError
    from vllite.testing import make_tiny_model_dir_cached

    args = dict(model=str(make_tiny_model_dir_cached("llama")), dtype="float32", skip_tokenizer_init=True)
    small = EngineArgs(max_model_len=64, block_size=4, num_gpu_blocks_override=8, **args).create_engine_config()
    with pytest.raises(KVCacheMemoryError, match=r"num_gpu_blocks_override=8 .* max_model_len=64"):
        EngineCore(small)
    shrunk = EngineCore(EngineArgs(block_size=4, num_gpu_blocks_override=8, **args).create_engine_config())
    try:
        assert shrunk.info.max_model_len == 28  # 7 usable blocks of 4 tokens: the context shrinks to fit
    finally:
        shrunk.shutdown()


def test_request_that_can_never_fit_the_kv_cache_ends_with_error_instead_of_spinning():
    from vllite.sched import create_scheduler
    from vllite.testing import ScriptedModelRunner, make_config, make_request

    scheduler = create_scheduler(make_config(max_model_len=64, block_size=4), 1 + 4)  # 16 tokens of KV
    runner = ScriptedModelRunner()
    request = make_request(scheduler, "long", list(range(10, 30)), max_tokens=4)  # 20 tokens: can never fit
    scheduler.add_request(request)
    for _ in range(5):
        so = scheduler.schedule()
        scheduler.update_from_output(so, runner.execute(so))
    assert request.status.name == "FINISHED_ERROR" and "cannot hold request 'long'" in (request.error or "")
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_manager.usage == 0.0


class VictimRaisingScheduler(Scheduler):
    """Raises in the preemption-path hooks for a request whose ``extra_args["fault"]`` names the hook."""

    def on_running_allocation_failed(self, request: Request) -> bool:
        if _fault(request) == "on_running_allocation_failed":
            raise RuntimeError("allocation hook failed")
        return False

    def select_preemption_victim(self, running, request: Request) -> Request:
        if _fault(request) == "select_preemption_victim":
            raise RuntimeError("victim hook failed")
        if _fault(request) == "select_preemption_victim:stranger":
            return Request("not-running", [1], SamplingParams())  # not a member of running
        return super().select_preemption_victim(running, request)

    def on_admission_blocked(self, request: Request) -> bool:
        if _fault(request) == "on_admission_blocked":
            raise RuntimeError("admission hook failed")
        return False


@pytest.mark.parametrize(
    ("fault", "hook"),
    [
        ("on_running_allocation_failed", "on_running_allocation_failed raised RuntimeError"),
        ("select_preemption_victim", "select_preemption_victim raised RuntimeError"),
        ("select_preemption_victim:stranger", "select_preemption_victim raised ValueError"),
    ],
)
def test_preemption_hook_that_raises_fails_the_request_that_needed_blocks(fault, hook):
    from vllite.testing import ScriptedModelRunner, make_config, make_request

    # 8 usable blocks of 4 tokens; two 10-token prompts decoding 12 tokens each (6 blocks each) cannot both stay.
    scheduler = VictimRaisingScheduler(make_config(max_model_len=64, block_size=4), 1 + 8)
    runner = ScriptedModelRunner()
    good = make_request(scheduler, "good", list(range(10, 20)), max_tokens=12, ignore_eos=True)
    bad = make_request(
        scheduler, "bad", list(range(40, 50)), max_tokens=12, ignore_eos=True, extra_args={"fault": fault}
    )
    scheduler.add_request(bad)  # admitted first: it is the first to need a 5th block, so the hook is asked for it
    scheduler.add_request(good)
    outputs = []
    for _ in range(40):
        so = scheduler.schedule()
        outputs += [o for eco in scheduler.update_from_output(so, runner.execute(so)).values() for o in eco.outputs]
        if not scheduler.has_requests():
            break
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["bad"].finish_reason == FinishReason.ERROR and hook in (finished["bad"].error or "")
    assert "VictimRaisingScheduler" in finished["bad"].error
    assert finished["good"].finish_reason == FinishReason.LENGTH and len(good.output_token_ids) == 12
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.requests


def test_admission_hook_that_raises_fails_the_blocked_request_only():
    from vllite.testing import ScriptedModelRunner, make_config, make_request

    scheduler = VictimRaisingScheduler(make_config(max_model_len=64, block_size=4), 1 + 8)
    runner = ScriptedModelRunner()
    first = make_request(scheduler, "first", list(range(10, 34)), max_tokens=4, ignore_eos=True)  # 6 of 8 blocks
    bad = make_request(
        scheduler, "bad", list(range(40, 50)), max_tokens=2, extra_args={"fault": "on_admission_blocked"}
    )
    scheduler.add_request(first)
    scheduler.add_request(bad)
    outputs = []
    for _ in range(20):
        so = scheduler.schedule()
        outputs += [o for eco in scheduler.update_from_output(so, runner.execute(so)).values() for o in eco.outputs]
        if not scheduler.has_requests():
            break
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "VictimRaisingScheduler.on_admission_blocked raised RuntimeError" in (finished["bad"].error or "")
    assert finished["first"].finish_reason == FinishReason.LENGTH
    assert scheduler.kv_cache_manager.usage == 0.0
