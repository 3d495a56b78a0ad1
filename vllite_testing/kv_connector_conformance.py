"""A conformance kit for KV connector authors: checks a connector against the contract, end to end, on a tiny
model in an in-process engine.

Two ways to use it from a connector's own test suite:

- ``run_conformance(kv_transfer_config)`` from any test; it raises ``KVConnectorConformanceError`` naming the
  first broken rule and returns a ``ConformanceReport`` (what the workload exercised) otherwise;
- ``from vllite.testing.kv_connector_conformance import *`` in a test module that defines a ``connector_under_test``
  fixture returning ``(kv_transfer_config, settings)``: pytest then collects ``test_kv_connector_conformance``
  (``settings`` are ``run_conformance``'s keyword arguments, ``{}`` for the defaults).

The rules checked: both roles construct (with their ``role``); ``get_num_new_matched_tokens`` gives the same
answer when asked twice (a ``None`` answer, "ask again later", is exempt), never claims the last prompt token, and
is never asynchronous with 0 tokens; ``request_finished`` is called exactly once per request, aborted ones
included; a delayed free keeps the request's blocks allocated until ``finished_sending`` names the request, and
every delayed free ends; after the workload (two passes over prompts sharing prefixes, the prefix cache reset in
between so that the second pass asks the connector, plus aborts before and during a request's first steps) every
KV block is free; and greedy token ids equal those of the same engine without a connector (pass
``check_outputs=False`` for a connector that claims tokens it does not really load, as ``MockKVConnector``).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.exceptions import VlliteError
from vllite.kv_connector.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from vllite.kv_connector.config import KVTransferConfig
from vllite.kv_connector.factory import create_connector


class KVConnectorConformanceError(VlliteError, AssertionError):
    """A KV connector broke a rule of the contract under ``vllite.testing.kv_connector_conformance`` (an
    ``AssertionError`` too, so pytest reports it as a failed check); the message names the rule."""


if TYPE_CHECKING:
    from vllite.engine.llm_engine import LLMEngine
    from vllite.engine_args import EngineArgs
    from vllite.request import Request
    from vllite.sched import Scheduler

__all__ = [
    "ConformanceReport",
    "KVConnectorConformanceError",
    "check_roles_construct",
    "run_conformance",
    "test_kv_connector_conformance",
]

#: Engine settings of the conformance workload (small blocks and cache so that prefixes span several blocks).
DEFAULT_ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 128,
    "num_gpu_blocks_override": 96,
    "max_num_seqs": 4,
}


@dataclass
class ConformanceReport:
    """What the workload exercised: requests, aborts, lookups, external tokens claimed, delayed frees."""

    num_requests: int = 0
    num_aborted: int = 0
    num_lookups: int = 0
    num_deferrals: int = 0
    num_external_tokens: int = 0
    num_async_loads: int = 0
    num_delayed_frees: int = 0
    outputs: list[list[int]] = field(default_factory=list)


def _fail(rule: str, detail: str) -> KVConnectorConformanceError:
    return KVConnectorConformanceError(f"KV connector conformance: {rule}: {detail}")


def _as_config(kv_transfer_config: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
    if isinstance(kv_transfer_config, KVTransferConfig):
        return kv_transfer_config
    return KVTransferConfig.from_json(kv_transfer_config)


def check_roles_construct(kv_transfer_config: KVTransferConfig | dict[str, Any] | str, model: str | Path) -> None:
    """Both roles of the configured connector construct, as ``KVConnectorBase`` instances with their ``role``."""
    kv = _as_config(kv_transfer_config)
    config = _engine_args(model, None, {}).create_engine_config()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        connector = create_connector(config, role, kv)
        if not isinstance(connector, KVConnectorBase) or connector.role is not role:
            raise _fail("roles", f"{type(connector).__name__} built for {role.name} has role {connector.role!r}")
        connector.shutdown()


class _Recorder:
    """Wraps the scheduler-role connector's methods (instance attributes) to check the rules as the engine runs.

    A broken rule is recorded, not raised: the scheduler isolates a connector's exceptions (it fails the request),
    so ``run_conformance`` raises the first one after the workload."""

    def __init__(self, scheduler: Scheduler, report: ConformanceReport) -> None:
        connector: KVConnectorBase | None = getattr(scheduler, "connector", None)
        if connector is None:
            raise _fail("setup", "the engine built no scheduler-role connector")
        self.scheduler = scheduler
        self.report = report
        self.finished: Counter[str] = Counter()
        self.pending_sends: dict[str, list[int]] = {}
        self.violations: list[KVConnectorConformanceError] = []
        self._lookup = connector.get_num_new_matched_tokens
        self._finished = connector.request_finished
        self._output = connector.update_connector_output
        connector.get_num_new_matched_tokens = self.get_num_new_matched_tokens  # type: ignore[method-assign]
        connector.request_finished = self.request_finished  # type: ignore[method-assign]
        connector.update_connector_output = self.update_connector_output  # type: ignore[method-assign]

    def _violate(self, rule: str, detail: str) -> None:
        self.violations.append(_fail(rule, detail))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        first = self._lookup(request, num_computed_tokens)
        self.report.num_lookups += 1
        num, is_async = first
        if num is None:
            self.report.num_deferrals += 1
            return first
        again = self._lookup(request, num_computed_tokens)
        if again != first:
            self._violate("side-effect free lookup", f"request {request.request_id!r}: {first} then {again}")
        if not isinstance(num, int) or num < 0:
            self._violate("lookup", f"request {request.request_id!r}: {num!r} is not a token count")
            return first
        if num_computed_tokens + num >= request.num_tokens:
            self._violate(
                "last prompt token",
                f"request {request.request_id!r}: {num_computed_tokens} computed + {num} external tokens "
                f">= {request.num_tokens} tokens",
            )
        if num == 0 and is_async:
            self._violate("lookup", f"request {request.request_id!r}: is_async=True with 0 tokens")
        self.report.num_external_tokens += num
        self.report.num_async_loads += bool(is_async)
        return first

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self.finished[request_id] += 1
        if self.finished[request_id] > 1:
            self._violate("request_finished once", f"request {request_id!r} finished twice")
        delay_free, params = self._finished(request, block_ids)
        if delay_free:
            self.report.num_delayed_frees += 1
            self.pending_sends[request_id] = list(block_ids)
        return delay_free, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        blocks = self.scheduler.kv_cache_manager.block_pool.blocks
        for request_id, block_ids in self.pending_sends.items():
            freed = [b for b in block_ids if blocks[b].ref_cnt <= 0]
            if freed:
                self._violate("delayed free", f"request {request_id!r}: blocks {freed} freed before finished_sending")
        for request_id in connector_output.finished_sending:
            self.pending_sends.pop(request_id, None)
        self._output(connector_output)


def _prompts(seed: int, num_prompts: int) -> list[list[int]]:
    """Prompts of 14..40 tokens; pairs share 8- or 16-token prefixes so prefixes recur across requests."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 90) for _ in range(16)] for _ in range(2)]
    return [
        prefixes[i % 2][: 16 if i % 3 else 8] + [rng.randrange(3, 90) for _ in range(rng.randint(6, 24))]
        for i in range(num_prompts)
    ]


