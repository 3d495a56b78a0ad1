"""The plugin manager: builtins, entry-point discovery, filtering, class paths and every failure message."""

from __future__ import annotations

import sys

import pytest

from tests.plugin_utils import forget_modules, make_distribution
from vllite import plugin_manager
from vllite.exceptions import DuplicateComponentError, PluginLoadError, UnknownComponentError

SCHEDULER_PLUGIN = """
from vllite import hookimpl

class {cls}:
    def schedule(self): ...
    def update_from_output(self, *a): ...
    def add_request(self, r): ...
    def finish_requests(self, ids, status): ...

@hookimpl
def vllite_register_schedulers(register):
    register({sched_name!r}, {cls})
"""


@pytest.fixture
def plugin_root(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("VLLITE_PLUGINS", raising=False)
    monkeypatch.delenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    plugin_manager.reset_plugin_manager()
    yield root
    plugin_manager.reset_plugin_manager()


def _scheduler_dist(root, dist, module, sched_name, cls="Sched"):
    forget_modules(module)
    make_distribution(
        root,
        dist,
        {"vllite": {dist: module}},
        {module: SCHEDULER_PLUGIN.format(cls=cls, sched_name=sched_name)},
    )


def test_builtins_register_components(plugin_root):
    manager = plugin_manager.get_plugin_manager()
    assert manager.builtin_names == list(plugin_manager.BUILTIN_PLUGINS)
    assert [(b.module, b.disabled) for b in manager.builtins] == [(m, False) for m in plugin_manager.BUILTIN_PLUGINS]
    assert {"plugins", "generate", "chat"} <= set(plugin_manager.get_registry("commands"))
    assert "inprocess" in plugin_manager.get_registry("engine_clients")


def test_entry_point_plugin_is_loaded(plugin_root):
    _scheduler_dist(plugin_root, "acme-sched", "acme_sched_mod", "acme")
    manager = plugin_manager.get_plugin_manager()
    assert "acme-sched" in manager.entry_points
    assert manager.entry_points["acme-sched"].dist_name == "acme-sched"
    assert plugin_manager.resolve_component("schedulers", "acme").__name__ == "Sched"


def test_vllite_plugins_empty_excludes_everything(plugin_root, monkeypatch):
    _scheduler_dist(plugin_root, "acme-sched", "acme_sched_mod2", "acme")
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    assert "acme" not in plugin_manager.get_registry("schedulers")
    plugin_manager.reset_plugin_manager()
    monkeypatch.setenv("VLLITE_PLUGINS", "acme-sched")
    assert "acme" in plugin_manager.get_registry("schedulers")


def test_disable_autoload(plugin_root, monkeypatch):
    _scheduler_dist(plugin_root, "acme-sched", "acme_sched_mod3", "acme")
    monkeypatch.setenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "acme" not in plugin_manager.get_registry("schedulers")


def test_import_error_names_distribution_and_entry_point(plugin_root):
    forget_modules("broken_plugin_mod")
    make_distribution(
        plugin_root,
        "broken-dist",
        {"vllite": {"broken": "broken_plugin_mod"}},
        {"broken_plugin_mod": "raise RuntimeError('boom at import')\n"},
    )
    with pytest.raises(PluginLoadError) as info:
        plugin_manager.get_plugin_manager()
    message = str(info.value)
    assert "broken-dist" in message and "'broken'" in message and "boom at import" in message
    assert info.value.distribution == "broken-dist"


def test_duplicate_scheduler_name_names_both(plugin_root):
    _scheduler_dist(plugin_root, "first-dist", "first_mod", "same", cls="A")
    _scheduler_dist(plugin_root, "second-dist", "second_mod", "same", cls="B")
    with pytest.raises(DuplicateComponentError) as info:
        plugin_manager.get_registry("schedulers")
    message = str(info.value)
    assert "first-dist" in message and "second-dist" in message and "'same'" in message


def test_misspelt_hook_fails_at_start(plugin_root):
    forget_modules("typo_mod")
    make_distribution(
        plugin_root,
        "typo-dist",
        {"vllite": {"typo": "typo_mod"}},
        {"typo_mod": "from vllite import hookimpl\n@hookimpl\ndef vllite_register_schedulerz(register):\n    pass\n"},
    )
    with pytest.raises(PluginLoadError, match="vllite_register_schedulerz"):
        plugin_manager.get_plugin_manager()


def test_component_missing_interface(plugin_root):
    forget_modules("lame_mod")
    source = (
        "from vllite import hookimpl\nclass Lame: pass\n"
        "@hookimpl\ndef vllite_register_schedulers(register):\n    register('lame', Lame)\n"
    )
    make_distribution(plugin_root, "lame-dist", {"vllite": {"lame": "lame_mod"}}, {"lame_mod": source})
    with pytest.raises(PluginLoadError, match="lacks schedule"):
        plugin_manager.get_registry("schedulers")


def test_unknown_name_lists_available(plugin_root):
    with pytest.raises(UnknownComponentError) as info:
        plugin_manager.resolve_component("engine_clients", "nope")
    assert "inprocess" in str(info.value)


@pytest.mark.parametrize("path", ["collections:OrderedDict", "collections.OrderedDict"])
def test_class_path_spellings(path):
    import collections

    assert plugin_manager.resolve_class_path(path) is collections.OrderedDict


@pytest.mark.parametrize("path", ["", "nodots", "no_such_module_xyz:Thing", "collections:NoSuchThing"])
def test_bad_class_paths(path):
    with pytest.raises(PluginLoadError):
        plugin_manager.resolve_class_path(path)


def test_iter_entry_points_filter(plugin_root, monkeypatch):
    make_distribution(
        plugin_root,
        "lp-dist",
        {"vllm.logits_processors": {"one": "m:A", "two": "m:B"}},
        {"m": "A = B = object\n"},
    )
    names = [ep.name for ep in plugin_manager.iter_entry_points("vllm.logits_processors")]
    assert {"one", "two"} <= set(names)
    monkeypatch.setenv("VLLITE_PLUGINS", "two")
    assert [ep.name for ep in plugin_manager.iter_entry_points("vllm.logits_processors")] == ["two"]


def test_hook_caller_none_without_implementations(plugin_root):
    manager = plugin_manager.get_plugin_manager()
    assert manager.hook_caller("vllite_register_models") is None
    assert manager.hook_caller("vllite_register_commands") is not None


LAZY_PLUGIN = """
from vllite import hookimpl

@hookimpl
def vllite_register_schedulers(register):
    register("lazy", "lazy_sched_impl:Sched")
    register("lazy-broken", "lazy_sched_impl:Missing")
    register("lazy-lame", "lazy_sched_impl:Lame")
"""

LAZY_IMPL = SCHEDULER_PLUGIN.split("@hookimpl")[0] + "\nclass Lame:\n    pass\n"


def test_a_class_path_registration_is_imported_only_when_used(plugin_root):
    forget_modules("lazy_sched_mod", "lazy_sched_impl")
    make_distribution(
        plugin_root,
        "lazy-dist",
        {"vllite": {"lazy": "lazy_sched_mod"}},
        {"lazy_sched_mod": LAZY_PLUGIN, "lazy_sched_impl": LAZY_IMPL.format(cls="Sched")},
    )
    registry = plugin_manager.get_registry("schedulers")
    assert {"lazy", "lazy-broken", "lazy-lame", "fcfs"} <= set(registry)
    assert "lazy_sched_impl" not in sys.modules  # listing imports nothing
    assert registry["lazy"].__name__ == "Sched" and "lazy_sched_impl" in sys.modules
    assert plugin_manager.resolve_component("schedulers", "lazy") is registry["lazy"]

    with pytest.raises(PluginLoadError) as info:  # a bad entry fails where it is used, naming plugin and entry
        plugin_manager.resolve_component("schedulers", "lazy-broken")
    assert "'lazy-broken'" in str(info.value) and "lazy-dist" in str(info.value) and "Missing" in str(info.value)
    assert (info.value.plugin, info.value.distribution) == ("lazy", "lazy-dist")
    with pytest.raises(PluginLoadError, match=r"'lazy-lame'.*lacks schedule"):
        plugin_manager.resolve_component("schedulers", "lazy-lame")


def test_builtins_are_registered_lazily_and_resolve_to_their_classes():
    from vllite.policies.fcfs import FCFSScheduler

    components = plugin_manager.get_plugin_manager().components("schedulers")
    assert components["fcfs"].target == "vllite.policies.fcfs:FCFSScheduler"
    assert plugin_manager.resolve_component("schedulers", "fcfs") is FCFSScheduler
