"""Sessions on the client side: ``StreamingInput`` chunks, the checks a session's parameters must pass, and the
turn bookkeeping of a session's output state.

A session is one request whose input arrives in chunks (vLLM's streaming input, ``resumable`` requests): each
chunk starts a turn that appends the chunk to everything so far and generates; the engine keeps the KV between
turns (``vllite.sched.sessions``). Each turn's outputs carry that turn's text and finish reason with ``finished``
False; the session's last output, once its input has ended, has ``finished`` True.

A turn's ``RequestOutput.prompt_token_ids`` is the whole context it ran on (every chunk and every generated token
before it), so ``len(prompt_token_ids) - num_cached_tokens`` is what the turn prefilled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllite.exceptions import SessionClosedError
from vllite.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from vllite.engine.input_processor import PromptType
    from vllite.protocol import EngineCoreRequest


@dataclass
class StreamingInput:
    """One input chunk of a session (vLLM's name): a prompt to append, and the sampling parameters of the turn it
    starts (``None``: the previous turn's). A later chunk's text is tokenized without special tokens."""

    prompt: PromptType
    sampling_params: SamplingParams | None = None


def check_session_params(params: SamplingParams) -> None:
    """``ValueError`` for sampling parameters a session's turn cannot use (vLLM's rules, and what a turn that ends
    in the engine cannot honour)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"A session's turns need SamplingParams, got {type(params).__name__}.")
    if params.n != 1:
        raise ValueError(f"Input streaming is not supported with n > 1 (got n={params.n}).")
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        raise ValueError("Input streaming is not supported with output_kind FINAL_ONLY: each turn streams its outputs.")
    if params.stop:
        raise ValueError(
            "Stop strings are not supported in a session: a turn must end in the engine. Use stop_token_ids (or EOS)."
        )
    if params.structured_outputs is not None:
        raise ValueError("Structured outputs are not supported in a session.")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs are not supported in a session.")


@dataclass
class SessionTurns:
    """The client-side turn state of one session: the context so far, chunks whose turn has not started yet (the
    engine starts them in the same order), whether the session waits for input, and whether its input ended."""

    context_token_ids: list[int]
    pending: deque[tuple[EngineCoreRequest, str | None]] = field(default_factory=deque)
    awaiting_input: bool = False
    input_ended: bool = False
    params: SamplingParams | None = None


def session_of(state: Any, request_id: str) -> SessionTurns:
    """The open session of an output state; ``SessionClosedError`` when there is none."""
    session = getattr(state, "session", None) if state is not None else None
    if session is None or session.input_ended:
        raise SessionClosedError(f"Session {request_id!r} is not open (unknown, finished, or its input already ended).")
    return session
