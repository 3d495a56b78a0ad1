"""``BatchUpdateBuilder``: collects one step's batch changes and emits them as one ``BatchUpdate``."""

from __future__ import annotations

from vllite.exceptions import BatchStateError
from vllite.logits_processor.interface import AddedRequest, BatchUpdate, MovedRequest, RemovedRequest

_REMOVED_READ_ERROR = "Cannot register new removed request after self.removed has been read."


class BatchUpdateBuilder:
    """Mutable collector of a step's removed / added / moved requests (vLLM V1 semantics).

    The persistent batch registers every removal with :meth:`removed_append` first, then fills freed slots
    with :meth:`pop_removed` (smallest index first) while appending to :attr:`added`, then records condensing
    moves in :attr:`moved`, and finally calls :meth:`get_and_reset`. Guarantees:

    - once :attr:`removed` has been read (or peeked / popped while non-empty) it is sorted descending, and
      registering another removal raises ``BatchStateError`` until the next reset;
    - :meth:`pop_removed` returns the smallest removed index in O(1) and takes it out of ``removed``, so a
      reused slot is never both removed and added in the emitted update;
    - :meth:`get_and_reset` hands its lists to the ``BatchUpdate`` and starts new ones, so later changes
      never alter an update already emitted.
    """

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        self._is_removed_sorted = False
        # Set by removed_append; pooling batches, which fill no ``added``, read it through reset().
        self.batch_changed = False

    def _ensure_removed_sorted(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """The removed indices, sorted descending. Reading it forbids further :meth:`removed_append` calls."""
        self._ensure_removed_sorted()
        return self._removed

    def removed_append(self, index: int) -> None:
        """Registers the removal of the request at batch ``index``."""
        if self._is_removed_sorted:
            raise BatchStateError(_REMOVED_READ_ERROR)
        self._removed.append(index)
        self.batch_changed = True

    def has_removed(self) -> bool:
        """True if a removed index is still registered (does not sort)."""
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The smallest removed index, left in place; ``None`` if there is none."""
        if self.has_removed():
            self._ensure_removed_sorted()
            return self._removed[-1]
        return None

    def pop_removed(self) -> int | None:
        """Takes the smallest removed index out of ``removed`` (to reuse its slot); ``None`` if none."""
        if self.has_removed():
            self._ensure_removed_sorted()
            return self._removed.pop()
        return None

    def reset(self) -> bool:
        """Clears everything in place; returns whether the batch changed since the last reset."""
        self._is_removed_sorted = False
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        changed = self.batch_changed
        self.batch_changed = False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """The step's ``BatchUpdate`` for a batch of ``batch_size`` requests; ``None`` if nothing changed."""
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.moved or self.added):
            return None
        update = BatchUpdate(batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved)
        self._removed, self.added, self.moved = [], [], []
        return update
