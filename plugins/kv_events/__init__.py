"""KV-cache event publishers (``--kv-events-config``'s ``publisher``), registered on the
``vllite_register_kv_event_publishers`` hook.

``zmq``: each engine step's ``KVEventBatch`` as a msgpack frame on a ZMQ PUB socket, with vLLM's framing, and the
replay socket. The events themselves and the config are the kernel's (``vllite.kv_events``): the block pool
records them, and the engine core hands each step's events to the publisher the config names.
"""
