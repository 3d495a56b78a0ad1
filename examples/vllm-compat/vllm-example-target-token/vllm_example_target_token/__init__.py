"""A third-party vLLM logits processor: force a per-request target token (``extra_args["target_token"]``).

Written against vLLM's V1 ``LogitsProcessor`` interface, importing ``vllm`` exactly as vLLM's documented
``DummyLogitsProcessor`` does; it runs on vLLM and, unchanged, on vllite (which serves those ``vllm`` names
when vLLM is not installed).
"""

from __future__ import annotations

from vllm_example_target_token.processor import TARGET_TOKEN_ARG, DummyLogitsProcessor

__all__ = ["TARGET_TOKEN_ARG", "DummyLogitsProcessor"]
