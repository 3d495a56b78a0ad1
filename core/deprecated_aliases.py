"""Old import names that keep working for one release: renamed packages and the builtins moved out of the kernel.

A ``sys.meta_path`` finder maps each old name, and every submodule under it, to the module object of the new name
(``vllite.schedulers.continuum`` *is* ``vllite.policies.continuum``), so classes imported either way are the same
objects, and issues a ``DeprecationWarning`` the first time each old name is imported. Installed by
``import vllite``. Names that a kernel package re-exported from a moved module are served by that package's
``__getattr__`` through :func:`moved_attribute`, with the same warning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old package name -> new package name (removed in the release after the rename).
RENAMED_PACKAGES: dict[str, str] = {
    "vllite.schedulers": "vllite.policies",
    "vllite.plugins.executor": "vllite.plugins.transformers_executor",
}

_KV_CONNECTORS = "vllite.plugins.kv_connectors"
_GRAMMARS = "vllite.plugins.structured_outputs"
_EXECUTOR = "vllite.plugins.transformers_executor"
_KV_CONNECTOR_MODULES: tuple[str, ...] = ("block_files", "offload", "offload_disk", "offload_worker", "p2p")
_KV_CONNECTOR_MODULES += ("p2p_worker", "transfers", "shared_storage", "shared_storage_worker")
_GRAMMAR_MODULES = ("xgrammar_backend", "guidance_backend", "bounded_strings", "strict_json")
_VLLM_COMPAT = "vllite.plugins.vllm_compat"
_VLLM_COMPAT_MODULES = ("finder", "served", "logger", "tokenizers", "torch_utils")
_SIZING_NAMES: tuple[str, ...] = ("CPU_KVCACHE_SPACE_ENV", "DEFAULT_CPU_KVCACHE_SPACE_GIB", "cpu_kvcache_space_bytes")
_SIZING_NAMES += ("determine_num_blocks", "gpu_kvcache_space_bytes", "kv_cache_bytes_per_token")
# vLLM's slot-based logits processors: the interface, its buffers and the adapter, now the compatibility layer's.
_PLUGINS = "vllite.plugins"
_SLOT_MODULES = {"slot": "slot_adapter", "slot_interface": "slot_interface", "buffers": "buffers"}
_SLOT_NAMES = {
    "slot_adapter": ("SlotLogitsProcessorAdapter", "adapt_slot_processor", "is_slot_interface"),
    "slot_interface": ("LogitsContext", "LogitsProcRequestState", "SlotLogitsProcessor"),
    "buffers": ("StagedWriteTensor", "UvaBackedTensor"),
}

#: modules that moved, old name -> new name (removed in the release after the move): mostly builtins that lived in
#: the kernel (``core/``), now in a plugin; the CPU-thread plan went the other way, into ``vllite.platform``.
MOVED_MODULES: dict[str, str] = {
    **{f"vllite.kv_connector.{name}": f"{_KV_CONNECTORS}.{name}" for name in _KV_CONNECTOR_MODULES},
    "vllite.kv_connector.builtin_plugin": f"{_KV_CONNECTORS}.plugin",
    "vllite.kv_connector.testing": f"{_KV_CONNECTORS}.mock",
    "vllite.sched.kv_transfer": f"{_KV_CONNECTORS}.scheduling",
    **{f"vllite.structured_output.{name}": f"{_GRAMMARS}.{name}" for name in _GRAMMAR_MODULES},
    "vllite.structured_output.builtin_plugin": f"{_GRAMMARS}.plugin",
    "vllite.cpu_threads": "vllite.platform.cpu_threads",
    f"{_EXECUTOR}.cpu_threads": "vllite.platform.cpu_threads",
    "vllite.cpu_governor": f"{_EXECUTOR}.cpu_governor",
    "vllite.kv_cache.sizing": f"{_EXECUTOR}.kv_cache_sizing",
    "vllite.serial": "vllite.plugins.engine_proc.serial",
    "vllite.cli_commands": "vllite.plugins.commands.plugin",
    "vllite.plugin_report": "vllite.plugins.commands.plugin_report",
    "vllite.testing.server": "vllite.plugins.openai_server.testing",
    "vllite.kv_connector.conformance": "vllite.testing.kv_connector_conformance",
    "vllite.vllm_compat": _VLLM_COMPAT,
    **{f"vllite.vllm_compat.{name}": f"{_VLLM_COMPAT}.{name}" for name in _VLLM_COMPAT_MODULES},
    "vllite.engine.beam_search": "vllite.plugins.beam_search.search",
    "vllite.engine.step_log": "vllite.plugins.step_observers.step_log",
    **{f"vllite.logits_processor.{old}": f"{_VLLM_COMPAT}.{new}" for old, new in _SLOT_MODULES.items()},
}

_SERVER = "vllite.plugins.openai_server"
#: builtins that moved between builtin packages: (old package, new package, "old:new old:new ...").
_BUILTIN_MOVES = (
    (
        "vllite.policies",
        "vllite.plugins.tool_parsers",
        "tool_call_extraction:extraction tool_call_scanners:scanners "
        "tool_parser_base:base tool_parser_families:families tool_parsers:parsers tool_parsers_deepseek:deepseek "
        "tool_parsers_harmony:harmony tool_parsers_json:json_parsers tool_parsers_xml:xml_parsers",
    ),
    (
        "vllite.policies",
        "vllite.plugins.bench",
        "agent_bench:agent_bench agent_http:agent_http "
        "agent_report:agent_report agent_sessions:agent_sessions bench_plugin:plugin sim_executor:sim_executor "
        "traces:traces",
    ),
    ("vllite.policies", "vllite.plugins.step_observers", "trace:sched_trace"),
    (
        _SERVER,
        "vllite.plugins.bench",
        "bench:serve bench_client:serve_client bench_config:serve_config "
        "bench_metrics:serve_metrics bench_requests:serve_requests",
    ),
    (
        _SERVER,
        f"{_SERVER}.anthropic",
        "anthropic_messages:messages anthropic_protocol:protocol anthropic_routes:routes anthropic_stream:stream",
    ),
    (
        _SERVER,
        f"{_SERVER}.responses_api",
        "responses_api_input:input responses_api_protocol:protocol responses_api_stream:stream response_store:store",
    ),
    (_SERVER, f"{_SERVER}.realtime", "realtime_protocol:protocol realtime_sampling:sampling realtime_turns:turns"),
    (
        _SERVER,
        f"{_SERVER}.pooling",
        "pooling_prompts:prompts pooling_protocol:protocol pooling_routes:routes pooling_serving:serving",
    ),
    (
        _SERVER,
        f"{_SERVER}.ops",
        "ops_routes:routes server_load:load server_info:info kv_events_route:kv_events sagemaker:sagemaker",
    ),
    (_SERVER, f"{_SERVER}.observability", "metrics:metrics metric_specs:metric_specs tracing:tracing"),
)
MOVED_MODULES.update(
    {
        f"{old_package}.{pair.split(':')[0]}": f"{new_package}.{pair.split(':')[1]}"
        for old_package, new_package, pairs in _BUILTIN_MOVES
        for pair in pairs.split()
    }
)

_AGENT_REPORT_NAMES = (
    "percentile", "RunResult", "run_one", "BenchSettings", "make_sim_config", "make_real_args", "run_sweep",
    "REPORT_FIELDS", "speedups", "write_report", "plot_jct",
)  # fmt: skip

#: package -> {name it re-exported: the module that now holds it}.
MOVED_ATTRIBUTES: dict[str, dict[str, str]] = {
    "vllite.kv_cache": dict.fromkeys(_SIZING_NAMES, f"{_EXECUTOR}.kv_cache_sizing"),
    "vllite.config": {"EngineArgs": "vllite.engine_args"},
    **{
        package: dict.fromkeys(("PriorityRequestQueue", "create_request_queue"), "vllite.policies.priority_queue")
        for package in ("vllite.sched", "vllite.sched.request_queue")
    },
    "vllite.engine.stats": dict.fromkeys(
        ("StatLogger", "StatLoggerFactory", "build_stat_loggers", "SpecDecodingStatLogger"),
        "vllite.plugins.engine_proc.stat_loggers",
    ),
    "vllite.engine.output_processor": dict.fromkeys(
        ("RequestOutputCollector", "merge_request_outputs"), "vllite.plugins.engine_proc.output_collector"
    ),
    "vllite.plugins.bench.agent_bench": dict.fromkeys(_AGENT_REPORT_NAMES, "vllite.plugins.bench.agent_report"),
    "vllite.engine.pooling": dict.fromkeys(("score_prompt", "pair_up", "cosine_scores"), f"{_PLUGINS}.pooling.scoring"),
    "vllite.kv_events": {"ZmqEventPublisher": "vllite.plugins.kv_events.zmq_publisher"},
    "vllite.structured_output.manager": dict.fromkeys(
        ("StructuredOutputManager", "fill_rows", "fill_one_by_one"), f"{_GRAMMARS}.manager"
    ),
    "vllite.logits_processor": {
        name: f"{_VLLM_COMPAT}.{module}" for module, names in _SLOT_NAMES.items() for name in names
    },
    # A module that became the package of its family: its names are read through the package.
    f"{_SERVER}.realtime": dict.fromkeys(("realtime_router", "RealtimeConnection"), f"{_SERVER}.realtime.session"),
    f"{_SERVER}.responses_api": dict.fromkeys(
        ("add_responses_routes", "create_response", "cancel_response", "start_response"),
        f"{_SERVER}.responses_api.routes",
    ),
}


def moved_attribute(package: str, name: str) -> object:
    """``package.name`` for a name that moved out of ``package`` (see :data:`MOVED_ATTRIBUTES`), with a
    ``DeprecationWarning``; ``AttributeError`` for any other name. A package's ``__getattr__`` calls this."""
    module = MOVED_ATTRIBUTES.get(package, {}).get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(
        f"{package}.{name} is deprecated and will be removed in the next release; import it from {module} instead.",
        DeprecationWarning,
        stacklevel=3,  # the code that read the name, past the package's __getattr__
    )
    return getattr(importlib.import_module(module), name)


