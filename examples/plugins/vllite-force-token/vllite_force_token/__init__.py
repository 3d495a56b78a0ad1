"""Example logits-processor plugin: force a per-request target token (``extra_args["force_token_id"]``)."""

from __future__ import annotations

from vllite_force_token.processor import FORCE_TOKEN_KEY, ForceTokenLogitsProcessor

__all__ = ["FORCE_TOKEN_KEY", "ForceTokenLogitsProcessor"]
