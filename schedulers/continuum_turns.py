"""What Continuum knows about one request (one agent turn): its job, whether it is the job's last step, and the
tool calls around it. Read once from ``SamplingParams.extra_args`` and kept in ``request.extra["continuum"]``.

Clients send, per request (OpenAI ``extra_body`` / ``vllm_xargs`` → ``extra_args``, as the released fork does):

- ``job_id`` (str or int): the agent program the turn belongs to. ``None`` or ``""`` = no job (never pinned);
  any other value, ``0`` included, names a job (``str(job_id)``).
- ``is_last_step`` (bool): the job ends with this turn; its pins are released and nothing is pinned.
- ``this_func_call`` (str, optional): the tool this turn calls; wins over server-side parsing.
- ``last_func_call`` (str, optional): the tool the previous turn called; wins over what the server recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllite.request import Request

EXTRA_KEY = "continuum"


@dataclass(slots=True)
class TurnInfo:
    """Continuum's per-request state. ``job_arrival`` is the arrival time of the job's first request (the key
    of program-level FCFS); ``arrived_at`` the scheduler clock at arrival; ``evicted`` whether it is a later turn
    of a known job that held no pin when it arrived (its wait until admission feeds the estimator's T);
    ``admitted`` whether it was admitted at least once."""

    job_id: str | None
    is_last_step: bool = False
    this_func_call: str | None = None
    last_func_call: str | None = None
    job_arrival: float = 0.0
    arrived_at: float = 0.0
    evicted: bool = False
    admitted: bool = False


def _opt_str(value: object) -> str | None:
    if value is None or value == "":
        return None
    return str(value)


def turn_info(request: Request) -> TurnInfo:
    """The request's :class:`TurnInfo`, built from ``sampling_params.extra_args`` on first use."""
    info = request.extra.get(EXTRA_KEY)
    if info is None:
        args = request.sampling_params.extra_args or {}
        info = TurnInfo(
            job_id=_opt_str(args.get("job_id")),
            is_last_step=bool(args.get("is_last_step", False)),
            this_func_call=_opt_str(args.get("this_func_call")),
            last_func_call=_opt_str(args.get("last_func_call")),
            job_arrival=request.arrival_time,
        )
        request.extra[EXTRA_KEY] = info
    return info
