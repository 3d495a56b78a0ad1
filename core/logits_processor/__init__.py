"""The logits-processor framework (vLLM V1 compatible).

- :class:`LogitsProcessor`, :class:`BatchUpdate`, :class:`MoveDirectionality`: the interface.
- :class:`BatchUpdateBuilder`: how the persistent batch reports a step's changes.
- :class:`LogitsProcessors`: the engine's processors, split by argmax invariance.
- :func:`process_dict_updates`: the standard sparse per-request state update.
- :class:`AdapterLogitsProcessor`: per-request callables as a batch processor.
- vLLM's newer slot-based processors (``add_request`` / ``apply(logits, ctx)``) are loaded too: their interface,
  the staged host/device buffers and the adapter onto ``BatchUpdate`` are the vLLM compatibility layer's
  (``vllite.plugins.vllm_compat.slot_interface``, ``.buffers``, ``.slot_adapter``).
- :func:`build_logitsprocs`, :func:`load_logitsprocs_classes`, :func:`validate_sampling_params`: loading.

Importing this package does not import torch; the processors import it when they run.
"""

from __future__ import annotations

from vllite import deprecated_aliases
from vllite.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from vllite.logits_processor.builder import BatchUpdateBuilder
from vllite.logits_processor.container import LogitsProcessors
from vllite.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from vllite.logits_processor.loader import (
    LOGITSPROCS_GROUP,
    LOGITSPROCS_GROUPS,
    LoadedLogitsProcessor,
    build_logitsprocs,
    check_logitsproc_class,
    load_logitsprocs,
    load_logitsprocs_classes,
    validate_sampling_params,
)
from vllite.logits_processor.state import process_dict_updates

__all__ = [
    "LOGITSPROCS_GROUP",
    "LOGITSPROCS_GROUPS",
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LoadedLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "build_logitsprocs",
    "check_logitsproc_class",
    "load_logitsprocs",
    "load_logitsprocs_classes",
    "process_dict_updates",
    "validate_sampling_params",
]


def __getattr__(name: str) -> object:
    return deprecated_aliases.moved_attribute(__name__, name)  # the slot interface, now the vLLM compatibility layer's
