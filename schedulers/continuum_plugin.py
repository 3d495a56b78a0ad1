"""The builtin Continuum plugin: registers the ``continuum`` scheduler and the tool-call estimators ``fixed``
and ``utility``, through the same hooks third parties use (the tool-call parsers it reads tool names with are
``vllite.plugins.tool_parsers``, found through the registry)."""

from __future__ import annotations

from vllite.hookspecs import Register, hookimpl


@hookimpl
def vllite_register_schedulers(register: Register) -> None:
    """Registers ``continuum`` (ContinuumScheduler)."""
    register("continuum", "vllite.policies.continuum:ContinuumScheduler")


@hookimpl
def vllite_register_tool_call_estimators(register: Register) -> None:
    """Registers ``fixed`` (the released fork's 2 s rule) and ``utility`` (the paper's Eq. 2, the default)."""
    register("fixed", "vllite.policies.estimators:FixedTTLEstimator")
    register("utility", "vllite.policies.estimators:UtilityEstimator")
