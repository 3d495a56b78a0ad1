"""The engine loop's contract with structured outputs: the manager interface, and what the scheduler does itself.

- :class:`StructuredOutputManagerInterface`: what the engine core calls, ``grammar_init`` when a constrained request
  arrives, ``update_waiting`` before each schedule, ``start_grammar_bitmask`` after it, ``shutdown`` at the end.
  The implementation (compilation on a thread pool, the compiled-grammar cache, the bitmask fill) is the
  structured-outputs builtin plugin's, ``vllite.plugins.structured_outputs.manager.StructuredOutputManager``, which
  :func:`create_structured_output_manager` resolves by class path once, at engine start.
- :func:`advance_grammar` / :func:`filter_drafts`, from the scheduler: the matcher takes each accepted token (a
  terminated grammar finishes the request with ``stop``); drafts are cut at their first token the grammar refuses.
  They touch only the request and its matcher (:class:`~vllite.structured_output.backend.StructuredOutputGrammar`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from vllite import deprecated_aliases
from vllite.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllite.config import EngineConfig
    from vllite.sched.output import SchedulerOutput

#: ``SamplingParams.extra_args`` key: the token ids that end a reasoning section; the grammar applies after them.
REASONING_END_KEY = "reasoning_end_token_ids"
#: The class that implements :class:`StructuredOutputManagerInterface`: the structured-outputs builtin plugin's.
MANAGER_CLASS_PATH = "vllite.plugins.structured_outputs.manager:StructuredOutputManager"


class StructuredOutputManagerInterface(abc.ABC):
    """What the engine core calls on its structured-output manager, built as ``cls(config, vocab_size,
    eos_token_ids)``. A manager does no per-step work until a constrained request was added."""

    @abc.abstractmethod
    def grammar_init(self, request: Request) -> None:
        """Starts compiling a constrained request's grammar; the request waits in
        ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until :meth:`update_waiting` sees it compiled."""

    @abc.abstractmethod
    def update_waiting(self, scheduler: Any) -> None:
        """Before a schedule: compiled requests become ``WAITING`` (with their matcher); failed ones end with ERROR
        (``scheduler.fail_request``) and the compiler's message."""

    @abc.abstractmethod
    def start_grammar_bitmask(self, scheduler: Any, scheduler_output: SchedulerOutput) -> None:
        """After a schedule: sets ``scheduler_output.grammar_output`` (``None`` when no constrained request samples
        this step, else a :class:`~vllite.structured_output.bitmask.GrammarOutput` or a future of one)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the manager's threads and releases its backends."""


def create_structured_output_manager(
    config: EngineConfig, vocab_size: int, eos_token_ids: list[int]
) -> StructuredOutputManagerInterface:
    """The engine core's structured-output manager: :data:`MANAGER_CLASS_PATH`, imported here (not at module level:
    the kernel never imports a builtin there)."""
    from vllite.registry import resolve_class_path

    cls = resolve_class_path(MANAGER_CLASS_PATH)
    return cls(config, vocab_size, list(eos_token_ids))


def advance_grammar(request: Request, token_ids: list[int]) -> None:
    """After ``token_ids`` were accepted for a constrained request: its matcher takes them. A grammar that
    terminated on a stop token finishes the request with ``stop`` (even with ``ignore_eos``); one complete without it
    (nothing may follow) lets only the stop token through next, so the text never loses its last token. A token the
    grammar refuses while the request runs on (it cannot happen with the bitmask applied) ends the request with
    ERROR."""
    so_request = request.structured_output_request
    grammar = so_request.grammar if so_request is not None else None
    if grammar is None or not token_ids:
        return
    token_ids = so_request.tokens_after_reasoning(token_ids) if so_request is not None else token_ids
    if not token_ids:
        return
    if not grammar.accept_tokens(token_ids):
        if not request.is_finished():
            request.status = RequestStatus.FINISHED_ERROR
            kind = so_request.params.kind if so_request is not None else "structured-output"
            request.error = f"Request {request.request_id!r}: a sampled token broke its {kind} constraint."
        return
    if request.is_finished():
        return
    last = token_ids[-1]  # a grammar terminates on a stop token only: ask the matcher only then
    if (last == request.eos_token_id or last in request.sampling_params.all_stop_token_ids) and grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED


def filter_drafts(request: Request, token_ids: list[int]) -> list[int]:
    """Draft tokens of a constrained request cut at the first one its grammar refuses (unchanged otherwise)."""
    so_request = request.structured_output_request
    if so_request is None or so_request.grammar is None or not token_ids or so_request.reasoning_end:
        return token_ids
    return so_request.grammar.validate_tokens(list(token_ids))


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the implementation, now the builtin plugin's
