"""Registers the in-process engine client as a builtin plugin."""

from __future__ import annotations

from typing import Any

from vllite.hookspecs import hookimpl


@hookimpl
def vllite_register_engine_clients(register: Any) -> None:
    from vllite.engine.core_client import InprocClient

    register("inprocess", InprocClient)
