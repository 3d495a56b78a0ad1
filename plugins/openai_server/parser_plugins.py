"""``vllite serve --tool-parser-plugin FILE``: a user's parser module, loaded like vLLM's, and the server's tool parser
shared with the Continuum scheduler.

The file is a Python module that implements vllite's register hooks (it is registered as a plugin)::

    from vllite import hookimpl

    @hookimpl
    def vllite_register_tool_parsers(register):
        register("my_format", MyToolParser)

and may contribute reasoning parsers too (``vllite_register_reasoning_parsers``). Or it is a vLLM tool-parser plugin:
a ``ToolParser`` subclass decorated with ``@ToolParserManager.register_module("my_format")``, imported from
``vllm.tool_parsers`` (or ``vllm.entrypoints.openai.tool_parsers``); without a real vLLM the vLLM compatibility
layer serves those names, and each registered name runs the parser through an adapter
(:mod:`vllite.plugins.openai_server.vllm_tool_parsers`). Its names are then valid for
``--tool-call-parser`` / ``--reasoning-parser`` (a name of a builtin is overridden). The file's folder is added to
``sys.path`` and the module imported by its file name, so the engine-core process (started with the same
``sys.path``) can import the classes it registered by class path. A file that is missing, fails to import, shadows or
is shadowed by another module, or implements no hook (and registers no vLLM parser) is a
:class:`~vllite.exceptions.PluginLoadError` naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from vllite.exceptions import PluginLoadError

PLUGIN_PREFIX = "tool-parser-plugin:"


def load_parser_plugin(path: str) -> str:
    """Imports the parser module at ``path`` and registers it with the plugin manager; returns its plugin name."""
    from vllite.plugin_manager import get_plugin_manager

    file = Path(path).expanduser().resolve()
    where = f"--tool-parser-plugin {path!r}"
    if not file.is_file() or file.suffix != ".py":
        raise PluginLoadError(f"{where}: there is no Python file ({file}).", plugin=str(file))
    name = file.stem
    if not name.isidentifier():
        raise PluginLoadError(f"{where}: {file.name} cannot be imported as a module; rename it.", plugin=str(file))
    from vllite.plugins import vllm_compat  # the file may `import vllm...`: served when no real vLLM is installed
    from vllite.plugins.openai_server.vllm_tool_parsers import plugin_for

    vllm_compat.activate()
    module = _import(name, file, where)
    plugin: Any = module
    if not any(attr.startswith("vllite_") for attr in vars(module)):
        plugin = plugin_for(module.__name__)  # its @ToolParserManager.register_module parsers
    if plugin is None:
        raise PluginLoadError(
            f"{where}: {file} implements no vllite hook and registers no vLLM tool parser; define @hookimpl "
            "vllite_register_tool_parsers(register) (or vllite_register_reasoning_parsers) in it, or decorate a "
            "vLLM ToolParser subclass with @ToolParserManager.register_module(NAME).",
            plugin=str(file),
        )
    manager = get_plugin_manager()
    plugin_name = PLUGIN_PREFIX + str(file)
    if not manager.pm.has_plugin(plugin_name):
        manager.register(plugin, name=plugin_name)
    return plugin_name


def _import(name: str, file: Path, where: str) -> Any:
    loaded = sys.modules.get(name)
    if loaded is not None:
        if _origin(getattr(loaded, "__file__", None)) == file:
            return loaded
        raise PluginLoadError(f"{where}: the module name {name!r} is taken by {loaded!r}; rename {file.name}.")
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.find_spec(name)
    if spec is None or _origin(spec.origin) != file:
        found = spec.origin if spec is not None else None
        raise PluginLoadError(f"{where}: importing {name!r} finds {found}, not {file}; rename the file.")
    try:
        return importlib.import_module(name)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise PluginLoadError(
            f"{where}: importing {file} failed: {type(exc).__name__}: {exc}", plugin=str(file)
        ) from exc


def _origin(path: str | None) -> Path | None:
    return Path(path).resolve() if path else None


def scheduler_parser_reference(name: str) -> str:
    """How the engine-core process names the server's tool parser ``name``: the name itself when a builtin or an
    installed plugin registered it (every process loads those), else the class path of what a parser file
    registered."""
    from vllite.plugin_manager import get_plugin_manager

    component = get_plugin_manager().components("tool_parsers").get(name)
    if component is None or not component.plugin.startswith(PLUGIN_PREFIX):
        return name
    return component.reference


def share_tool_parser(engine_args: Any, name: str | None) -> None:
    """Continuum's tool-name detection uses the server's ``--tool-call-parser``: it becomes the scheduler's
    ``policy_args["tool_parser"]`` when the scheduler takes that argument and it was not given."""
    if not name or "tool_parser" in (engine_args.policy_args or {}) or not engine_args.scheduler_cls:
        return
    from vllite.plugin_manager import resolve_component

    try:
        scheduler = resolve_component("schedulers", engine_args.scheduler_cls)
    except Exception:  # the engine reports a bad scheduler itself, in its own words
        return
    if "tool_parser" in getattr(scheduler, "accepted_policy_args", {}):
        engine_args.policy_args = {**(engine_args.policy_args or {}), "tool_parser": scheduler_parser_reference(name)}
