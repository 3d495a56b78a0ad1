"""Registers the builtin KV-cache event publisher (``zmq``) as a plugin."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_kv_event_publishers(register: Register) -> None:
    register("zmq", "vllite.plugins.kv_events.zmq_publisher:ZmqEventPublisher")