def _new_name(fullname: str) -> str | None:
    moved = MOVED_MODULES.get(fullname)
    if moved is not None:
        return moved
    for old, new in RENAMED_PACKAGES.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :]
    return None


def _caller_stacklevel() -> int:
    """The ``stacklevel`` (for a warning issued by the caller of this function) that points at the first frame
    outside this module. Like ``warnings.warn``, frames of the import system (``importlib._bootstrap``) are not
    counted."""
    frame = sys._getframe(2)  # the caller's caller
    level = 2
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = "importlib" in filename and "_bootstrap" in filename
        if not internal and filename != __file__:
            return level
        if not internal:
            level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system the already-imported module of the new name instead of a new module."""

    def __init__(self, old: str, new: str) -> None:
        self.old = old
        self.new = new
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{self.old} is deprecated and will be removed in the next release; import {self.new} instead.",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        target = importlib.import_module(self.new)
        self._own_spec = target.__spec__
        return target

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set the alias spec on the shared module object: give it back its own.
        module.__spec__ = self._own_spec


class DeprecatedAliasFinder(importlib.abc.MetaPathFinder):
    """Finds the renamed packages of :data:`RENAMED_PACKAGES` (and their submodules) under their old names."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once), before a stale install could load a second copy."""
    if not any(isinstance(finder, DeprecatedAliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeprecatedAliasFinder())
