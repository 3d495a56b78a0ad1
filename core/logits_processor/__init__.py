"""The logits-processor framework (vLLM V1 compatible).

- :class:`LogitsProcessor`, :class:`BatchUpdate`, :class:`MoveDirectionality`: the interface.
- :class:`BatchUpdateBuilder`: how the persistent batch reports a step's changes.
- :class:`LogitsProcessors`: the engine's processors, split by argmax invariance.
- :func:`process_dict_updates`: the standard sparse per-request state update.
- :class:`AdapterLogitsProcessor`: per-request callables as a batch processor.
- slot-interface support (vLLM's newer ``add_request`` / ``apply(logits, ctx)`` processors):
  :class:`SlotLogitsProcessor`, :class:`LogitsContext`, :class:`LogitsProcRequestState`, and the staged
  host/device buffers :class:`UvaBackedTensor` and :class:`StagedWriteTensor`.
- :func:`build_logitsprocs`, :func:`load_logitsprocs_classes`, :func:`validate_sampling_params`: loading.

Importing this package does not import torch; the processors import it when they run.
"""

from __future__ import annotations

from vllite.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from vllite.logits_processor.buffers import StagedWriteTensor, UvaBackedTensor
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
from vllite.logits_processor.slot import SlotLogitsProcessorAdapter, adapt_slot_processor, is_slot_interface
from vllite.logits_processor.slot_interface import LogitsContext, LogitsProcRequestState, SlotLogitsProcessor
from vllite.logits_processor.state import process_dict_updates

__all__ = [
    "LOGITSPROCS_GROUP",
    "LOGITSPROCS_GROUPS",
    "AdapterLogitsProcessor",
    "AddedRequest",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LoadedLogitsProcessor",
    "LogitsContext",
    "LogitsProcRequestState",
    "LogitsProcessor",
    "LogitsProcessors",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "SlotLogitsProcessor",
    "SlotLogitsProcessorAdapter",
    "StagedWriteTensor",
    "UvaBackedTensor",
    "adapt_slot_processor",
    "build_logitsprocs",
    "check_logitsproc_class",
    "is_slot_interface",
    "load_logitsprocs",
    "load_logitsprocs_classes",
    "process_dict_updates",
    "validate_sampling_params",
]
