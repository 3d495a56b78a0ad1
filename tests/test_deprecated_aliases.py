"""The renamed packages keep their old import names for one release: same module objects, with a warning.

``vllite.schedulers`` is now ``vllite.policies`` and ``vllite.plugins.executor`` is now
``vllite.plugins.transformers_executor`` (see ``vllite.deprecated_aliases``).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from vllite.deprecated_aliases import RENAMED_PACKAGES
from vllite.plugin_manager import BUILTIN_PLUGINS, resolve_class_path

CASES = [
    ("vllite.schedulers", "vllite.policies"),
    ("vllite.schedulers.continuum", "vllite.policies.continuum"),
    ("vllite.schedulers.fcfs", "vllite.policies.fcfs"),
    ("vllite.plugins.executor", "vllite.plugins.transformers_executor"),
    ("vllite.plugins.executor.executor", "vllite.plugins.transformers_executor.executor"),
    ("vllite.plugins.executor.input_batch", "vllite.plugins.transformers_executor.input_batch"),
]


@pytest.mark.parametrize(("old", "new"), CASES)
def test_old_name_warns_and_is_the_new_module(old, new):
    new_module = importlib.import_module(new)
    spec = new_module.__spec__
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*import {new} instead"):
        old_module = importlib.import_module(old)
    assert old_module is new_module
    assert new_module.__spec__ is spec  # the alias does not clobber the real module's spec
    assert new_module.__name__ == new


def test_old_names_give_the_same_classes():
    from vllite.plugins.transformers_executor.executor import DefaultExecutor
    from vllite.policies.continuum import ContinuumScheduler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllite.plugins.executor.executor import DefaultExecutor as OldDefaultExecutor
        from vllite.schedulers.continuum import ContinuumScheduler as OldContinuumScheduler
    assert OldContinuumScheduler is ContinuumScheduler
    assert OldDefaultExecutor is DefaultExecutor


def test_old_class_paths_resolve_to_the_same_classes():
    from vllite.policies.priority import PriorityScheduler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert resolve_class_path("vllite.schedulers.priority:PriorityScheduler") is PriorityScheduler
        assert resolve_class_path("vllite.schedulers.priority.PriorityScheduler") is PriorityScheduler


def test_builtins_and_new_names_import_without_warnings():
    assert not [m for m in BUILTIN_PLUGINS if any(m.startswith(old) for old in RENAMED_PACKAGES)]
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import importlib, vllite.plugin_manager as pm\n"
        "[importlib.import_module(m) for m in pm.BUILTIN_PLUGINS]\n"
        "import vllite.policies.continuum, vllite.plugins.transformers_executor.executor\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_warning_points_at_the_importing_code():
    code = "import warnings; warnings.simplefilter('always')\nimport vllite.schedulers.fcfs\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "<string>:2: DeprecationWarning: vllite.schedulers is deprecated" in proc.stderr
