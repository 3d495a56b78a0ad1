"""The builtin KV connectors, registered by ``plugin`` through ``vllite_register_kv_connectors`` as a third party's.

``shared-storage`` (prompt-prefix KV persisted to a directory), ``offload`` (a bounded KV tier in host memory, with
an optional disk layer) and ``p2p`` (prefill/decode disaggregation over ZMQ); each has a scheduler side and a worker
side. The contract they implement is ``vllite.kv_connector`` (base classes, config, factory, metadata).
``scheduling`` drives whichever connector is configured, builtin or not, from inside the scheduler (parked loads,
delayed frees, load failures): the kernel's ``vllite.kv_connector.scheduler_side`` builds it by class path.
"""
