"""Renamed packages and moved modules keep their old import names for one release: same objects, with a warning.

``vllite.schedulers`` is now ``vllite.policies``, ``vllite.plugins.executor`` is now
``vllite.plugins.transformers_executor``, and the builtins that lived in the kernel (the KV connectors, the grammar
backends, the CPU thread placement, the engine wire, the builtin commands, the vLLM compatibility layer) are plugins
(see ``vllite.deprecated_aliases``).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

# Each of these two registers the modules that moved out of it when it is imported.
import vllite.plugins.openai_server
import vllite.policies  # noqa: F401
from vllite.deprecated_aliases import MOVED_ATTRIBUTES, MOVED_MODULES, RENAMED_PACKAGES
from vllite.plugin_manager import BUILTIN_PLUGINS, resolve_class_path

#: names a builtin package re-exported and that moved within its plugin, kept by the package's own table.
PLUGIN_MOVED_ATTRIBUTES = [
    ("vllite.plugins.bench.agent_bench", "run_sweep", "vllite.plugins.bench.agent_report"),
    ("vllite.plugins.bench.agent_bench", "RunResult", "vllite.plugins.bench.agent_report"),
    ("vllite.plugins.openai_server.realtime", "realtime_router", "vllite.plugins.openai_server.realtime.session"),
    (
        "vllite.plugins.openai_server.responses_api",
        "create_response",
        "vllite.plugins.openai_server.responses_api.routes",
    ),
]

CASES = [
    ("vllite.schedulers", "vllite.policies"),
    ("vllite.schedulers.continuum", "vllite.policies.continuum"),
    ("vllite.schedulers.fcfs", "vllite.policies.fcfs"),
    ("vllite.plugins.executor", "vllite.plugins.transformers_executor"),
    ("vllite.plugins.executor.executor", "vllite.plugins.transformers_executor.executor"),
    ("vllite.plugins.executor.input_batch", "vllite.plugins.transformers_executor.input_batch"),
    *sorted(MOVED_MODULES.items()),
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


def test_every_moved_module_is_gone_from_the_kernel_folder():
    kernel = Path(__file__).resolve().parents[1] / "core"
    for old in MOVED_MODULES:
        relative = Path(*old.split(".")[1:])
        assert not (kernel / relative.with_suffix(".py")).exists(), old
        assert not list((kernel / relative).glob("*.py")), old  # a moved package leaves no module behind


@pytest.mark.parametrize(
    ("package", "name", "module"),
    [(package, name, module) for package, names in MOVED_ATTRIBUTES.items() for name, module in names.items()]
    + PLUGIN_MOVED_ATTRIBUTES,
)
def test_moved_kernel_reexports_warn_and_are_the_new_objects(package, name, module):
    kernel_package = importlib.import_module(package)
    with pytest.warns(DeprecationWarning, match=rf"{package}.{name} is deprecated.*import it from {module} instead"):
        old = getattr(kernel_package, name)
    assert old is getattr(importlib.import_module(module), name)


def test_each_builtin_package_registers_the_modules_that_moved_out_of_it():
    moved_out = {old.rsplit(".", 1)[0] for old in MOVED_MODULES}
    assert {"vllite.policies", "vllite.plugins.openai_server"} <= moved_out
    assert MOVED_MODULES["vllite.policies.tool_parsers"] == "vllite.plugins.tool_parsers.parsers"
    assert MOVED_MODULES["vllite.plugins.openai_server.bench"] == "vllite.plugins.bench.serve"


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ImportError, match="no_such_name"):
        from vllite.kv_cache import no_such_name  # noqa: F401


def test_old_names_give_the_same_classes():
    from vllite.plugins.transformers_executor.executor import DefaultExecutor
    from vllite.policies.continuum import ContinuumScheduler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllite.kv_connector.offload import OffloadConnector as OldOffloadConnector
        from vllite.plugins.executor.executor import DefaultExecutor as OldDefaultExecutor
        from vllite.schedulers.continuum import ContinuumScheduler as OldContinuumScheduler
        from vllite.structured_output.xgrammar_backend import XgrammarBackend as OldXgrammarBackend
    from vllite.plugins.kv_connectors.offload import OffloadConnector
    from vllite.plugins.structured_outputs.xgrammar_backend import XgrammarBackend

    assert OldContinuumScheduler is ContinuumScheduler
    assert OldDefaultExecutor is DefaultExecutor
    assert OldOffloadConnector is OffloadConnector
    assert OldXgrammarBackend is XgrammarBackend


def test_the_old_vllm_compat_name_is_the_moved_layer(monkeypatch):
    import vllite
    from vllite.plugins import vllm_compat
    from vllite.plugins.vllm_compat.finder import VllmCompatFinder

    monkeypatch.delattr(vllite, "vllm_compat", raising=False)  # set by an earlier import of the old name
    monkeypatch.delitem(sys.modules, "vllite.vllm_compat", raising=False)
    monkeypatch.delitem(sys.modules, "vllite.vllm_compat.finder", raising=False)
    with pytest.warns(DeprecationWarning, match=r"vllite.vllm_compat is deprecated"):
        from vllite import vllm_compat as old_vllm_compat
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllite.vllm_compat.finder import VllmCompatFinder as OldVllmCompatFinder

    assert old_vllm_compat is vllm_compat and old_vllm_compat.activate is vllm_compat.activate
    assert OldVllmCompatFinder is VllmCompatFinder


def test_old_class_paths_resolve_to_the_same_classes():
    from vllite.policies.priority import PriorityScheduler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert resolve_class_path("vllite.schedulers.priority:PriorityScheduler") is PriorityScheduler
        assert resolve_class_path("vllite.schedulers.priority.PriorityScheduler") is PriorityScheduler


def test_builtins_and_new_names_import_without_warnings():
    old_names = [*RENAMED_PACKAGES, *MOVED_MODULES]
    assert not [m for m in BUILTIN_PLUGINS if any(m == old or m.startswith(old + ".") for old in old_names)]
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import importlib, vllite.plugin_manager as pm\n"
        "[importlib.import_module(m) for m in pm.BUILTIN_PLUGINS]\n"
        "import vllite.policies.continuum, vllite.plugins.transformers_executor.executor\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_args_moved_out_of_config_but_the_top_level_name_does_not_warn():
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import vllite\nfrom vllite.engine_args import EngineArgs\n"
        "assert vllite.EngineArgs is EngineArgs\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.warns(DeprecationWarning, match="vllite.config.EngineArgs is deprecated"):
        from vllite.config import EngineArgs as OldEngineArgs
    assert OldEngineArgs is importlib.import_module("vllite.engine_args").EngineArgs


def test_warning_points_at_the_importing_code():
    code = "import warnings; warnings.simplefilter('always')\nimport vllite.schedulers.fcfs\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "<string>:2: DeprecationWarning: vllite.schedulers is deprecated" in proc.stderr
