"""Plugin loading: builtins first, then the ``vllite`` entry-point group, resolved once into plain registries.

The engine never calls pluggy per token: at start-up :func:`get_registry` asks every plugin's register hook for
its components once and keeps a ``name -> object`` registry (:class:`~vllite.registry.Registry`; an entry registered
by class path is imported when first read). Class paths (``pkg.mod:Class`` or ``pkg.mod.Class``) are accepted
wherever a registered name is.

Builtins come in two kinds, as pytest's ``essential_plugins`` and ``default_plugins`` do (``vllite plugins`` shows
which is which):
- :data:`ESSENTIAL_PLUGINS`: what ``LLM(...).generate`` cannot run without (the FCFS / priority schedulers, the
  builtin logits processors behind ``SamplingParams``, the default executor, the in-process and multiprocess
  engine clients). Always loaded; denying one by its short name or module stops start-up with a
  ``PluginLoadError``. To replace one of their components, register another under the same name from a plugin.
- :data:`DEFAULT_PLUGINS`: everything else (Continuum, the benchmarks, the KV connectors, grammar backends, the
  server, parsers, the CLI commands ...). Loaded unless the environment denies its short name (or module path).

Environment (applies to every entry-point group vllite reads, including the logits-processor groups; the denials
also to default builtins):
- ``VLLITE_PLUGINS``: comma-separated entry-point names to load (empty loads none; unset loads all). An entry with a
  leading ``-`` turns that plugin off instead: ``VLLITE_PLUGINS=-a,-b`` loads all but ``a`` and ``b``;
  ``VLLITE_PLUGINS=a,-b`` loads only ``a``. Only the ``-name`` entries reach builtins: ``VLLITE_PLUGINS=-continuum``
  skips the default builtin ``continuum``, and an allow list (``VLLITE_PLUGINS=myplugin``, or empty) keeps every
  builtin, as pytest's ``-p no:NAME`` disables a builtin and nothing selects builtins.
- ``VLLITE_DISABLED_PLUGINS``: comma-separated names never to load, whatever ``VLLITE_PLUGINS`` says: entry points
  and default builtins alike (``VLLITE_DISABLED_PLUGINS=continuum``).
- ``VLLITE_DISABLE_PLUGIN_AUTOLOAD=1``: load no third-party plugins at all (builtins still load, less the denied).

A denied name applies to both kinds: denying ``continuum`` skips the default builtin and an entry point of that
name alike. ``VLLM_PLUGINS`` is not read (logged when set): in vLLM it selects the ``vllm.general_plugins`` /
platform / IO-processor / stat-logger entry points, which vllite does not load, and vLLM loads the
``vllm.logits_processors`` entry points (the only vLLM group vllite reads) whatever it says.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from vllite import hookspecs
from vllite.exceptions import DuplicateComponentError, PluginLoadError, UnknownComponentError
from vllite.plugin_filter import EntryPointInfo, PluginFilter, iter_entry_points, note_vllm_plugins, plugin_filter
from vllite.registry import Component, Registry, resolve_class_path

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllite"

# Every builtin is a plugin registered through the same hooks as third parties: short name -> module.
#: The builtins the engine cannot run without: always loaded, never disabled.
ESSENTIAL_PLUGINS: dict[str, str] = {
    "schedulers": "vllite.policies.builtin",
    "logitsprocs": "vllite.builtin_logitsprocs.plugin",
    "transformers_executor": "vllite.plugins.transformers_executor.plugin",
    "inprocess_client": "vllite.plugins.inprocess_client.plugin",
    "engine_proc": "vllite.plugins.engine_proc.plugin",
}
#: The builtins the environment may turn off by short name (``VLLITE_PLUGINS=-NAME``, ``VLLITE_DISABLED_PLUGINS``).
DEFAULT_PLUGINS: dict[str, str] = {
    "sched_trace": "vllite.plugins.step_observers.sched_trace",
    "step_log": "vllite.plugins.step_observers.step_log",
    "kv_events": "vllite.plugins.kv_events.plugin",
    "continuum": "vllite.policies.continuum_plugin",
    "bench": "vllite.plugins.bench.plugin",
    "kv_connectors": "vllite.plugins.kv_connectors.plugin",
    "structured_outputs": "vllite.plugins.structured_outputs.plugin",
    "ray_dp": "vllite.plugins.ray_dp.plugin",
    "openai_server": "vllite.plugins.openai_server.plugin",
    "reasoning": "vllite.plugins.reasoning.plugin",
    "tool_parsers": "vllite.plugins.tool_parsers.plugin",
    "commands": "vllite.plugins.commands.plugin",
}
#: Every builtin module, in registration order (essential first). The manager reads this (and the two tables above)
#: when it is built, so a test may patch it to load fewer builtins; a module in neither table counts as essential.
BUILTIN_PLUGINS: tuple[str, ...] = (*ESSENTIAL_PLUGINS.values(), *DEFAULT_PLUGINS.values())

# Component kind -> the register hook that contributes it, and the attributes a component must have.
COMPONENT_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "schedulers": (
        "vllite_register_schedulers",
        ("schedule", "update_from_output", "add_request", "finish_requests"),
    ),
    "logits_processors": ("vllite_register_logits_processors", ("apply",)),
    "executors": ("vllite_register_executors", ("execute_model",)),
    "engine_clients": ("vllite_register_engine_clients", ("add_request", "get_output", "shutdown")),
    "kv_connectors": ("vllite_register_kv_connectors", ()),
    "structured_output_backends": ("vllite_register_structured_output_backends", ("validate", "compile")),
    "tool_call_estimators": ("vllite_register_tool_call_estimators", ("set_up_pin",)),
    "tool_parsers": ("vllite_register_tool_parsers", ("parse",)),
    "reasoning_parsers": ("vllite_register_reasoning_parsers", ("extract_reasoning", "stream")),
    "lora_resolvers": ("vllite_register_lora_resolvers", ("resolve_lora",)),
    "models": ("vllite_register_models", ()),
    "commands": ("vllite_register_commands", ("run",)),
    "kv_event_publishers": ("vllite_register_kv_event_publishers", ("publish", "shutdown")),
    "step_wrappers": ("vllite_register_step_wrappers", ("around",)),
}


@dataclass(frozen=True)
class BuiltinPlugin:
    """One builtin plugin: its module, its short name (``None``: a module in neither table), its kind, and whether
    the environment turned it off (only a default one can be)."""

    module: str
    short_name: str | None
    essential: bool
    disabled: bool = False

    @property
    def kind(self) -> str:
        """``"essential"`` or ``"default"``."""
        return "essential" if self.essential else "default"


def builtin_plugins(env_filter: PluginFilter | None = None) -> list[BuiltinPlugin]:
    """Every module of :data:`BUILTIN_PLUGINS`, classified by :data:`ESSENTIAL_PLUGINS` / :data:`DEFAULT_PLUGINS`
    (all read now), a default one marked disabled when ``env_filter`` (default: the environment's) denies its short
    name or module. Denying an essential one raises ``PluginLoadError`` naming it."""
    denied = env_filter if env_filter is not None else plugin_filter()
    default = {module: name for name, module in DEFAULT_PLUGINS.items()}
    essential = {module: name for name, module in ESSENTIAL_PLUGINS.items()}
    builtins: list[BuiltinPlugin] = []
    for module in BUILTIN_PLUGINS:
        name = default.get(module)
        if name is not None:
            builtins.append(BuiltinPlugin(module, name, False, denied.denies_builtin(name, module)))
            continue
        name = essential.get(module)
        if denied.denies_builtin(name, module):
            raise PluginLoadError(
                f"The builtin plugin {name or module!r} ({module}) is essential: the engine cannot run without it, so "
                "VLLITE_PLUGINS=-NAME / VLLITE_DISABLED_PLUGINS cannot turn it off (only the default builtins: "
                f"{', '.join(DEFAULT_PLUGINS)}). To replace one of its components, register another under the same "
                "name from a plugin.",
                plugin=name or module,
            )
        builtins.append(BuiltinPlugin(module, name, True))
    return builtins


def looks_like_class_path(name: str) -> bool:
    """Whether ``name`` is a class path (``pkg.mod:Class`` or ``pkg.mod.Class``) rather than a registered name."""
    return ":" in name or "." in name


class PluginManager:
    """Loads builtins and third-party plugins once and builds the component registries from their hooks."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: tuple[Any, ...] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        note_vllm_plugins()
        #: Every builtin, loaded or disabled (``vllite plugins`` lists both); ``builtin_names``: the loaded ones.
        self.builtins = builtin_plugins()
        self.builtin_names: list[str] = []
        self.entry_points: dict[str, EntryPointInfo] = {}
        self._registries: dict[str, dict[str, Component]] = {}
        self._lock = threading.Lock()
        for builtin in self.builtins:
            if builtin.disabled:
                logger.debug("The default builtin plugin %r is disabled by the environment", builtin.short_name)
                continue
            self._register(importlib.import_module(builtin.module), builtin.module, source=f"builtin {builtin.module}")
            self.builtin_names.append(builtin.module)
        if load_entry_points:
            for info in iter_entry_points(ENTRY_POINT_GROUP):
                self._register(info.load(), info.name, source=info.describe(), info=info)
                self.entry_points[info.name] = info
        for plugin in extra_plugins:
            self.register(plugin)
        self.check_pending()

    # ------------------------------------------------------------------ registration
    def _register(self, plugin: Any, name: str, *, source: str, info: EntryPointInfo | None = None) -> None:
        if self.pm.has_plugin(name):
            raise PluginLoadError(f"Two plugins are named {name!r}: {source} and an earlier one.", plugin=name)
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(
                f"Plugin {source} does not satisfy the hook specifications: {exc}",
                plugin=name,
                distribution=info.dist_name if info else None,
            ) from exc

    def register(self, plugin: Any, name: str | None = None) -> str:
        """Registers an extra plugin object at run time (tests, embedding applications); registries are rebuilt."""
        name = name or getattr(plugin, "__name__", None) or f"plugin-{id(plugin):x}"
        self._register(plugin, name, source=f"plugin {name!r}")
        self.check_pending()
        self._registries.clear()
        return name

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._registries.clear()

    def check_pending(self) -> None:
        """Fails on a hook implementation that matches no hookspec (usually a misspelt hook name)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            plugin_name = self.pm.get_name(exc.plugin) if exc.plugin is not None else None
            info = self.entry_points.get(plugin_name or "")
            where = info.describe() if info else f"plugin {plugin_name!r}"
            raise PluginLoadError(
                f"{where} implements an unknown hook (misspelt?): {exc}. Known hooks: "
                + ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("vllite_"))),
                plugin=plugin_name,
                distribution=info.dist_name if info else None,
            ) from exc

    def describe_plugin(self, name: str) -> str:
        info = self.entry_points.get(name)
        if info is not None:
            return info.describe()
        return f"builtin plugin {name!r}" if name in self.builtin_names else f"plugin {name!r}"

    def distribution_of(self, name: str) -> str | None:
        """The distribution that installed plugin ``name`` (an entry point), or ``None`` for builtins and plugins
        registered at run time."""
        info = self.entry_points.get(name)
        return info.dist_name if info else None

    # ------------------------------------------------------------------ registries
    def components(self, kind: str) -> dict[str, Component]:
        """``name -> Component`` for one kind, built once from the register hook of every plugin."""
        if kind not in COMPONENT_KINDS:
            raise ValueError(f"Unknown component kind {kind!r}; known: {', '.join(COMPONENT_KINDS)}.")
        with self._lock:
            registry = self._registries.get(kind)
            if registry is None:
                registry = self._registries[kind] = self._build_registry(kind)
            return registry

    def _build_registry(self, kind: str) -> dict[str, Component]:
        components, errors = self.registrations(kind)
        if errors:
            raise errors[0]
        registry: dict[str, Component] = {}
        for component in components:
            if not isinstance(component.target, str):
                component.load()  # an object is checked now; a class path when first used
            self._add_component(registry, kind, component)
        return registry

    def registrations(self, kind: str) -> tuple[list[Component], list[PluginLoadError]]:
        """Everything the register hook of ``kind`` registers, in order (builtins first), unchecked and with
        duplicates kept, and a ``PluginLoadError`` for each plugin whose hook raised (its other registrations are
        kept). What the registry is built from; ``vllite plugins`` checks each registration on its own."""
        hook_name, required = COMPONENT_KINDS[kind]
        components: list[Component] = []
        errors: list[PluginLoadError] = []
        # get_hookimpls() lists implementations in registration order: builtins first.
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            plugin_name = impl.plugin_name
            builtin = plugin_name in self.builtin_names

            def register(name: str, obj: Any, _plugin: str = plugin_name, _builtin: bool = builtin) -> None:
                components.append(Component(name, obj, _plugin, _builtin, kind, required, *self._origin(_plugin)))

            try:
                impl.function(register=register)
            except PluginLoadError as exc:
                errors.append(exc)
            except Exception as exc:
                error = PluginLoadError(
                    f"{self.describe_plugin(plugin_name)} failed in {hook_name}: {type(exc).__name__}: {exc}",
                    plugin=plugin_name,
                    distribution=self.distribution_of(plugin_name),
                )
                error.__cause__ = exc
                errors.append(error)
        return components, errors

    def _origin(self, plugin: str) -> tuple[str, str | None]:
        return self.describe_plugin(plugin), self.distribution_of(plugin)

    def _add_component(self, registry: dict[str, Component], kind: str, component: Component) -> None:
        previous = registry.get(component.name)
        if previous is not None:
            if previous.builtin and not component.builtin:
                logger.info("%s overrides the builtin %s %r", component.source, kind[:-1], component.name)
            else:
                raise DuplicateComponentError(
                    f"Two plugins register the {kind[:-1]} name {component.name!r}: "
                    f"{previous.source} and {component.source}.",
                    plugin=component.plugin,
                    distribution=component.distribution,
                )
        registry[component.name] = component

    def get_registry(self, kind: str) -> Registry:
        """``name -> component`` for ``kind``; an entry is imported when first read."""
        return Registry(self.components(kind))

    def resolve(self, kind: str, name_or_path: str | Any) -> Any:
        """A registered component by name, or a class path; a non-string is returned as given."""
        if not isinstance(name_or_path, str):
            return name_or_path
        registry = self.check_name(kind, name_or_path)
        if name_or_path in registry:
            return registry[name_or_path].load()
        return resolve_class_path(name_or_path)

    def check_name(self, kind: str, name: str) -> dict[str, Component]:
        """The components of ``kind``; ``UnknownComponentError`` listing them unless ``name`` is one of them or a
        class path. Imports nothing: a start-up can check the names it was given before it loads anything."""
        registry = self.components(kind)
        if name not in registry and not looks_like_class_path(name):
            available = ", ".join(sorted(registry)) or "none"
            raise UnknownComponentError(
                f"Unknown {kind[:-1].replace('_', ' ')} {name!r}. Available: {available}"
                " (or give a class path like 'pkg.mod:Class')."
            )
        return registry

    def hook_caller(self, hook_name: str) -> Callable[..., Any] | None:
        """The hook as a plain callable, or ``None`` when no plugin implements it (so callers can skip all work)."""
        caller = getattr(self.pm.hook, hook_name)
        return caller if caller.get_hookimpls() else None


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, built on first use."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forgets the process-wide manager so the next call re-reads the environment and entry points (tests)."""
    global _manager
    with _manager_lock:
        _manager = None


def get_registry(kind: str) -> Registry:
    """``name -> component`` for ``kind`` (schedulers, logits_processors, executors, ...); entries load when read."""
    return get_plugin_manager().get_registry(kind)


def resolve_component(kind: str, name_or_path: str | Any) -> Any:
    """A component by registered name or class path; unknown names list the available ones."""
    return get_plugin_manager().resolve(kind, name_or_path)


def get_hook_caller(hook_name: str) -> Callable[..., Any] | None:
    return get_plugin_manager().hook_caller(hook_name)
