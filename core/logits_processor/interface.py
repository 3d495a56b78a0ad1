"""The logits-processor interface: ``LogitsProcessor``, ``BatchUpdate`` and ``MoveDirectionality``.

Names, signatures and semantics follow vLLM V1 (``vllm.v1.sample.logits_processor.interface``), so a processor
written for vLLM V1 runs here unchanged. This module imports no torch at run time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vllite.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    """How a request moves inside the persistent batch.

    ``UNIDIRECTIONAL``: the request at ``a`` moves to ``b``; slot ``a`` is vacated and whatever was at ``b``
    is gone. ``SWAP``: the requests at ``a`` and ``b`` exchange slots.
    """

    UNIDIRECTIONAL = auto()
    SWAP = auto()

    def __eq__(self, other: object) -> bool:
        """Also equal to the same-named member of another ``MoveDirectionality`` enum (a real vLLM's).

        A processor compares the moves it receives with whichever enum it imported. Python tries the reflected
        comparison when the other enum's (identity) ``__eq__`` declines, so ``theirs.SWAP == move`` holds too,
        and the hash is the member name (as ``Enum``'s), so mixed dict and set lookups work.
        """
        if self is other:
            return True
        if isinstance(other, Enum) and type(other).__name__ == "MoveDirectionality":
            return self.name == other.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._name_)


# Batch index of a removed request.
RemovedRequest = int
# (index, sampling_params, prompt_token_ids or None, output_token_ids). ``output_token_ids`` is the batch's
# *live* list for that request: the batch keeps appending sampled tokens to it, so a processor that keeps the
# reference always sees the current output without copies.
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
# (index_a, index_b, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """One step's change to the persistent batch, as every processor sees it.

    Apply in the order ``removed`` → ``added`` → ``moved``. An added or moved entry may replace an existing
    request at the same index. The input batch promises that no index is both removed and added in one
    update (a freed slot is reused through ``BatchUpdateBuilder.pop_removed``, which takes it out of
    ``removed``), so processors may handle ``added`` before ``removed`` too. ``batch_size`` is the number of
    requests in the batch after the update; rows ``0 .. batch_size-1`` of the logits belong to them.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM V1 interface).

    Promises of the engine to an implementation:

    - it is constructed once per engine as ``cls(vllm_config, device, is_pin_memory)``;
    - ``update_state(batch_update)`` is called before every forward pass, with ``None`` when the batch makeup
      did not change (so per-step work, such as watching live output lists, can run there);
    - ``apply(logits)`` receives float32 logits of shape ``[batch_size, vocab_size]``, row ``i`` belonging to
      the request at batch index ``i``; it may modify them in place but must return the result;
    - ``is_argmax_invariant()`` is read once, at construction of the ``LogitsProcessors`` container: a
      processor that can never change the argmax (True) runs after greedy sampling is decided, any other
      before it;
    - ``validate_params(sampling_params)`` runs when a request is submitted; raising ``ValueError`` rejects
      the request there instead of failing mid-batch.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` if ``sampling_params`` (usually ``extra_args``) is invalid here."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Build the processor's state for ``vllm_config`` on ``device`` (``is_pin_memory``: pin host buffers)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process ``logits`` ``[batch_size, vocab_size]``; may work in place, must return the tensor."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor can never change the greedy (argmax) choice of any row."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch (``None``: no membership change this step); called before every forward pass."""
