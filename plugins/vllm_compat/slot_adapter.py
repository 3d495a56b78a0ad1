"""vLLM's newer slot-based processor interface (Model Runner V2), adapted onto the ``BatchUpdate`` machinery.

A slot-interface processor is built as ``cls(vllm_config, req_states)``, learns of each request once through
``add_request(slot, sampling_params) -> bool`` (True: it acts on that request), may flush host-side state in
``apply_staged_writes()`` once per step, and runs as ``apply(logits, ctx)`` where ``ctx`` maps logits rows to
slots. A slot stays the request's for its whole life and there is no removal hook: a recycled slot is simply
re-announced. :class:`SlotLogitsProcessorAdapter` keeps that contract on top of vllite's persistent batch,
where requests move between batch indices: it gives each request a stable slot, keeps the token history in
``req_states`` current from the live output lists (staged, then published once per step, as vLLM's model
runner does), and builds the row → slot mapping at every ``apply``. The interface itself (base class, request
state, step context) is in :mod:`vllite.plugins.vllm_compat.slot_interface`.
"""

from __future__ import annotations

import functools
import heapq
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.exceptions import BatchStateError, LogitsProcessorRowsError, PluginHookError
from vllite.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllite.plugins.vllm_compat.buffers import StagedWriteTensor, UvaBackedTensor, buffer_device
from vllite.plugins.vllm_compat.slot_interface import LogitsContext, LogitsProcRequestState, SlotLogitsProcessor

if TYPE_CHECKING:
    import torch

    from vllite.sampling_params import SamplingParams

__all__ = [
    "LogitsContext",
    "LogitsProcRequestState",
    "SlotLogitsProcessor",
    "SlotLogitsProcessorAdapter",
    "adapt_slot_processor",
    "is_slot_interface",
]

_DEFAULT_TOKEN_CAPACITY = 256


def _vocab_size(model_config: Any) -> int:
    get = getattr(model_config, "get_vocab_size", None)
    if callable(get):
        return int(get() or 0)
    return int(getattr(getattr(model_config, "hf_text_config", None), "vocab_size", 0) or 0)


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
        self.req_states = LogitsProcRequestState(
            device=self.device,
            max_num_reqs=self.max_num_reqs,
            vocab_size=_vocab_size(model_config),
            all_token_ids=StagedWriteTensor((self.max_num_reqs, capacity), torch.int32, self.device),
            prompt_len=UvaBackedTensor(self.max_num_reqs, torch.int32, device=self.device),
            prefill_len=UvaBackedTensor(self.max_num_reqs, torch.int32, device=self.device),
            total_len=StagedWriteTensor(self.max_num_reqs, torch.int32, self.device),
        )
        with buffer_device(self.device):  # buffers the processor builds without a device land here
            self.inner = self.slot_cls(vllm_config, self.req_states)
        self._free_slots = list(range(self.max_num_reqs))
        self._slot_of: dict[int, int] = {}  # batch index -> slot
        self._active: dict[int, bool] = {}  # slot -> add_request's answer
        self._outputs: dict[int, tuple[list[int], int]] = {}  # slot -> (live output list, prompt length)
        self._synced_len: dict[int, int] = {}  # slot -> total tokens already staged for all_token_ids

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

        table = self.req_states.all_token_ids
        end = start + len(tokens)
        columns = table.cpu.shape[1]
        if end > columns:  # grow: a request outgrew max_model_len (or the default capacity)
            table.apply_write()
            grown = StagedWriteTensor((table.num_rows, max(end, 2 * columns)), torch.int32, self.device)
            grown.cpu[:, :columns] = table.cpu
            if grown.gpu is not grown.cpu:
                grown.gpu[:, :columns] = table.gpu
            object.__setattr__(self.req_states, "all_token_ids", grown)
            table = grown
        table.stage_write(slot, start, tokens)

    def _add(self, index: int, params: SamplingParams, prompt: list[int] | None, output: list[int]) -> None:
        self._release(index)
        slot = heapq.heappop(self._free_slots)
        self._slot_of[index] = slot
        prompt = list(prompt or [])
        known = prompt + list(output)
        states = self.req_states
        self._write_tokens(slot, 0, known)
        states.prompt_len.np[slot] = len(prompt)
        states.prefill_len.np[slot] = len(known)
        states.total_len.stage_write_elem(slot, len(known))
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
                self.req_states.total_len.stage_write_elem(slot, total)
                self._synced_len[slot] = total

    def _publish(self) -> None:
        """Makes this step's writes to ``req_states`` visible on the device."""
        states = self.req_states
        states.all_token_ids.apply_write()
        states.total_len.apply_write()
        states.prompt_len.copy_to_uva()
        states.prefill_len.copy_to_uva()

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update:
            for index in batch_update.removed:
                self._release(index)
            for index, params, prompt, output in batch_update.added:
                self._add(index, params, prompt, output)
            for a, b, direct in batch_update.moved:
                self._move(a, b, direct)
        self._sync_outputs()
        self._publish()
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
        total_np = self.req_states.total_len.np[idx_np]
        pos_np = np.maximum(total_np - 1, 0)
        last_np = self.req_states.all_token_ids.np[idx_np, pos_np]
        idx = torch.from_numpy(idx_np).to(logits.device)
        ctx = LogitsContext(
            expanded_idx_mapping=idx,
            idx_mapping=idx,
            idx_mapping_np=idx_np,
            expanded_local_pos=torch.zeros(num_rows, dtype=torch.int32, device=logits.device),
            input_ids=torch.from_numpy(last_np).to(logits.device),
            pos=torch.from_numpy(pos_np).to(logits.device),
            seq_lens_upper_bound_np=total_np.copy(),
        )
        try:
            return self.inner.apply(logits, ctx)
        except Exception as exc:
            # The slot interface knows which requests it acts on: only their rows fail.
            message = str(PluginHookError(self.inner, "apply", exc))
            rows = {row: message for row, slot in enumerate(slots) if self._active.get(slot, False)}
            raise LogitsProcessorRowsError(rows, logits) from exc
