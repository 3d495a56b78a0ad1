"""A third-party vLLM logits processor built from a per-request (V0-style) callable.

``WrappedPerReqLogitsProcessor`` wraps ``DummyPerReqLogitsProcessor`` with vLLM's ``AdapterLogitsProcessor``,
importing ``vllm`` exactly as vLLM's documented example does; it runs on vLLM and, unchanged, on vllite.
"""

from __future__ import annotations

from vllm_example_per_request.processor import DummyPerReqLogitsProcessor, WrappedPerReqLogitsProcessor

__all__ = ["DummyPerReqLogitsProcessor", "WrappedPerReqLogitsProcessor"]
