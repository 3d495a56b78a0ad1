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
