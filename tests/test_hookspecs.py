"""Every hookspec documents when it is called, what it receives and returns, firstresult, and its hot path."""

from __future__ import annotations

import inspect

import pytest

from vllite import hookspecs

HOOKS = [name for name, obj in vars(hookspecs).items() if name.startswith("vllite_") and callable(obj)]


def test_all_design_hooks_exist():
    expected = {
        "vllite_register_schedulers",
        "vllite_register_logits_processors",
        "vllite_register_executors",
        "vllite_register_engine_clients",
        "vllite_register_kv_connectors",
        "vllite_register_tool_call_estimators",
        "vllite_register_tool_parsers",
        "vllite_register_models",
        "vllite_register_commands",
        "vllite_step_observer",
    }
    assert expected <= set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hookspec_docstring_is_complete(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    for phrase in ("When:", "Receives:", "Returns:", "firstresult", "Hot path:"):
        assert phrase in doc, f"{name}'s docstring lacks {phrase!r}"
