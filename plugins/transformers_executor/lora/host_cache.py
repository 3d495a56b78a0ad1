"""``AdapterHostCache``: the loaded adapters on the host, least recently used first, bounded, with pins."""

from __future__ import annotations

from collections import OrderedDict

from vllite.plugins.transformers_executor.lora.adapter import LoRAAdapter
from vllite.plugins.transformers_executor.lora.errors import adapter_error


class AdapterHostCache:
    """Up to ``capacity`` adapters by ``lora_int_id`` in least-recently-used order. Adding to a full cache evicts
    the least recently used unpinned adapter; a pinned adapter stays until removed. Each adapter name is held
    under one id only."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"AdapterHostCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def ids(self) -> set[int]:
        """The ids of the loaded adapters."""
        return set(self._adapters)

    def get(self, lora_int_id: int) -> LoRAAdapter | None:
        """The adapter loaded under ``lora_int_id`` (its recency unchanged), or ``None``."""
        return self._adapters.get(lora_int_id)

    def touch(self, lora_int_id: int) -> None:
        """Marks a loaded adapter most recently used."""
        self._adapters.move_to_end(lora_int_id)

    def id_of_name(self, lora_name: str) -> int | None:
        """The id under which an adapter named ``lora_name`` is loaded, or ``None``."""
        return next((i for i, a in self._adapters.items() if a.name == lora_name), None)

    def is_pinned(self, lora_int_id: int) -> bool:
        """Whether ``lora_int_id`` is pinned."""
        return lora_int_id in self._pinned

    def check_room(self, lora_name: str) -> None:
        """Raises :class:`LoRAAdapterError` when the cache is full of pinned adapters (nothing can be evicted)."""
        if len(self._adapters) >= self.capacity and self._pinned >= self._adapters.keys():
            raise adapter_error(
                lora_name,
                f"cannot be loaded: the host cache holds {self.capacity} adapters (max_cpu_loras), all pinned; "
                "remove one first",
            )

    def add(self, adapter: LoRAAdapter) -> list[LoRAAdapter]:
        """Inserts ``adapter`` (its id not loaded) as most recently used; returns the adapters evicted for room."""
        self.check_room(adapter.name)
        evicted: list[LoRAAdapter] = []
        while len(self._adapters) >= self.capacity:
            victim = next(i for i in self._adapters if i not in self._pinned)
            evicted.append(self._adapters.pop(victim))
        self._adapters[adapter.int_id] = adapter
        return evicted

    def remove(self, lora_int_id: int) -> LoRAAdapter | None:
        """Drops ``lora_int_id`` (pinned or not); returns it, or ``None`` when it was not loaded."""
        self._pinned.discard(lora_int_id)
        return self._adapters.pop(lora_int_id, None)

    def pin(self, lora_int_id: int) -> bool:
        """Pins a loaded adapter; ``False`` when it already was."""
        if lora_int_id in self._pinned:
            return False
        self._pinned.add(lora_int_id)
        return True
