"""Registers the in-process engine client as an essential builtin plugin."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_engine_clients(register: Register) -> None:
    register("inprocess", "vllite.plugins.inprocess_client.client:InprocClient")
