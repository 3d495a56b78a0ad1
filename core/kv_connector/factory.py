"""Building a connector from ``KVTransferConfig``: a class path takes priority over the registry, as in vLLM."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vllite.exceptions import PluginLoadError
from vllite.kv_connector.base import KVConnectorBase, KVConnectorRole

if TYPE_CHECKING:
    from vllite.config import EngineConfig
    from vllite.kv_connector.config import KVTransferConfig


def connector_class(kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase]:
    """The connector class ``kv_transfer_config`` names: ``kv_connector`` in ``kv_connector_module_path``, else
    the registered ``kv_connector``, else ``kv_connector`` as ``pkg.mod:Class``."""
    name = kv_transfer_config.kv_connector
    module_path = kv_transfer_config.kv_connector_module_path
    if module_path is not None:
        try:
            cls = getattr(importlib.import_module(module_path), name)
        except (ImportError, AttributeError) as exc:
            raise PluginLoadError(
                f"KV connector {name!r} from kv_connector_module_path {module_path!r} cannot be loaded: {exc}",
                plugin=module_path,
            ) from exc
    else:
        from vllite.plugin_manager import resolve_component

        cls = resolve_component("kv_connectors", name)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise PluginLoadError(
            f"KV connector {name!r} is {cls!r}, not a subclass of vllite.kv_connector.KVConnectorBase.", plugin=name
        )
    return cls


def create_connector(
    config: EngineConfig, role: KVConnectorRole, kv_transfer_config: KVTransferConfig
) -> KVConnectorBase:
    """One role of the configured connector."""
    return connector_class(kv_transfer_config)(config, role, kv_transfer_config)
