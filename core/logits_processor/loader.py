"""Finding, checking and constructing the engine's logits processors.

Order: the registered processors (builtins first, then those contributed through the ``vllite`` plugin
hook), then the classes of the ``vllm.logits_processors`` and ``vllite.logits_processors`` entry-point groups
(filtered by ``VLLITE_PLUGINS`` / ``VLLITE_DISABLED_PLUGINS`` / ``VLLITE_DISABLE_PLUGIN_AUTOLOAD`` like every
other group; see :mod:`vllite.logits_processor.sources`), then explicit
ones given as classes or class paths (``pkg.mod:Class`` or ``pkg.mod.Class``), first the ``custom``
argument, then ``vllm_config.logits_processors``. A class reached twice is used once, at its first
position. Nothing is skipped silently: a plugin that fails to import, is not a class, or lacks part of
the interface raises ``PluginLoadError`` naming the entry point, the distribution and what is missing (for a
hook-registered class: the registered name, the plugin whose hook registered it and its distribution). The
built container keeps each processor's origin, so a processor that raises while the engine runs is named with it.

A class satisfies the interface by shape, not by ancestry, so a subclass of vLLM's own ``LogitsProcessor``
loads without vLLM being imported here. Classes of vLLM's newer slot-based interface are adapted by the vLLM
compatibility layer (:mod:`vllite.plugins.vllm_compat.slot_adapter`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllite.exceptions import PluginLoadError
from vllite.logits_processor.container import LogitsProcessors
from vllite.logits_processor.interface import LogitsProcessor
from vllite.logits_processor.sources import (
    LOGITSPROCS_GROUP as LOGITSPROCS_GROUP,
)
from vllite.logits_processor.sources import (
    LOGITSPROCS_GROUPS as LOGITSPROCS_GROUPS,
)
from vllite.logits_processor.sources import (
    LogitsProcSource,
    entry_point_sources,
    hook_sources,
)

if TYPE_CHECKING:
    import torch

    from vllite.sampling_params import SamplingParams

REGISTRY_KIND = "logits_processors"

_V1_METHODS = {
    "apply": "apply(logits)",
    "is_argmax_invariant": "is_argmax_invariant()",
    "update_state": "update_state(batch_update)",
}
_V1_CTOR = "a constructor taking (vllm_config, device, is_pin_memory)"
_SLOT_CTOR = "a constructor taking (vllm_config, req_states)"


@dataclass(frozen=True)
class LoadedLogitsProcessor:
    """A checked processor class and where it came from (for error messages): ``plugin`` is the entry point (or
    class path) that contributed it and ``distribution`` the distribution that installed it, where known."""

    cls: type[LogitsProcessor]
    origin: str
    plugin: str | None = None
    distribution: str | None = None


def _constructor_accepts(cls: type, num_args: int) -> bool:
    try:
        inspect.signature(cls).bind(*([None] * num_args))
    except TypeError:
        return False
    except ValueError:  # no signature available (some C types): assume it fits
        return True
    return True


def check_logitsproc_class(
    obj: Any, *, origin: str, plugin: str | None = None, distribution: str | None = None
) -> type[LogitsProcessor]:
    """Returns ``obj`` as a usable processor class (slot-interface classes adapted), or raises
    ``PluginLoadError`` saying which part of the interface is missing. ``origin`` says where ``obj`` came
    from."""
    if not isinstance(obj, type):
        raise PluginLoadError(
            f"{origin} is not a class but {type(obj).__name__} {obj!r}: a logits processor must be a "
            "LogitsProcessor class (with __init__(vllm_config, device, is_pin_memory), apply, "
            "is_argmax_invariant, update_state).",
            plugin=plugin,
            distribution=distribution,
        )
    from vllite.plugins.vllm_compat.slot_adapter import adapt_slot_processor, is_slot_interface

    if is_slot_interface(obj):
        if not _constructor_accepts(obj, 2):
            raise PluginLoadError(
                f"{origin} ({obj.__module__}.{obj.__qualname__}) looks like a slot-interface logits "
                f"processor (add_request, apply(logits, ctx)) but is missing {_SLOT_CTOR}.",
                plugin=plugin,
                distribution=distribution,
            )
        return adapt_slot_processor(obj)
    missing = [label for name, label in _V1_METHODS.items() if not callable(getattr(obj, name, None))]
    missing += [
        f"an implementation of abstract method {name}" for name in sorted(getattr(obj, "__abstractmethods__", ()))
    ]
    if not missing and not _constructor_accepts(obj, 3):
        missing.append(_V1_CTOR)
    if missing:
        raise PluginLoadError(
            f"{origin} ({obj.__module__}.{obj.__qualname__}) does not satisfy the LogitsProcessor interface: "
            f"missing {', '.join(missing)}.",
            plugin=plugin,
            distribution=distribution,
        )
    return obj


def check_source(source: LogitsProcSource) -> LoadedLogitsProcessor:
    """Loads one source and checks its class as engine start-up does; ``PluginLoadError`` names the source (the
    entry point and distribution) and what is wrong."""
    plugin, distribution = source.plugin, source.distribution
    cls = check_logitsproc_class(source.load(), origin=source.origin, plugin=plugin, distribution=distribution)
    return LoadedLogitsProcessor(cls, source.origin, plugin, distribution)


def _explicit(items: Iterable[type | str]) -> list[LoadedLogitsProcessor]:
    from vllite.plugin_manager import resolve_class_path

    loaded = []
    for position, item in enumerate(items):
        if isinstance(item, str):
            origin = f"logits processor {item!r} (explicit, position {position})"
            obj = resolve_class_path(item)
        else:
            origin = f"logits processor {getattr(item, '__qualname__', item)!r} (explicit, position {position})"
            obj = item
        plugin = item if isinstance(item, str) else None
        loaded.append(LoadedLogitsProcessor(check_logitsproc_class(obj, origin=origin, plugin=plugin), origin, plugin))
    return loaded


def load_logitsprocs(vllm_config: Any = None, custom: Sequence[type | str] = ()) -> list[LoadedLogitsProcessor]:
    """Every processor class in load order (see the module docstring), checked, without constructing any."""
    from vllite.plugin_manager import get_plugin_manager
    from vllite.plugins import vllm_compat  # a builtin adapter: imported here, not at module level

    vllm_compat.activate()  # plugins may `import vllm...`: served by vllite when no real vLLM is installed

    manager = get_plugin_manager()
    sources = hook_sources(manager, manager.components(REGISTRY_KIND).values()) + entry_point_sources()
    loaded = [check_source(source) for source in sources]
    loaded += _explicit([*custom, *(getattr(vllm_config, "logits_processors", None) or [])])
    seen: set[type] = set()
    unique = []
    for item in loaded:
        if item.cls not in seen:
            seen.add(item.cls)
            unique.append(item)
    return unique


def load_logitsprocs_classes(vllm_config: Any = None, custom: Sequence[type | str] = ()) -> list[type[LogitsProcessor]]:
    """The processor classes in load order; what a frontend keeps to run :func:`validate_sampling_params`."""
    return [item.cls for item in load_logitsprocs(vllm_config, custom)]


def build_logitsprocs(
    vllm_config: Any, device: torch.device | str, is_pin_memory: bool, custom: Sequence[type | str] = ()
) -> LogitsProcessors:
    """Loads every processor class and constructs each once as ``cls(vllm_config, device, is_pin_memory)``.

    A constructor that raises stops start-up with a ``PluginLoadError`` naming the processor's origin.
    """
    import torch

    device = torch.device(device)
    procs = []
    origins = []
    for item in load_logitsprocs(vllm_config, custom):
        try:
            procs.append(item.cls(vllm_config, device, is_pin_memory))
        except Exception as exc:
            raise PluginLoadError(
                f"{item.origin} failed to initialise: {type(exc).__name__}: {exc}",
                plugin=item.plugin,
                distribution=item.distribution,
            ) from exc
        origins.append(item.origin)
    return LogitsProcessors(procs, origins=origins)


def validate_sampling_params(
    procs_or_classes: LogitsProcessors | Iterable[LogitsProcessor | type], params: SamplingParams
) -> None:
    """Runs every processor class's ``validate_params(params)``; a bad per-request argument raises
    ``ValueError`` here, at submit time, rather than inside a batch. Accepts a container, instances or
    classes."""
    items = procs_or_classes.all if isinstance(procs_or_classes, LogitsProcessors) else procs_or_classes
    for item in items:
        cls = item if isinstance(item, type) else type(item)
        validate = getattr(cls, "validate_params", None)
        if callable(validate):
            validate(params)
