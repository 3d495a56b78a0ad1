"""Registers vllite's builtin KV connectors through ``vllite_register_kv_connectors``, as a third party would.

The connector modules import torch, so they are imported only when the ``kv_connectors`` registry is built (a
connector is configured), never when the plugin manager merely loads this module.
"""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_kv_connectors(register: Register) -> None:
    """``shared-storage``: prompt-prefix KV persisted to a directory (``shared_storage_path``); ``offload``: a
    bounded KV tier in host memory (``offload_size_gib``); ``p2p``: prefill/decode disaggregation over ZMQ."""
    from vllite.kv_connector.offload import OffloadConnector
    from vllite.kv_connector.p2p import P2PConnector
    from vllite.kv_connector.shared_storage import SharedStorageConnector

    register("shared-storage", SharedStorageConnector)
    register("offload", OffloadConnector)
    register("p2p", P2PConnector)
