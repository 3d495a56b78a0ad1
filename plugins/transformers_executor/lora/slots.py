"""``SlotTable``: which adapter each device slot holds, and the assignment of a step's adapters to slots."""

from __future__ import annotations

from collections.abc import Sequence

from vllite.exceptions import BatchStateError


class SlotTable:
    """``num_slots`` device slots, each empty or holding one adapter id.

    :meth:`assign` keeps every adapter of the step that is already resident where it is, and puts the others in
    empty slots first, then in the slots least recently used by a step among those the step does not use. A step
    never has more adapters than slots (the caller checks), so an assignment always exists.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._holder: list[int | None] = [None] * num_slots
        self._last_used: list[int] = [0] * num_slots  # the step counter at the slot's last use
        self._step = 0

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding ``lora_int_id``, or ``None``."""
        try:
            return self._holder.index(lora_int_id)
        except ValueError:
            return None

    def residents(self) -> dict[int, int]:
        """Adapter id → slot, for every occupied slot."""
        return {holder: slot for slot, holder in enumerate(self._holder) if holder is not None}

    def assign(self, lora_int_ids: Sequence[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the step's distinct ``lora_int_ids``: ``(id → slot, [(id, slot) whose weights must be written
        into the slot]``."""
        if len(set(lora_int_ids)) != len(lora_int_ids) or len(lora_int_ids) > self.num_slots:
            raise BatchStateError(
                f"SlotTable.assign takes at most {self.num_slots} distinct adapter ids, got {list(lora_int_ids)}"
            )
        self._step += 1
        mapping: dict[int, int] = {}
        for lora_id in lora_int_ids:
            slot = self.slot_of(lora_id)
            if slot is not None:
                mapping[lora_id] = slot
                self._last_used[slot] = self._step
        writes: list[tuple[int, int]] = []
        for lora_id in lora_int_ids:
            if lora_id in mapping:
                continue
            slot = self._free_slot()
            self._holder[slot] = lora_id
            self._last_used[slot] = self._step
            mapping[lora_id] = slot
            writes.append((lora_id, slot))
        return mapping, writes

    def _free_slot(self) -> int:
        """An empty slot (the lowest), else the least recently used slot not used by the current step."""
        candidates = [s for s in range(self.num_slots) if self._last_used[s] != self._step]
        empty = [s for s in candidates if self._holder[s] is None]
        if empty:
            return empty[0]
        return min(candidates, key=lambda s: self._last_used[s])

    def release(self, lora_int_id: int) -> int | None:
        """Empties the slot holding ``lora_int_id``; returns it, or ``None`` when the adapter held none."""
        slot = self.slot_of(lora_int_id)
        if slot is not None:
            self._holder[slot] = None
            self._last_used[slot] = 0
        return slot
