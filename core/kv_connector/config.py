"""``KVTransferConfig``: vLLM's ``--kv-transfer-config`` JSON, checked once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector to build and how (field names as vLLM's).

    ``kv_connector`` is a registered name (``vllite_register_kv_connectors``) or, with ``kv_connector_module_path``,
    a class in that module; ``kv_role`` says whether this engine saves KV (producer), loads it (consumer) or both;
    ``kv_connector_extra_config`` is the connector's own settings; ``kv_load_failure_policy`` says what a failed
    load does: ``fail`` the request, or ``recompute`` the blocks that did not load.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_transfer_config.kv_connector must name a connector (a registered name or a class).")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}.")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}."
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object.")
        if self.kv_connector_module_path is not None and not self.kv_connector_module_path:
            raise ValueError("kv_transfer_config.kv_connector_module_path must not be empty.")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any = None) -> Any:
        """One of the connector's own settings."""
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> KVTransferConfig:
        """From the flag's JSON text (or an already decoded dict); ``ValueError`` naming the bad field."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"--kv-transfer-config is not valid JSON: {exc}.") from None
        if not isinstance(value, dict):
            raise ValueError("--kv-transfer-config must be a JSON object.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown fields {unknown}; known: {sorted(known)}.")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config.kv_connector is required.")
        return cls(**value)
