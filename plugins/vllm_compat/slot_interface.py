"""vLLM's slot-based processor interface (Model Runner V2): the base class, the request state, the step context.

Names and signatures follow ``vllm.v1.worker.gpu.sample.logits_processor``, so a processor written against it
runs here unchanged (vllite adapts it onto its persistent batch, see :mod:`vllite.plugins.vllm_compat.slot_adapter`).
Import-light: the frontend imports processor classes to run ``validate_params``, so torch is imported here
only for type checking.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from vllite.plugins.vllm_compat.buffers import StagedWriteTensor, UvaBackedTensor
    from vllite.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsProcRequestState:
    """Read-only view of the requests' token history for slot-interface processors, indexed by slot.

    Each tensor field is a buffer with vLLM's API: ``.gpu`` is the tensor on the engine's device, ``.cpu`` the
    host copy and ``.np`` its numpy view. ``all_token_ids.gpu[slot, :total_len.gpu[slot]]`` holds the prompt
    followed by the output so far; ``prompt_len`` is the prompt length; ``prefill_len`` the tokens known when
    the request was added. The buffers are updated in place before each step, so reads always see current
    values; only ``all_token_ids`` is replaced (by a larger one) when a request outgrows it, so read it
    through this object rather than keeping it.
    """

    device: torch.device
    max_num_reqs: int
    vocab_size: int
    all_token_ids: StagedWriteTensor
    prompt_len: UvaBackedTensor
    prefill_len: UvaBackedTensor
    total_len: StagedWriteTensor


@dataclass(frozen=True)
class LogitsContext:
    """One step's layout for ``apply(logits, ctx)``: row ``r`` belongs to slot ``expanded_idx_mapping[r]``.

    Without speculative decoding each request has one row, so ``expanded_idx_mapping == idx_mapping`` and
    ``expanded_local_pos`` is all zeros. ``input_ids``/``pos`` hold each row's last known token and its
    position; ``seq_lens_upper_bound_np`` the sequence length per row.
    """

    expanded_idx_mapping: torch.Tensor
    idx_mapping: torch.Tensor
    idx_mapping_np: np.ndarray
    expanded_local_pos: torch.Tensor
    input_ids: torch.Tensor
    pos: torch.Tensor
    seq_lens_upper_bound_np: np.ndarray


class SlotLogitsProcessor(ABC):
    """Base class of a slot-interface logits processor (vLLM's Model Runner V2 ``LogitsProcessor``).

    Promises of the engine to an implementation:

    - it is constructed once per engine as ``cls(vllm_config, req_states)``;
    - ``add_request(slot, sampling_params)`` is called once per request entering the batch, with a slot the
      request keeps until it finishes; slots are recycled and there is no removal hook, so it must fully
      rewrite the slot's state, and it returns whether the processor acts on the request;
    - ``apply_staged_writes()`` runs once per step, after ``req_states`` is current and before ``apply``;
    - ``apply(logits, ctx)`` receives float32 logits ``[num_rows, vocab_size]`` for every row of the batch
      (also rows of requests it declined); ``ctx.expanded_idx_mapping`` maps rows to slots. It is skipped in
      steps where no request of the batch was accepted by ``add_request``.
    """

    def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:  # noqa: B027
        """Captures what stays constant for the processor's lifetime (``req_states`` is read-only)."""

    @classmethod  # noqa: B027
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` for invalid per-request arguments; runs when the request is submitted."""

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """(Re)initialises slot ``req_idx`` for a request entering the batch; True if it acts on the request."""
        return True

    def apply_staged_writes(self) -> None:  # noqa: B027
        """Flushes host-side writes staged by ``add_request`` to the device, once per step."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """Processes ``logits`` (rows mapped to slots by ``ctx``); may work in place, must return the result."""
