"""Agent-trace replay as sessions: each job is one resumable request whose turns arrive as input chunks.

``vllite bench agent --modes sessions`` replays the same trace, arrivals and tool calls as the stateless replay
(:mod:`vllite.plugins.bench.agent_bench`), but a job is one **session** (``vllite.engine.sessions``): its first turn's
prompt opens it (``resumable``), each later turn sends only the turn's new tokens (the tool's observation) as the
next input chunk, and the last turn's chunk is followed by the end of the input. The engine keeps the session's KV
between turns for as long as the scheduler's ``session_hold_seconds`` says (fcfs: ``session_idle_timeout_s``;
continuum: the tool's TTL), so a turn prefills only its new tokens unless its blocks were released meanwhile.

The replay loop is unchanged: it still builds each turn's full prompt (history + outputs + new tokens); the
session backends check that the engine's context is a prefix of it and send the rest. Two backends, in-process like
their stateless counterparts, so a comparison runs the same way on both sides:

- :class:`SimSessionBackend` — ``EngineCore`` on the simulated executor (virtual time);
- :class:`RealSessionBackend` — ``LLMEngine`` with a real model, through ``add_request(resumable=True)``,
  ``add_session_input`` and ``close_session_input`` (wall time).

Both count ``prompt_tokens_computed`` as the stateless backends do: per turn, the turn's whole context minus the
tokens it found computed (``len(prompt_token_ids) - num_cached_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllite.plugins.bench.agent_bench import RealBackend, SimBackend, StepEvents
from vllite.plugins.bench.agent_http import is_http_engine
from vllite.plugins.bench.errors import BenchReplayError
from vllite.sampling_params import SamplingParams

#: Replay modes: each turn a new stateless request (the history resent), or each job one session.
MODES = ("stateless", "sessions")


def check_mode(mode: str, engine: str) -> None:
    """``ValueError`` naming ``--modes`` for an unknown mode, or sessions against a server (the replay's sessions
    run in-process)."""
    if mode not in MODES:
        raise ValueError(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}.")
    if mode == "sessions" and is_http_engine(engine):
        raise ValueError("--modes sessions needs --engine sim or real (sessions replay in-process).")


def mode_label(scheduler: str, mode: str) -> str:
    """A replay's name in logs and plots: the scheduler, with ``+sessions`` for session replays."""
    return scheduler if mode == "stateless" else f"{scheduler}+{mode}"


@dataclass
class _Session:
    """One job's session: the tokens the engine holds (every chunk and output so far), the replay's request id of
    the running turn, that turn's tokens so far and context length, and whether its input has ended."""

    context: list[int]
    turn_request_id: str | None = None
    turn_tokens: list[int] = field(default_factory=list)
    turn_context_len: int = 0
    last: bool = False


class SessionBook:
    """Maps the replay's turns (``job#turn`` requests with full prompts) onto one session per job.

    Promises: a job has at most one turn running; a turn's chunk is exactly the tokens its prompt adds to the
    session's context (``BenchReplayError`` when the prompt does not extend it); a session is forgotten when its
    last turn ends.
    """

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}

    def chunk(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], bool, bool]:
        """Starts the turn ``request_id``: (session id = job id, the tokens to send, whether it opens the session,
        whether it is the job's last turn)."""
        extra = params.extra_args or {}
        job = str(extra.get("job_id") or request_id.rsplit("#", 1)[0])
        last = bool(extra.get("is_last_step"))
        session = self.sessions.get(job)
        if session is None:
            session = self.sessions[job] = _Session(context=[])
            opens = True
        else:
            opens = False
            if session.turn_request_id is not None:
                raise BenchReplayError(
                    f"Job {job!r}: turn {request_id!r} submitted while {session.turn_request_id!r} runs."
                )
        known = len(session.context)
        if prompt[:known] != session.context:
            raise BenchReplayError(f"Job {job!r}: the prompt of {request_id!r} does not extend the session's context.")
        new = list(prompt[known:])
        if not new:
            raise BenchReplayError(f"Job {job!r}: turn {request_id!r} adds no tokens to the session.")
        session.context.extend(new)
        session.turn_request_id, session.turn_tokens, session.last = request_id, [], last
        session.turn_context_len = len(session.context)
        return job, new, opens, last

    def running(self, job: str) -> _Session | None:
        """The session of ``job`` while one of its turns runs."""
        session = self.sessions.get(job)
        return session if session is not None and session.turn_request_id is not None else None

    def end_turn(self, job: str) -> str:
        """The running turn of ``job`` ended: its tokens join the context; returns the turn's request id."""
        session = self.sessions[job]
        request_id = session.turn_request_id
        assert request_id is not None
        session.context.extend(session.turn_tokens)
        session.turn_request_id = None
        if session.last:
            del self.sessions[job]
        return request_id


