"""``vllite.testing`` is the one test-support package; its old import paths still work for one release and warn."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import vllite.testing
from vllite.executor import Executor


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_package_exports_the_renamed_fakes():
    assert issubclass(vllite.testing.PositionTokenExecutor, Executor)
    assert not issubclass(vllite.testing.ScriptedModelRunner, Executor)  # a stand-in for a model runner
    for name in vllite.testing.__all__:
        assert getattr(vllite.testing, name) is not None
    assert "plugin authors" in (vllite.testing.__doc__ or "")


def test_old_scheduler_testing_path_warns_and_aliases():
    with pytest.warns(DeprecationWarning, match=r"vllite\.sched\.testing is deprecated"):
        old = _fresh_import("vllite.sched.testing")
    assert old.FakeExecutor is vllite.testing.ScriptedModelRunner
    assert old.make_config is vllite.testing.make_config
    assert old.make_request is vllite.testing.make_request
    assert old.make_model_runner_output is vllite.testing.make_model_runner_output


def test_old_engine_proc_testing_path_warns_and_aliases():
    with pytest.warns(DeprecationWarning, match=r"vllite\.plugins\.engine_proc\.testing is deprecated"):
        old = _fresh_import("vllite.plugins.engine_proc.testing")
    assert old.FakeTokenExecutor is vllite.testing.PositionTokenExecutor


def test_new_executor_class_path_resolves_without_warning():
    from vllite.plugin_manager import resolve_class_path

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cls = resolve_class_path("vllite.testing.executors:PositionTokenExecutor")
    assert cls is vllite.testing.PositionTokenExecutor


def test_old_executor_class_path_resolves_with_warning():
    from vllite.plugin_manager import resolve_class_path

    sys.modules.pop("vllite.plugins.engine_proc.testing", None)
    with pytest.warns(DeprecationWarning):
        cls = resolve_class_path("vllite.plugins.engine_proc.testing:FakeTokenExecutor")
    assert cls is vllite.testing.PositionTokenExecutor
