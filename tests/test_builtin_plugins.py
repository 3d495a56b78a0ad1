"""Essential and default builtins (issue 44, item 4), as pytest's ``essential_plugins`` / ``default_plugins``: the
environment's denials (``VLLITE_PLUGINS=-name``, ``VLLITE_DISABLED_PLUGINS=name``) turn a default builtin off by its
short name, an allow list keeps every builtin, denying an essential one stops start-up with a ``PluginLoadError``,
and the engine still generates (FCFS) with every default builtin off."""

from __future__ import annotations

import json

import pytest

from tests.plugin_utils import forget_modules, make_distribution
from vllite import plugin_manager
from vllite.cli import main
from vllite.exceptions import PluginLoadError, UnknownComponentError, VlliteError
from vllite.sampling_params import SamplingParams

FILTER_VARIABLES = ("VLLITE_PLUGINS", "VLLITE_DISABLED_PLUGINS", "VLLITE_DISABLE_PLUGIN_AUTOLOAD")
CONTINUUM = plugin_manager.DEFAULT_PLUGINS["continuum"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Sets the plugin-filter variables (the others unset) and rebuilds the manager; a throwaway site on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def set_env(**values: str) -> plugin_manager.PluginManager:
        for name in FILTER_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        plugin_manager.reset_plugin_manager()
        return plugin_manager.get_plugin_manager()

    set_env.site = tmp_path  # type: ignore[attr-defined]
    plugin_manager.reset_plugin_manager()
    yield set_env
    plugin_manager.reset_plugin_manager()


def test_the_tables():
    essential, default = plugin_manager.ESSENTIAL_PLUGINS, plugin_manager.DEFAULT_PLUGINS
    assert (*essential.values(), *default.values()) == plugin_manager.BUILTIN_PLUGINS
    assert not set(essential) & set(default) and not set(essential.values()) & set(default.values())
    assert len(set(plugin_manager.BUILTIN_PLUGINS)) == len(plugin_manager.BUILTIN_PLUGINS)
    # What LLM(...).generate needs is essential: the FCFS scheduler, the executor, the engine clients and the
    # logits processors behind SamplingParams' min_tokens / logit_bias / min_p.
    assert {"vllite.policies.builtin", "vllite.plugins.transformers_executor.plugin"} <= set(essential.values())
    assert {"vllite.plugins.inprocess_client.plugin", "vllite.builtin_logitsprocs.plugin"} <= set(essential.values())
    assert {"continuum", "bench", "sched_trace", "openai_server", "commands"} <= set(default)


@pytest.mark.parametrize(
    "values",
    [
        {"VLLITE_PLUGINS": "-continuum"},
        {"VLLITE_PLUGINS": "-other,-continuum"},
        {"VLLITE_DISABLED_PLUGINS": "continuum"},
        {"VLLITE_DISABLED_PLUGINS": CONTINUUM},  # its module path works too
        {"VLLITE_PLUGINS": "something", "VLLITE_DISABLED_PLUGINS": "continuum"},
        {"VLLITE_DISABLE_PLUGIN_AUTOLOAD": "1", "VLLITE_DISABLED_PLUGINS": "continuum"},
    ],
)
def test_a_denied_default_builtin_is_not_registered(env, values):
    manager = env(**values)
    assert CONTINUUM not in manager.builtin_names
    assert [b.module for b in manager.builtins if b.disabled] == [CONTINUUM]
    assert "continuum" not in plugin_manager.get_registry("schedulers")
    assert not {"fixed", "utility"} & set(plugin_manager.get_registry("tool_call_estimators"))
    with pytest.raises(UnknownComponentError, match=r"Unknown scheduler 'continuum'\. Available: .*fcfs, priority"):
        plugin_manager.resolve_component("schedulers", "continuum")
    assert plugin_manager.resolve_component("schedulers", "fcfs").__name__ == "FCFSScheduler"


@pytest.mark.parametrize(
    "values",
    [{}, {"VLLITE_PLUGINS": "myplugin"}, {"VLLITE_PLUGINS": ""}, {"VLLITE_DISABLE_PLUGIN_AUTOLOAD": "1"}],
)
def test_an_allow_list_keeps_every_builtin(env, values):
    manager = env(**values)
    assert manager.builtin_names == list(plugin_manager.BUILTIN_PLUGINS)
    assert "continuum" in plugin_manager.get_registry("schedulers")


@pytest.mark.parametrize("name", [*plugin_manager.ESSENTIAL_PLUGINS, "vllite.policies.builtin"])
@pytest.mark.parametrize("variable", ["VLLITE_PLUGINS", "VLLITE_DISABLED_PLUGINS"])
def test_an_essential_builtin_cannot_be_turned_off(env, name, variable):
    with pytest.raises(PluginLoadError) as info:
        env(**{variable: f"-{name}" if variable == "VLLITE_PLUGINS" else name})
    assert isinstance(info.value, VlliteError)
    short = name if name in plugin_manager.ESSENTIAL_PLUGINS else "schedulers"
    assert info.value.plugin == short
    assert f"The builtin plugin {short!r} ({plugin_manager.ESSENTIAL_PLUGINS[short]}) is essential" in str(info.value)
    assert "continuum" in str(info.value)  # names the default builtins that can be turned off


def test_a_patched_builtin_list_is_read_when_the_manager_is_built(env, monkeypatch):
    monkeypatch.setattr(plugin_manager, "BUILTIN_PLUGINS", ("vllite.policies.builtin", CONTINUUM, "some.other.mod"))
    monkeypatch.setenv("VLLITE_DISABLED_PLUGINS", "continuum")
    builtins = plugin_manager.builtin_plugins()
    assert [(b.module, b.kind, b.disabled) for b in builtins] == [
        ("vllite.policies.builtin", "essential", False),
        (CONTINUUM, "default", True),
        ("some.other.mod", "essential", False),  # in neither table: always loaded
    ]
    monkeypatch.setenv("VLLITE_DISABLED_PLUGINS", "some.other.mod")
    with pytest.raises(PluginLoadError, match=r"'some\.other\.mod' .* is essential"):
        plugin_manager.builtin_plugins()


def test_a_denied_name_turns_off_the_builtin_and_an_entry_point_of_that_name(env):
    forget_modules("bench_named_mod")
    plugin = "from vllite import hookimpl\n\n@hookimpl\ndef vllite_register_executors(register):\n"
    make_distribution(
        env.site,
        "bench-named",
        {"vllite": {"bench": "bench_named_mod"}},
        {"bench_named_mod": plugin + '    register("third-party-sim", "x:Y")\n'},
    )
    env()
    assert {"sim", "third-party-sim"} <= set(plugin_manager.get_registry("executors"))
    env(VLLITE_DISABLED_PLUGINS="bench")
    assert not {"sim", "third-party-sim"} & set(plugin_manager.get_registry("executors"))
    forget_modules("bench_named_mod")


def test_vllite_plugins_shows_essential_default_and_disabled(env, capsys):
    env(VLLITE_PLUGINS="-continuum")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "vllite.policies.builtin  [vllite (builtin)]  essential 'schedulers'\n    hooks: " in out
    assert "vllite.plugins.bench.plugin  [vllite (builtin)]  default 'bench'\n    hooks: " in out
    disabled = f"{CONTINUUM}  [vllite (builtin)]  default 'continuum'\n    DISABLED: "
    assert disabled in out and "deny 'continuum'" in out
    assert "a default one turns off by its short name (VLLITE_PLUGINS=-NAME or VLLITE_DISABLED_PLUGINS=NAME)" in out

    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[CONTINUUM] | {"hooks": [], "components": {}} == rows[CONTINUUM]
    assert (rows[CONTINUUM]["builtin"], rows[CONTINUUM]["short_name"], rows[CONTINUUM]["status"]) == (
        "default",
        "continuum",
        "disabled",
    )
    assert rows[CONTINUUM]["disable_name"] == "continuum"
    essential = rows["vllite.plugins.transformers_executor.plugin"]
    assert (essential["builtin"], essential["short_name"], essential["status"]) == (
        "essential",
        "transformers_executor",
        "loaded",
    )
    assert essential["disable_name"] is None
    assert [row["name"] for row in rows.values() if row["builtin"]] == list(plugin_manager.BUILTIN_PLUGINS)


def test_vllite_plugins_fails_on_an_essential_denial(env, capsys, monkeypatch):
    monkeypatch.setenv("VLLITE_DISABLED_PLUGINS", "engine_proc")
    plugin_manager.reset_plugin_manager()
    assert main(["plugins"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vllite: error: The builtin plugin 'engine_proc' (vllite.plugins.engine_proc.plugin)")


def test_unknown_scheduler_flag_when_continuum_is_off(env, tiny_llama_dir, capsys):
    env(VLLITE_PLUGINS="-continuum")
    args = ["generate", "--model", tiny_llama_dir, "--scheduler-cls", "continuum", "--max-tokens", "2", "x"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Unknown scheduler 'continuum'. Available: " in err and "fcfs, priority" in err


def _generate(tiny_llama_dir: str, **kwargs) -> list[list[int]]:
    from vllite import LLM

    llm = LLM(tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False, min_tokens=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in ([3, 4, 5, 6], [9, 8, 7])], params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs]
    finally:
        llm.shutdown()


def test_llm_generates_with_every_default_builtin_off(env, tiny_llama_dir):
    env()
    reference = _generate(tiny_llama_dir)
    manager = env(VLLITE_DISABLED_PLUGINS=",".join(plugin_manager.DEFAULT_PLUGINS))
    assert manager.builtin_names == list(plugin_manager.ESSENTIAL_PLUGINS.values())
    assert _generate(tiny_llama_dir) == reference
    assert all(len(tokens) == 5 for tokens in reference)
    with pytest.raises(UnknownComponentError, match="Unknown scheduler 'continuum'"):
        _generate(tiny_llama_dir, scheduler_cls="continuum")
