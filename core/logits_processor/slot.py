"""vLLM's newer slot-based processor interface (Model Runner V2), adapted onto the ``BatchUpdate`` machinery.

A slot-interface processor is built as ``cls(vllm_config, req_states)``, learns of each request once through
``add_request(slot, sampling_params) -> bool`` (True: it acts on that request), may flush host-side state in
``apply_staged_writes()`` once per step, and runs as ``apply(logits, ctx)`` where ``ctx`` maps logits rows to
slots. A slot stays the request's for its whole life and there is no removal hook: a recycled slot is simply
re-announced. :class:`SlotLogitsProcessorAdapter` keeps that contract on top of vllite's persistent batch,
where requests move between batch indices: it gives each request a stable slot, keeps the token history in
``req_states`` current from the live output lists, and builds the row → slot mapping at every ``apply``.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.exceptions import BatchStateError, LogitsProcessorRowsError, PluginHookError
from vllite.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:
    import numpy as np
    import torch

    from vllite.sampling_params import SamplingParams

_DEFAULT_TOKEN_CAPACITY = 256


@dataclass(frozen=True)
class LogitsProcRequestState:
    """Read-only view of the requests' token history for slot-interface processors, indexed by slot.

    ``all_token_ids[slot, :total_len[slot]]`` holds the prompt followed by the output so far;
    ``prompt_len[slot]`` is the prompt length; ``prefill_len[slot]`` the tokens known when the request was
    added. ``all_token_ids`` grows (a new tensor) when a request outgrows it, so read it through this object
    each step rather than keeping the tensor.
    """

    device: torch.device
    max_num_reqs: int
    vocab_size: int | None
    all_token_ids: torch.Tensor
    prompt_len: torch.Tensor
    prefill_len: torch.Tensor
    total_len: torch.Tensor


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


def is_slot_interface(cls: type) -> bool:
    """True if ``cls`` has the slot interface (``add_request`` and ``apply``, but no ``update_state``)."""
    return (
        callable(getattr(cls, "add_request", None))
        and callable(getattr(cls, "apply", None))
        and not callable(getattr(cls, "update_state", None))
    )


@functools.cache
def adapt_slot_processor(slot_cls: type) -> type[LogitsProcessor]:
    """A ``LogitsProcessor`` class that drives ``slot_cls`` (slot interface); one adapter class per input."""
    return type(
        f"SlotAdapter[{slot_cls.__qualname__}]",
        (SlotLogitsProcessorAdapter,),
        {"slot_cls": slot_cls, "__module__": slot_cls.__module__, "__doc__": slot_cls.__doc__},
    )


class SlotLogitsProcessorAdapter(LogitsProcessor):
    """Runs a slot-interface processor (``slot_cls``) as a V1 ``LogitsProcessor``.

    Promises: every request gets the smallest free slot when added and keeps it across moves until it is
    removed; ``add_request`` is called exactly once per added request; ``apply_staged_writes`` once per
    ``update_state``; ``apply`` of the inner processor only when at least one request in the batch made
    ``add_request`` return True. Counts as not argmax-invariant unless ``slot_cls`` says otherwise.
    """

    slot_cls: ClassVar[type]

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate = getattr(cls.slot_cls, "validate_params", None)
        if validate is not None:
            validate(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        import torch

        self.device = torch.device(device)
        self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        model_config = getattr(vllm_config, "model_config", None)
        capacity = getattr(model_config, "max_model_len", None) or _DEFAULT_TOKEN_CAPACITY
        text_config = getattr(model_config, "hf_text_config", None)
        vocab_size = getattr(text_config, "vocab_size", None)
        lengths = {
            name: torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device)
            for name in ("prompt_len", "prefill_len", "total_len")
        }
        self.req_states = LogitsProcRequestState(
            device=self.device,
            max_num_reqs=self.max_num_reqs,
            vocab_size=vocab_size,
            all_token_ids=torch.zeros((self.max_num_reqs, capacity), dtype=torch.int32, device=self.device),
            **lengths,
        )
        self.inner = self.slot_cls(vllm_config, self.req_states)
        self._free_slots = list(range(self.max_num_reqs))
        self._slot_of: dict[int, int] = {}  # batch index -> slot
        self._active: dict[int, bool] = {}  # slot -> add_request's answer
        self._outputs: dict[int, tuple[list[int], int]] = {}  # slot -> (live output list, prompt length)
        self._synced_len: dict[int, int] = {}  # slot -> total tokens already written to all_token_ids

    def is_argmax_invariant(self) -> bool:
        probe = getattr(self.inner, "is_argmax_invariant", None)
        return bool(probe()) if callable(probe) else False

    # ------------------------------------------------------------------ batch bookkeeping
    def _free_slot(self, slot: int) -> None:
        self._active.pop(slot, None)
        self._outputs.pop(slot, None)
        self._synced_len.pop(slot, None)
        heapq.heappush(self._free_slots, slot)

    def _release(self, index: int) -> None:
        slot = self._slot_of.pop(index, None)
        if slot is not None:
            self._free_slot(slot)

    def _write_tokens(self, slot: int, start: int, tokens: list[int]) -> None:
        import torch

        end = start + len(tokens)
        table = self.req_states.all_token_ids
        if end > table.shape[1]:
            grown = torch.zeros((table.shape[0], max(end, 2 * table.shape[1])), dtype=table.dtype, device=table.device)
            grown[:, : table.shape[1]] = table
            object.__setattr__(self.req_states, "all_token_ids", grown)
            table = grown
        table[slot, start:end] = torch.tensor(tokens, dtype=table.dtype).to(table.device)

    def _add(self, index: int, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> None:
        self._release(index)
        slot = heapq.heappop(self._free_slots)
        self._slot_of[index] = slot
        prompt = list(prompt or [])
        known = prompt + list(output)
        self._write_tokens(slot, 0, known)
        self.req_states.prompt_len[slot] = len(prompt)
        self.req_states.prefill_len[slot] = len(known)
        self.req_states.total_len[slot] = len(known)
        self._outputs[slot] = (output, len(prompt))
        self._synced_len[slot] = len(known)
        self._active[slot] = bool(self.inner.add_request(slot, params))

    def _move(self, a: int, b: int, direct: MoveDirectionality) -> None:
        slot_a = self._slot_of.pop(a, None)
        slot_b = self._slot_of.pop(b, None)
        if direct == MoveDirectionality.SWAP:
            if slot_b is not None:
                self._slot_of[a] = slot_b
        elif slot_b is not None:
            self._free_slot(slot_b)  # a one-way move overwrites the destination's request
        if slot_a is not None:
            self._slot_of[b] = slot_a

    def _sync_outputs(self) -> None:
        for slot, (output, prompt_len) in self._outputs.items():
            synced = self._synced_len[slot]
            total = prompt_len + len(output)
            if total > synced:
                self._write_tokens(slot, synced, output[synced - prompt_len :])
                self.req_states.total_len[slot] = total
                self._synced_len[slot] = total

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update:
            for index in batch_update.removed:
                self._release(index)
            for index, params, prompt, output in batch_update.added:
                self._add(index, params, prompt, output)
            for a, b, direct in batch_update.moved:
                self._move(a, b, direct)
        self._sync_outputs()
        flush = getattr(self.inner, "apply_staged_writes", None)
        if callable(flush):
            flush()

    # ------------------------------------------------------------------ apply
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        import numpy as np
        import torch

        num_rows = logits.shape[0]
        slots = [self._slot_of.get(row, -1) for row in range(num_rows)]
        if not any(self._active.get(slot, False) for slot in slots if slot >= 0):
            return logits
        if -1 in slots:
            raise BatchStateError(f"logits row {slots.index(-1)} belongs to no request known to {type(self).__name__}")
        idx_np = np.asarray(slots, dtype=np.int32)
        idx = torch.from_numpy(idx_np).to(logits.device)
        total = self.req_states.total_len.index_select(0, idx.to(self.req_states.total_len.device))
        pos = (total - 1).clamp(min=0)
        last = self.req_states.all_token_ids[idx.to(self.device).long(), pos.long()]
        ctx = LogitsContext(
            expanded_idx_mapping=idx,
            idx_mapping=idx,
            idx_mapping_np=idx_np,
            expanded_local_pos=torch.zeros(num_rows, dtype=torch.int32, device=logits.device),
            input_ids=last.to(logits.device),
            pos=pos.to(logits.device),
            seq_lens_upper_bound_np=total.cpu().numpy(),
        )
        try:
            return self.inner.apply(logits, ctx)
        except Exception as exc:
            # The slot interface knows which requests it acts on: only their rows fail.
            message = str(PluginHookError(self.inner, "apply", exc))
            rows = {row: message for row, slot in enumerate(slots) if self._active.get(slot, False)}
            raise LogitsProcessorRowsError(rows, logits) from exc
