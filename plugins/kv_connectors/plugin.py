"""Registers vllite's builtin KV connectors through ``vllite_register_kv_connectors``, as a third party would.

The connector modules import torch, so they are registered by class path: a connector's module is imported when
an engine is configured with it, never when the plugin manager merely lists the registry.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_kv_connectors(register: Register) -> None:
    """``shared-storage``: prompt-prefix KV persisted to a directory (``shared_storage_path``); ``offload``: a
    bounded KV tier in host memory (``offload_size_gib``); ``p2p``: prefill/decode disaggregation over ZMQ."""
    register("shared-storage", "vllite.plugins.kv_connectors.shared_storage:SharedStorageConnector")
    register("offload", "vllite.plugins.kv_connectors.offload:OffloadConnector")
    register("p2p", "vllite.plugins.kv_connectors.p2p:P2PConnector")
