"""A third-party vLLM logits processor on the slot-based (Model Runner V2) interface: a DRY repetition penalty.

It imports ``vllm.v1.worker.gpu.sample.logits_processor`` as vLLM's documentation for that interface does;
it runs on vLLM and, unchanged, on vllite.
"""

from __future__ import annotations

from vllm_example_dry.processor import (
    ALLOWED_LENGTH_ARG,
    BASE_ARG,
    MULTIPLIER_ARG,
    RANGE_ARG,
    DRYLogitsProcessor,
    dry_penalties,
)

__all__ = ["ALLOWED_LENGTH_ARG", "BASE_ARG", "MULTIPLIER_ARG", "RANGE_ARG", "DRYLogitsProcessor", "dry_penalties"]
