"""The ``vllite`` command and the light import: ``--version``, ``plugins``, ``generate``, ``chat``, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.plugin_utils import forget_modules, make_distribution
from vllite import __version__, plugin_manager
from vllite.cli import main
from vllite.testing import make_tiny_model_dir_cached


def test_import_vllite_does_not_import_torch():
    code = "import sys, vllite, vllite.cli, vllite.plugin_manager; print('torch' in sys.modules, 'zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


HEAVY_MODULES = (
    "torch",
    "transformers",
    "matplotlib",
    "vllite.plugins.bench.agent_bench",
    "vllite.plugins.bench.agent_report",
    "vllite.plugins.bench.traces",
    "vllite.plugins.bench.sim_executor",
)


def test_start_up_imports_neither_torch_nor_the_agent_bench():
    """``vllite --help`` builds every subcommand's parser; the replay and the simulator load when their command runs."""
    code = (
        "import sys\n"
        "from vllite.cli import build_parser\n"
        "build_parser().format_help()\n"
        "from vllite.plugins.bench.plugin import vllite_register_executors\n"
        "vllite_register_executors(register=lambda name, obj: None)\n"
        f"print([m for m in {HEAVY_MODULES!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vllite {__version__}"


def test_plugins_lists_builtins_with_their_components(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["vllite.policies.builtin"]["components"]["schedulers"] == ["fcfs", "priority"]
    assert "vllite_register_commands" in rows["vllite.plugins.commands.plugin"]["hooks"]
    assert "continuum" in rows["vllite.policies.continuum_plugin"]["components"]["schedulers"]
    # Each builtin says whether it is essential or default, its short name, and that it is loaded.
    assert {(row["builtin"], row["short_name"], row["status"]) for row in rows.values() if row["builtin"]} == {
        *(("essential", name, "loaded") for name in plugin_manager.ESSENTIAL_PLUGINS),
        *(("default", name, "loaded") for name in plugin_manager.DEFAULT_PLUGINS),
    }


LOGITS_PROCESSOR_MODULE = """
class Proc:
    def __init__(self, vllm_config, device, is_pin_memory): ...
    def apply(self, logits): return logits
    def is_argmax_invariant(self): return True
    def update_state(self, batch_update): ...
"""


@pytest.fixture
def plugin_env(tmp_path, monkeypatch):
    """No plugin filter, a throwaway site folder on sys.path, and a fresh plugin manager before and after."""
    monkeypatch.delenv("VLLITE_PLUGINS", raising=False)
    monkeypatch.delenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin_manager.reset_plugin_manager()
    yield tmp_path
    plugin_manager.reset_plugin_manager()


def _plugins_json(capsys) -> dict[str, dict]:
    assert main(["plugins", "--json"]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def test_plugins_lists_the_installed_logits_processor_example(plugin_env, capsys):
    pytest.importorskip("vllite_force_token", reason="examples/plugins/vllite-force-token is not installed")
    row = _plugins_json(capsys)["force_token"]
    assert row["distribution"].startswith("vllite-force-token ")
    assert row["group"] == "vllm.logits_processors"
    assert row["entry_point"] == "vllite_force_token:ForceTokenLogitsProcessor"
    assert row["components"] == {"logits_processors": ["force_token"]}
    assert main(["plugins"]) == 0
    assert "force_token  [vllite-force-token 0.1.0]  (group vllm.logits_processors)" in capsys.readouterr().out


def test_plugins_lists_the_vllite_logits_processors_group_and_obeys_the_filter(plugin_env, capsys, monkeypatch):
    forget_modules("cli_lp_mod")
    make_distribution(
        plugin_env,
        "cli-lp-dist",
        {"vllite.logits_processors": {"cli_lp": "cli_lp_mod:Proc"}},
        {"cli_lp_mod": LOGITS_PROCESSOR_MODULE},
    )
    row = _plugins_json(capsys)["cli_lp"]
    assert (row["distribution"], row["group"]) == ("cli-lp-dist 1.0", "vllite.logits_processors")
    assert _plugins_json(capsys)["vllite.policies.builtin"]["group"] is None

    monkeypatch.setenv("VLLITE_PLUGINS", "something-else")
    plugin_manager.reset_plugin_manager()
    assert "cli_lp" not in _plugins_json(capsys)
    monkeypatch.setenv("VLLITE_PLUGINS", "cli_lp")
    plugin_manager.reset_plugin_manager()
    assert "cli_lp" in _plugins_json(capsys)
    monkeypatch.delenv("VLLITE_PLUGINS")
    monkeypatch.setenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", "1")
    plugin_manager.reset_plugin_manager()
    assert "cli_lp" not in _plugins_json(capsys)


def test_plugins_reports_a_broken_logits_processor_like_engine_start_up(plugin_env, capsys):
    forget_modules("cli_lp_broken_mod")
    make_distribution(
        plugin_env,
        "cli-lp-broken",
        {"vllm.logits_processors": {"cli_broken": "cli_lp_broken_mod:Missing"}},
        {"cli_lp_broken_mod": "X = 1\n"},
    )
    assert main(["plugins"]) == 0  # listed without importing it
    out = capsys.readouterr().out
    assert "cli_broken  [cli-lp-broken 1.0]" in out and "BROKEN" not in out
    assert main(["plugins", "--check"]) == 1  # imported, checked, marked: not a crash
    out, err = capsys.readouterr()
    assert "    BROKEN: Failed to load entry point 'cli_broken'" in out
    assert "cli_broken" in err and "cli-lp-broken" in err


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(make_tiny_model_dir_cached("llama"))


def test_generate(tiny_model, capsys):
    assert main(["generate", "--model", tiny_model, "--max-tokens", "5", "--dtype", "float32", "def f(x):"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and len(out.strip()) > len("def f(x):")


def test_chat_scripted(tiny_model, capsys):
    assert main(["chat", "--model", tiny_model, "--max-tokens", "4", "--message", "hi", "--message", "more"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 1


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "hello"]) == 1
    assert "nope" in capsys.readouterr().err


def test_unknown_scheduler_lists_available(tiny_model, capsys):
    code = main(["generate", "--model", tiny_model, "--scheduler-cls", "nonesuch", "--max-tokens", "2", "x"])
    assert code != 0
    err = capsys.readouterr().err
    assert "nonesuch" in err and "fcfs" in err
