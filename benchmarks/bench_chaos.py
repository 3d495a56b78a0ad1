"""Chaos benchmark: mixed good and faulty requests against one engine process, with engine kills and stops.

    python benchmarks/bench_chaos.py [--runs 6] [--requests 48] [--fault-rate 0.25] [--seed 0]

Each run starts an ``AsyncLLM`` (engine process, model-free ``PositionTokenExecutor`` so every good output is
known in advance: token ``1000 + position``) whose scheduler policy raises for marked requests, and streams a
mix of requests concurrently:

* good requests — their tokens must equal the reference exactly;
* faulty plugin calls — ``extra_args={"fault": "arrival" | "admit"}`` make the policy raise in
  ``on_request_arrival`` / ``on_request_admitted``;
* bad input — ``logprobs`` far above the vocabulary, token ids out of range.

Every other run ends with a fault of the engine itself while requests are in flight, alternately SIGKILL (the
client must notice the death) and SIGSTOP (the client must notice the silence, within
``VLLITE_ENGINE_HEARTBEAT_TIMEOUT_S``; set it low, e.g. 5, for this benchmark). It prints: requests served,
faults injected, requests lost (a good request that neither finished nor failed with an error before the run's
deadline — target 0), good outputs wrong (target 0), the engine-fault detection times (p50 / max), and what
leaked after shutdown: engine processes, file descriptors of this process, IPC directories and ``/dev/shm``
entries.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import random
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import _common as common

from vllite.policies.fcfs import FCFSScheduler
from vllite.request import Request
from vllite.sampling_params import RequestOutputKind, SamplingParams

EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"
TOKEN_BASE = 1000
RUN_DEADLINE_S = 60.0


class FaultyScheduler(FCFSScheduler):
    """FCFS, except that it raises in a policy hook for requests marked ``extra_args["fault"]``."""

    @staticmethod
    def _fault(request: Request) -> str | None:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        return (extra or {}).get("fault")

    def on_request_arrival(self, request: Request) -> None:
        if self._fault(request) == "arrival":
            raise RuntimeError(f"injected fault in on_request_arrival for {request.request_id}")
        super().on_request_arrival(request)

    def on_request_admitted(self, request: Request) -> None:
        if self._fault(request) == "admit":
            raise RuntimeError(f"injected fault in on_request_admitted for {request.request_id}")
        super().on_request_admitted(request)


@dataclass
class Tally:
    served: int = 0
    faults_injected: int = 0
    faults_contained: int = 0
    faults_uncontained: int = 0
    lost: int = 0
    wrong: int = 0
    failed_by_engine_fault: int = 0
    detection_s: dict[str, list[float]] = field(default_factory=lambda: {"kill": [], "stop": []})
    undetected: int = 0


def _kind(rng: random.Random, fault_rate: float) -> str:
    if rng.random() >= fault_rate:
        return "good"
    return rng.choice(["arrival", "admit", "logprobs", "token_ids"])


def _request(kind: str, index: int) -> tuple[Any, SamplingParams]:
    prompt = [1 + (index % 50)] * (4 + index % 7)
    params = SamplingParams(max_tokens=32 + index % 33, temperature=0.0, ignore_eos=True)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    if kind in ("arrival", "admit"):
        params.extra_args = {"fault": kind}
    elif kind == "logprobs":
        params.logprobs = 10**7
    elif kind == "token_ids":
        prompt = [10**9, *prompt]
    return {"prompt_token_ids": prompt}, params


async def _one(engine: Any, kind: str, index: int, tally: Tally) -> None:
    prompt, params = _request(kind, index)
    expected = [TOKEN_BASE + len(prompt["prompt_token_ids"]) + i for i in range(params.max_tokens or 0)]
    try:
        final = None
        async for out in engine.generate(prompt, params, request_id=f"r{index}"):
            final = out
    except Exception as exc:  # an error for this request: contained if it was a faulty one
        from vllite.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError):
            tally.failed_by_engine_fault += 1
        elif kind == "good":
            tally.lost += 1
        else:
            tally.faults_contained += 1
        return
    completion = final.outputs[0] if final is not None else None
    if kind != "good":
        errored = completion is not None and completion.finish_reason == "error"
        tally.faults_contained += int(errored)
        tally.faults_uncontained += int(not errored)
        return
    if completion is None:
        tally.lost += 1
    elif list(completion.token_ids) != expected:
        tally.wrong += 1
    else:
        tally.served += 1


async def _run(args: argparse.Namespace, run: int, rng: random.Random, tally: Tally) -> None:
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    engine = AsyncLLM(
        executor=EXECUTOR,
        skip_tokenizer_init=True,
        max_model_len=256,
        scheduler_cls=f"{__name__ if __name__ != '__main__' else 'bench_chaos'}:FaultyScheduler",
        plugin_config={"fake_executor": {"step_delay_s": args.step_delay}},
    )
    kinds = [_kind(rng, args.fault_rate) for _ in range(args.requests)]
    tally.faults_injected += sum(kind != "good" for kind in kinds)
    tasks = [asyncio.create_task(_one(engine, kind, run * 10_000 + i, tally)) for i, kind in enumerate(kinds)]
    engine_fault = run % 2 == 1 and ("kill", "stop")[(run // 2) % 2]
    pid = engine.engine_core.resources.proc.pid
    try:
        if engine_fault:
            await asyncio.sleep(args.fault_after)  # requests are in flight
            assert any(not task.done() for task in tasks), "every request finished before the engine fault"
            signalled = time.monotonic()
            os.kill(pid, signal.SIGKILL if engine_fault == "kill" else signal.SIGSTOP)
            _, pending = await asyncio.wait(tasks, timeout=RUN_DEADLINE_S)
            if pending:
                tally.undetected += 1
                for task in pending:
                    task.cancel()
            else:
                tally.detection_s[engine_fault].append(time.monotonic() - signalled)
        else:
            _, pending = await asyncio.wait(tasks, timeout=RUN_DEADLINE_S)
            tally.lost += len(pending)
            for task in pending:
                task.cancel()
    finally:
        if engine_fault == "stop":
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()
    print(f"run {run}: {len(kinds)} requests, engine fault: {engine_fault or 'none'}", flush=True)


def _leaks() -> tuple[int, int, int]:
    ipc = len(glob.glob(os.path.join(tempfile.gettempdir(), "vllite-*")))
    shm = len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0
    return len(os.listdir("/proc/self/fd")), ipc, shm


def _children() -> int:
    import multiprocessing

    return len([p for p in multiprocessing.active_children() if p.is_alive()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_plain_args(parser, runs=6, requests=48, fault_rate=0.25, seed=0)
    parser.add_argument("--step-delay", type=float, default=0.01, help="Simulated forward time per step (s).")
    parser.add_argument("--fault-after", type=float, default=0.2, help="Engine kill/stop this long into a run (s).")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tally = Tally()
    fds_before, ipc_before, shm_before = _leaks()
    for run in range(args.runs):
        asyncio.run(_run(args, run, rng, tally))
    time.sleep(1.0)  # let the killed engines' resources be reaped before counting leaks
    fds_after, ipc_after, shm_after = _leaks()
    print()
    print(f"requests:            {args.runs * args.requests} in {args.runs} runs")
    print(f"served (good, exact): {tally.served}")
    print(
        f"faults injected:      {tally.faults_injected} (ended as that request's error: {tally.faults_contained}, "
        f"served anyway: {tally.faults_uncontained})"
    )
    print(f"requests lost:        {tally.lost}   (target 0)")
    print(f"good outputs wrong:   {tally.wrong}   (target 0)")
    print(f"failed by engine kill/stop: {tally.failed_by_engine_fault}")
    for kind, times in tally.detection_s.items():
        if times:
            p50, worst = statistics.median(times), max(times)
            print(f"detection of SIG{kind.upper()}: p50 {p50:.2f} s, max {worst:.2f} s ({len(times)} faults)")
    print(f"engine faults never detected: {tally.undetected}")
    print(f"leaked engine processes: {_children()}")
    print(
        f"leaked fds: {fds_after - fds_before}, IPC dirs: {ipc_after - ipc_before}, "
        f"/dev/shm entries: {shm_after - shm_before}"
    )


if __name__ == "__main__":
    main()
