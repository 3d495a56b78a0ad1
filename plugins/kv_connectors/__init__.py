"""The builtin KV connectors, registered by ``plugin`` through ``vllite_register_kv_connectors`` as a third party's.

``shared-storage`` (prompt-prefix KV persisted to a directory), ``offload`` (a bounded KV tier in host memory, with
an optional disk layer) and ``p2p`` (prefill/decode disaggregation over ZMQ); each has a scheduler side and a worker
side. The contract they implement is ``vllite.kv_connector`` (base classes, config, factory, metadata).
"""