class SimSessionBackend(SimBackend):
    """:class:`~vllite.plugins.bench.agent_bench.SimBackend` replaying each job as one session (virtual time)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.book = SessionBook()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Opens the job's session, or sends the turn's new tokens as its next chunk; ends the input after the last
        turn's chunk (the session then finishes with that turn)."""
        from vllite.protocol import EngineCoreRequest

        job, tokens, opens, last = self.book.chunk(request_id, prompt, params)
        now = self.clock()
        if opens:
            self.core.add_request(EngineCoreRequest(job, tokens, params, None, now, resumable=True))
        else:
            self.core.add_request(EngineCoreRequest(job, tokens, params, None, now, resumable=True, continuation=True))
        if last:
            self.core.add_request(EngineCoreRequest(job, [], params, None, now, continuation=True))

    def step(self) -> tuple[StepEvents, bool]:
        """One engine step: per running turn its new tokens, and whether the turn ended."""
        from vllite.protocol import FinishReason

        outputs, executed = self.core.step()
        events: StepEvents = []
        for batch in outputs.values():
            for o in batch.outputs:
                session = self.book.running(o.request_id)
                if session is None:
                    continue
                if o.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                    raise BenchReplayError(f"Session {o.request_id!r} ended with {o.finish_reason}: {o.error}")
                session.turn_tokens.extend(o.new_token_ids)
                ended = o.finish_reason is not None
                request_id = session.turn_request_id
                assert request_id is not None
                if ended:
                    self.prompt_tokens_computed += session.turn_context_len - o.num_cached_tokens
                    self.book.end_turn(o.request_id)
                events.append((request_id, list(o.new_token_ids), ended))
        return events, executed


class RealSessionBackend(RealBackend):
    """:class:`~vllite.plugins.bench.agent_bench.RealBackend` replaying each job as one session through ``LLMEngine``'s
    session API (wall time)."""

    def __init__(self, engine_args: Any) -> None:
        super().__init__(engine_args)
        self.book = SessionBook()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Opens the job's session (``resumable``), or sends the turn's new tokens with ``add_session_input``;
        ends the input after the last turn's chunk."""
        job, tokens, opens, last = self.book.chunk(request_id, prompt, params)
        if opens:
            self.engine.add_request(job, {"prompt_token_ids": tokens}, params, resumable=True)
        else:
            self.engine.add_session_input(job, {"prompt_token_ids": tokens}, params)
        if last:
            self.engine.close_session_input(job)

    def step(self) -> tuple[StepEvents, bool]:
        """One engine step: per running turn its tokens so far, and whether the turn ended."""
        events: StepEvents = []
        for out in self.engine.step():
            session = self.book.running(out.request_id)
            if session is None:
                continue
            completion = out.outputs[0]
            if completion.finish_reason in ("error", "abort"):
                raise BenchReplayError(f"Session {out.request_id!r} ended with {completion.finish_reason}.")
            session.turn_tokens = list(completion.token_ids)
            ended = completion.finish_reason is not None
            request_id = session.turn_request_id
            assert request_id is not None
            if ended:
                if len(out.prompt_token_ids or ()) != session.turn_context_len:
                    raise BenchReplayError(
                        f"Session {out.request_id!r}: the engine ran the turn on {len(out.prompt_token_ids or ())} "
                        f"tokens, the replay expected {session.turn_context_len}."
                    )
                self.prompt_tokens_computed += session.turn_context_len - (out.num_cached_tokens or 0)
                self.book.end_turn(out.request_id)
            events.append((request_id, list(completion.token_ids), ended))
        return events, True
