"""``vllite.policies``: the scheduling policies, each registered by a builtin plugin module.

Not to be confused with ``vllite.sched``, the scheduling *algorithm* (``Scheduler``, ``SchedulerOutput``, the
KV-aware token budget) that these policies subclass. The folder is ``schedulers/``; its old import name
``vllite.schedulers`` is a deprecated alias for one release.

Policies: ``fcfs``, ``priority`` (with ``priority_queue``) and ``continuum`` (with ``continuum_queue`` and
``continuum_turns``), small subclasses of ``vllite.sched.Scheduler`` that override narrow decisions, and
Continuum's tool-call estimators (``estimators``). Registration: ``builtin`` and ``continuum_plugin``, which name
their classes by path so start-up stays light. Layering: imports the kernel only, never ``vllite.plugins``; the
kernel and the plugins reach these modules only through the plugin manager's registries (Continuum finds the tool
parser it reads tool names with, ``vllite.plugins.tool_parsers``, the same way).
"""

from vllite import deprecated_aliases

# Modules that moved out to builtin plugins keep their old names here for one release (DeprecationWarning).
deprecated_aliases.register_moves(
    __name__,
    "vllite.plugins.tool_parsers",
    "tool_call_extraction:extraction tool_call_scanners:scanners tool_parser_base:base tool_parser_families:families "
    "tool_parsers:parsers tool_parsers_deepseek:deepseek tool_parsers_harmony:harmony tool_parsers_json:json_parsers "
    "tool_parsers_xml:xml_parsers",
)
deprecated_aliases.register_moves(
    __name__,
    "vllite.plugins.bench",
    "agent_bench:agent_bench agent_http:agent_http agent_report:agent_report agent_sessions:agent_sessions "
    "bench_plugin:plugin sim_executor:sim_executor traces:traces",
)
deprecated_aliases.register_moves(__name__, "vllite.plugins.step_observers", "trace:sched_trace")