def _engine_args(model: str | Path, kv: KVTransferConfig | None, engine_kwargs: dict[str, Any]) -> EngineArgs:
    from vllite.engine_args import EngineArgs

    settings = {**DEFAULT_ENGINE_KWARGS, **engine_kwargs}
    transfer = json.dumps(asdict(kv)) if kv is not None else None
    return EngineArgs(model=str(model), skip_tokenizer_init=True, kv_transfer_config=transfer, **settings)


def _engine(model: str | Path, kv: KVTransferConfig | None, engine_kwargs: dict[str, Any]) -> LLMEngine:
    from vllite.engine.llm_engine import LLMEngine

    return LLMEngine(_engine_args(model, kv, engine_kwargs).create_engine_config(), multiprocess=False)


def _scheduler(engine: LLMEngine) -> Scheduler:
    return engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    from vllite.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)]
    done: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done.get(i, []) for i in ids]


def _aborts(engine: LLMEngine, prompts: list[list[int]], tag: str) -> int:
    """Aborts one request before any step (waiting, or parked for a load) and one after two steps."""
    from vllite.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request(f"{tag}-early", {"prompt_token_ids": prompts[0]}, params)
    engine.abort_request(f"{tag}-early")
    engine.add_request(f"{tag}-late", {"prompt_token_ids": prompts[1]}, params)
    for _ in range(2):
        engine.step()
    engine.abort_request(f"{tag}-late")
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return 2


