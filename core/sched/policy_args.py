"""The ``policy_args`` contract: each scheduler class names the keys it reads, so a typo is an error, not a no-op."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_policy_args(scheduler_name: str, given: Mapping[str, Any], accepted: Mapping[str, str]) -> None:
    """Raises ``ValueError`` naming every key of ``given`` that is not in ``accepted`` (name → description),
    listing the accepted ones."""
    unknown = sorted(set(given) - set(accepted))
    if not unknown:
        return
    if accepted:
        valid = "; ".join(f"{name}: {description}" for name, description in sorted(accepted.items()))
        hint = f"Valid keys for {scheduler_name}: {valid}."
    else:
        hint = f"{scheduler_name} accepts no policy_args."
    raise ValueError(f"Unknown policy_args key(s) {', '.join(map(repr, unknown))}. {hint}")
