"""``LogitsProcessors``: the engine's processors, split by whether they can change the argmax."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING

from vllite.exceptions import LogitsProcessorRowsError, PluginHookError
from vllite.logits_processor.interface import BatchUpdate, LogitsProcessor

if TYPE_CHECKING:
    import torch


class LogitsProcessors:
    """Holds the processor instances of one engine, split once by ``is_argmax_invariant()``.

    ``non_argmax_invariant`` processors may change the greedy choice, so the sampler runs them before argmax;
    ``argmax_invariant`` ones only reshape the distribution and run after greedy rows are decided (after
    temperature). Each list keeps construction order. The split is decided at construction and never revised.

    Use from the model runner, once per step::

        procs.update_state(builder.get_and_reset(num_reqs))   # every step, also when the update is None
        logits = procs.apply_non_argmax_invariant(logits)     # before greedy argmax
        ...                                                   # temperature
        logits = procs.apply_argmax_invariant(logits)         # before random sampling
        failed = procs.take_failed_rows()                     # rows a processor failed on: row -> message

    Fault isolation: a processor whose ``apply`` raises never stops the batch. A per-request processor
    (``AdapterLogitsProcessor``, the slot-interface adapter, or any processor raising ``LogitsProcessorRowsError``)
    names the rows it failed on; only those rows fail. A batch-level processor that raises cannot say which row it
    failed on, and may have half-written the batch: every row of the batch fails. Each failed row's message
    names the processor class, ``apply`` and the exception; the model runner fails those rows' requests.
    An ``update_state`` that raises is re-raised as ``PluginHookError`` naming the processor (the step fails as
    it would with the original exception). ``origins`` (aligned with ``logitsprocs``; the loader passes them)
    say where each processor came from, its entry point and distribution; every such message ends with it.
    """

    def __init__(
        self, logitsprocs: Iterable[LogitsProcessor] | None = None, origins: Sequence[str | None] | None = None
    ) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        self._origins: dict[int, str] = {}
        for index, proc in enumerate(logitsprocs or ()):
            (self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant).append(proc)
            origin = origins[index] if origins is not None and index < len(origins) else None
            if origin:
                self._origins[id(proc)] = origin
        self.failed_rows: dict[int, str] = {}

    def origin_of(self, proc: LogitsProcessor) -> str | None:
        """Where ``proc`` came from (entry point and distribution, registered name or class path), if known."""
        return self._origins.get(id(proc))

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        """Every processor, argmax-invariant ones first; a fresh iterator on each access."""
        return chain(self.argmax_invariant, self.non_argmax_invariant)

    def __len__(self) -> int:
        return len(self.argmax_invariant) + len(self.non_argmax_invariant)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Hands one step's update (or ``None``) to every processor; call it every step before the forward."""
        for proc in self.all:
            try:
                proc.update_state(batch_update)
            except Exception as exc:
                raise PluginHookError(proc, "update_state", exc, source=self.origin_of(proc)) from exc

    def apply_non_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """Runs the processors that may change the argmax, in order; call before greedy sampling."""
        for proc in self.non_argmax_invariant:
            logits = self._apply_one(proc, logits)
        return logits

    def apply_argmax_invariant(self, logits: torch.Tensor) -> torch.Tensor:
        """Runs the argmax-invariant processors, in order; call after temperature, before random sampling."""
        for proc in self.argmax_invariant:
            logits = self._apply_one(proc, logits)
        return logits

    def _apply_one(self, proc: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
        try:
            return proc.apply(logits)
        except LogitsProcessorRowsError as exc:
            for row, message in exc.rows.items():
                self.failed_rows.setdefault(row, self._name_row_failure(proc, message))
            return exc.logits  # type: ignore[return-value]
        except Exception as exc:
            message = str(PluginHookError(proc, "apply", exc, source=self.origin_of(proc)))
            for row in range(logits.shape[0]):
                self.failed_rows.setdefault(row, message)
            return logits

    def _name_row_failure(self, proc: LogitsProcessor, message: str) -> str:
        """A row message of ``LogitsProcessorRowsError`` naming the processor's class (when the processor did not)
        and its origin."""
        cls = type(proc)
        named = getattr(cls, "slot_cls", cls)  # a slot-interface adapter reports its inner class
        if f"{named.__module__}.{named.__qualname__}" not in message:
            message = f"{cls.__module__}.{cls.__qualname__}.apply failed: {message}"
        origin = self.origin_of(proc)
        return f"{message} [{origin}]" if origin else message

    def take_failed_rows(self) -> dict[int, str]:
        """The rows a processor failed on since the last call (``row -> message``), and forgets them."""
        failed, self.failed_rows = self.failed_rows, {}
        return failed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Runs every processor: the non-argmax-invariant ones first, then the argmax-invariant ones."""
        return self.apply_argmax_invariant(self.apply_non_argmax_invariant(logits))
