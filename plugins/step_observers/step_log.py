"""What the engine logs about the execution of its steps (vLLM's ``EngineCore.log_error_detail`` and
``log_iteration_details``): the builtin step wrapper ``step_log`` (hook ``vllite_register_step_wrappers``), which
every engine core enters around each step's execution.

- A step whose execution raises is dumped once, at ERROR, before the exception goes on as it always did (the
  multiprocess engine dies with it, ``EngineDeadError`` for its clients): the step's schedule (prompts as their
  lengths, not their tokens) and the state of each request it scheduled, so that the failure can be reproduced.
  Writing the dump never raises.
- With ``--enable-logging-iteration-details`` every step that ran tokens logs, at INFO, its context (prefill)
  and generation requests and tokens and how long it took, in vLLM's words.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllite.hookspecs import Register, hookimpl
from vllite.version import __version__

if TYPE_CHECKING:
    from vllite.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IterationDetails:
    """One step's requests and tokens: context (still prefilling: no output token yet) and generation."""

    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int


def compute_iteration_details(scheduler_output: SchedulerOutput) -> IterationDetails:
    """vLLM's split: a new request, or a known one without output tokens, is in its context phase."""
    cached = scheduler_output.scheduled_cached_reqs
    context = {new.req_id for new in scheduler_output.scheduled_new_reqs}
    context.update(rid for rid, n in zip(cached.req_ids, cached.num_output_tokens, strict=False) if n == 0)
    ctx_tokens = gen_tokens = ctx_reqs = 0
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        if req_id in context:
            ctx_reqs += 1
            ctx_tokens += num_tokens
        else:
            gen_tokens += num_tokens
    num_reqs = len(scheduler_output.num_scheduled_tokens)
    return IterationDetails(ctx_reqs, ctx_tokens, num_reqs - ctx_reqs, gen_tokens)


class StepLog:
    """Wraps each step's execution (``with step_log.around(scheduler_output): ...``) for the dump and the
    iteration details; ``scheduler`` is read only when a step fails. Built once per engine core."""

    def __init__(self, config: Any, scheduler: Any) -> None:
        self.config = config
        self.scheduler = scheduler
        self.log_iteration_details = bool(config.observability_config.enable_logging_iteration_details)
        self.iteration_index = 0
        if self.log_iteration_details and not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)  # the flag asks for these lines, whatever the engine's log level

    @contextmanager
    def around(self, scheduler_output: SchedulerOutput) -> Iterator[None]:
        """Runs the step's execution: dumps the step if it raises (and re-raises), logs its details if asked to."""
        start = time.monotonic()
        try:
            yield
        except Exception:
            dump_engine_exception(self.config, scheduler_output, self.scheduler)
            raise
        if self.log_iteration_details and scheduler_output.total_num_scheduled_tokens > 0:
            details = compute_iteration_details(scheduler_output)
            logger.info(
                "Iteration(%d): %d context requests, %d context tokens, %d generation requests, %d generation "
                "tokens, iteration elapsed time: %.2f ms",
                self.iteration_index,
                details.num_ctx_requests,
                details.num_ctx_tokens,
                details.num_generation_requests,
                details.num_generation_tokens,
                (time.monotonic() - start) * 1000,
            )
            self.iteration_index += 1


def dump_engine_exception(config: Any, scheduler_output: SchedulerOutput, scheduler: Any) -> None:
    """Logs (one ERROR record) the schedule of the step that raised and its requests' state; never raises."""
    try:
        counts = scheduler.get_request_counts() if hasattr(scheduler, "get_request_counts") else None
        logger.error(
            "Dumping input data of the failed engine step (vllite %s, model %s):\n"
            "scheduler output: %s\nrequest states: %s\nscheduler: running/waiting=%s",
            __version__,
            config.model_config.model,
            describe_scheduler_output(scheduler_output),
            describe_requests(scheduler, scheduler_output.num_scheduled_tokens),
            counts,
        )
    except Exception:
        logger.exception("Error preparing the dump of the failed engine step")


def describe_scheduler_output(so: SchedulerOutput) -> dict[str, Any]:
    """``so`` as plain values, prompts as their lengths (vLLM's ``anon_repr``)."""
    cached = so.scheduled_cached_reqs
    return {
        "scheduled_new_reqs": [
            {
                "req_id": new.req_id,
                "num_prompt_tokens": len(new.prompt_token_ids),
                "num_computed_tokens": new.num_computed_tokens,
                "num_output_tokens": len(new.output_token_ids),
                "num_blocks": len(new.block_ids),
                "sampling_params": new.sampling_params,
            }
            for new in so.scheduled_new_reqs
        ],
        "scheduled_cached_reqs": {
            "req_ids": cached.req_ids,
            "num_computed_tokens": cached.num_computed_tokens,
            "num_output_tokens": cached.num_output_tokens,
        },
        "num_scheduled_tokens": so.num_scheduled_tokens,
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "scheduled_spec_decode_tokens": {rid: len(t) for rid, t in so.scheduled_spec_decode_tokens.items()},
        "finished_req_ids": sorted(so.finished_req_ids),
        "preempted_req_ids": sorted(so.preempted_req_ids),
    }


def describe_requests(scheduler: Any, req_ids: Any) -> list[str]:
    """The scheduler's state of each of ``req_ids`` (status, tokens, computed and output tokens)."""
    requests = getattr(scheduler, "requests", {})
    states = []
    for req_id in req_ids:
        request = requests.get(req_id)
        if request is None:
            states.append(f"{req_id!r}: unknown to the scheduler")
            continue
        states.append(
            f"{req_id!r}: status={request.status.name} prompt={request.num_prompt_tokens} "
            f"computed={request.num_computed_tokens} output={request.num_output_tokens}"
        )
    return states


@hookimpl
def vllite_register_step_wrappers(register: Register) -> None:
    register("step_log", StepLog)
