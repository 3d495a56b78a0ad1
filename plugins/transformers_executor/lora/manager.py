"""``LoRAModelManager``: one model's LoRA layers, its loaded adapters and their device slots, driven per step.

The model runner owns it: it adds the adapters of new requests (:meth:`~LoRAModelManager.add_adapter`), and
before each forward pass hands it the adapter id of every token (:meth:`~LoRAModelManager.prepare_step`). The
manager knows nothing of requests or scheduling.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from vllite.lora import LoRAConfig, LoRARequest
from vllite.plugins.transformers_executor.lora.adapter import LoRAAdapter, load_adapter
from vllite.plugins.transformers_executor.lora.batch import LoRABatch
from vllite.plugins.transformers_executor.lora.errors import LoRAAdapterError, adapter_error
from vllite.plugins.transformers_executor.lora.host_cache import AdapterHostCache
from vllite.plugins.transformers_executor.lora.layers import LoRALayer, wrap_targets
from vllite.plugins.transformers_executor.lora.slots import SlotTable
from vllite.plugins.transformers_executor.lora.targets import ModelTargets, find_targets

logger = logging.getLogger(__name__)


def resolve_lora_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The adapters' compute dtype: ``config.lora_dtype``, ``auto`` being ``model_dtype``."""
    if config.lora_dtype == "auto":
        return model_dtype
    dtype = getattr(torch, config.lora_dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


class LoRAModelManager:
    """Serves up to ``config.max_loras`` adapters per step on ``model`` (a transformers causal LM on ``device``).

    At construction every LoRA target of the model (:func:`~.targets.find_targets`: the decoder layers' linear
    projections and the input embedding) is replaced by a LoRA layer with ``max_loras`` slots of rank
    ``max_lora_rank`` in the LoRA dtype (``dtype``, the model's, under ``lora_dtype="auto"``), so any adapter's
    subset of modules fits. Up to ``config.host_capacity`` adapters stay loaded on the host (least recently used
    evicted, pinned ones never); a step's adapters are copied into device slots only when not already there.
    While no token of a step uses an adapter the model runs exactly as unwrapped.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype) -> None:
        if any(isinstance(m, LoRALayer) for m in model.modules()):
            raise LoRAAdapterError(f"{type(model).__name__} already carries LoRA layers (one manager per model)")
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.lora_dtype = resolve_lora_dtype(config, dtype)
        self.targets: ModelTargets = find_targets(model)
        if not self.targets.modules:
            raise LoRAAdapterError(f"{type(model).__name__} has no module LoRA can target")
        self.batch = LoRABatch(config.max_loras, config.max_lora_rank, self.device, self.lora_dtype)
        self.layers: dict[str, LoRALayer] = wrap_targets(model, self.targets, self.batch)
        self._host = AdapterHostCache(config.host_capacity)
        self._slots = SlotTable(config.max_loras)
        logger.info(
            "LoRA: %d modules wrapped, %d slots of rank %d (%s), host cache of %d adapters",
            len(self.layers),
            config.max_loras,
            config.max_lora_rank,
            self.lora_dtype,
            config.host_capacity,
        )

    # ------------------------------------------------------------------ host adapters
    def add_adapter(self, request: LoRARequest) -> bool:
        """Loads and validates the adapter at ``request.lora_path`` into the host cache; ``False`` (and marked
        recently used) when ``request.lora_int_id`` is already loaded. A full cache evicts its least recently used
        unpinned adapter. Raises :class:`LoRAAdapterError` for an invalid adapter, for a name already loaded under
        another id (or an id loaded under another name), and when the cache is full of pinned adapters."""
        lora_id, name = request.lora_int_id, request.lora_name
        loaded = self._host.get(lora_id)
        if loaded is not None:
            if loaded.name != name:
                raise adapter_error(name, f"lora_int_id {lora_id} is already loaded as adapter {loaded.name!r}")
            self._host.touch(lora_id)
            return False
        other = self._host.id_of_name(name)
        if other is not None:
            raise adapter_error(
                name, f"is already loaded under lora_int_id {other}; one adapter name cannot take id {lora_id} too"
            )
        self._host.check_room(name)
        adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
        for evicted in self._host.add(adapter):
            self._slots.release(evicted.int_id)
            logger.info("LoRA adapter %r (id %d) evicted from the host cache", evicted.name, evicted.int_id)
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", name, lora_id, adapter.rank, adapter.path)
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Unloads an adapter (pinned or not) and frees its device slot; ``False`` when it was not loaded."""
        if self._host.remove(lora_int_id) is None:
            return False
        self._slots.release(lora_int_id)
        return True

    def pin_adapter(self, lora_int_id: int) -> bool:
        """Keeps a loaded adapter on the host until it is removed; ``False`` when it already was pinned. Raises
        :class:`LoRAAdapterError` for an id that is not loaded."""
        if lora_int_id not in self._host:
            raise LoRAAdapterError(f"cannot pin LoRA adapter id {lora_int_id}: it is not loaded")
        return self._host.pin(lora_int_id)

    def list_adapters(self) -> set[int]:
        """The ids of the loaded adapters."""
        return self._host.ids()

    def get_adapter(self, lora_int_id: int) -> LoRAAdapter | None:
        """The loaded adapter ``lora_int_id``, or ``None``."""
        return self._host.get(lora_int_id)

    def resident_adapters(self) -> dict[int, int]:
        """Adapter id → device slot, for every adapter currently in a slot."""
        return self._slots.residents()

    # ------------------------------------------------------------------ per step
    def prepare_step(self, token_lora_ids: np.ndarray) -> None:
        """Sets the adapter of each token of the next forward pass (``[num_tokens]`` ints, 0 = base model, in the
        order the model sees the tokens, leading input dimensions flattened).

        Gives each distinct adapter a device slot (keeping resident ones, evicting slots this step does not use,
        least recently used first), writes the weights of newly placed adapters, and publishes the per-token slots
        to the LoRA layers. A step without adapters costs nothing in the forward. Raises :class:`LoRAAdapterError`
        for more than ``max_loras`` distinct adapters, or an id that is not loaded (or negative).
        """
        ids = np.asarray(token_lora_ids).reshape(-1)
        if ids.size == 0 or not ids.any():
            self.clear_step()
            return
        unique, inverse = np.unique(ids, return_inverse=True)
        adapter_ids = [int(i) for i in unique if i != 0]
        self._check_step(adapter_ids)
        for lora_id in adapter_ids:
            self._host.touch(lora_id)
        mapping, writes = self._slots.assign(adapter_ids)
        for lora_id, slot in writes:
            adapter = self._host.get(lora_id)
            assert adapter is not None
            self._write_slot(slot, adapter)
        slot_of_unique = np.array([mapping.get(int(i), -1) for i in unique], dtype=np.int64)
        token_slots = torch.from_numpy(slot_of_unique[inverse.reshape(-1)]).to(self.device)
        self.batch.set_token_slots(token_slots)

    def clear_step(self) -> None:
        """The next forward pass runs without adapters, whatever its token count (e.g. a dummy or profiling run)."""
        self.batch.clear()

    def _check_step(self, adapter_ids: list[int]) -> None:
        """Raises for a negative id, an id not loaded, or more distinct adapters than slots."""
        bad = [i for i in adapter_ids if i < 0]
        if bad:
            raise LoRAAdapterError(f"LoRA step: adapter ids must be >= 0 (0 = base model), got {bad[0]}")
        missing = [i for i in adapter_ids if i not in self._host]
        if missing:
            raise LoRAAdapterError(
                f"LoRA step uses adapter id {missing[0]}, which is not loaded (loaded: {sorted(self._host.ids())})"
            )
        if len(adapter_ids) > self.config.max_loras:
            raise LoRAAdapterError(
                f"LoRA step uses {len(adapter_ids)} distinct adapters {adapter_ids}, more than max_loras="
                f"{self.config.max_loras}"
            )

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies ``adapter`` into ``slot`` of every layer (zeros where the adapter leaves a module alone)."""
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter.modules.get(name))