def _settle(engine: LLMEngine, limit: int = 1_000) -> None:
    """Steps the engine core until the scheduler holds nothing (delayed frees end on empty steps too)."""
    core = engine.engine_core.engine_core  # type: ignore[attr-defined]
    manager = _scheduler(engine).kv_cache_manager
    for _ in range(limit):
        if not core.scheduler.has_requests() and manager.num_free_blocks == manager.num_blocks - 1:
            return
        core.step()


def run_conformance(
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str,
    model: str | Path | None = None,
    *,
    check_outputs: bool = True,
    engine_kwargs: dict[str, Any] | None = None,
    num_prompts: int = 6,
    max_tokens: int = 6,
    seed: int = 0,
) -> ConformanceReport:
    """Checks the configured connector against the contract (see the module docstring); raises
    ``KVConnectorConformanceError`` naming the first broken rule. ``model`` defaults to a tiny cached Llama;
    ``engine_kwargs`` override ``DEFAULT_ENGINE_KWARGS`` (``EngineArgs`` fields)."""
    from vllite.testing import make_tiny_model_dir_cached

    kv = _as_config(kv_transfer_config)
    model = model if model is not None else make_tiny_model_dir_cached("llama")
    settings = dict(engine_kwargs or {})
    check_roles_construct(kv, model)
    prompts = _prompts(seed, num_prompts)
    report = ConformanceReport()
    engine = _engine(model, kv, settings)
    try:
        scheduler = _scheduler(engine)
        recorder = _Recorder(scheduler, report)
        for phase in ("cold", "warm"):
            report.outputs += _generate(engine, prompts, max_tokens, phase)
            report.num_aborted += _aborts(engine, prompts, f"{phase}-abort")
            report.num_requests += len(prompts) + 2
            _settle(engine)
            engine.reset_prefix_cache()  # the second pass asks the connector, not the local prefix cache
        _check_end_state(scheduler, recorder, report)
    finally:
        engine.shutdown()
    if check_outputs:
        reference = _engine(model, None, settings)
        try:
            expected = _generate(reference, prompts, max_tokens, "ref")
        finally:
            reference.shutdown()
        for i, got in enumerate(report.outputs):
            if got != expected[i % len(prompts)]:
                raise _fail("greedy outputs", f"prompt {i % len(prompts)}: {got} with the connector, {expected}")
    return report


def _check_end_state(scheduler: Scheduler, recorder: _Recorder, report: ConformanceReport) -> None:
    if recorder.violations:
        raise recorder.violations[0]
    if recorder.pending_sends:
        raise _fail("delayed free", f"never released: {sorted(recorder.pending_sends)}")
    if len(recorder.finished) != report.num_requests or set(recorder.finished.values()) != {1}:
        raise _fail(
            "request_finished once",
            f"{report.num_requests} requests, request_finished calls per request: {dict(recorder.finished)}",
        )
    manager = scheduler.kv_cache_manager
    if manager.num_free_blocks != manager.num_blocks - 1:
        raise _fail("blocks freed", f"{manager.num_blocks - 1 - manager.num_free_blocks} blocks still allocated")


def test_kv_connector_conformance(connector_under_test: tuple[Any, dict[str, Any]]) -> None:
    """Collected by pytest where ``from vllite.testing.kv_connector_conformance import *`` is used next to a
    ``connector_under_test`` fixture returning ``(kv_transfer_config, run_conformance keyword arguments)``."""
    kv_transfer_config, settings = connector_under_test
    run_conformance(kv_transfer_config, **settings)
