"""``vllite.policies``: scheduling policies and the tools around them, each registered by a builtin plugin module.

Not to be confused with ``vllite.sched``, the scheduling *algorithm* (``Scheduler``, ``SchedulerOutput``, the
KV-aware token budget) that these policies subclass. The folder is ``schedulers/``; its old import name
``vllite.schedulers`` is a deprecated alias for one release.

Policies: ``fcfs``, ``priority`` and ``continuum`` (with ``continuum_queue`` and ``continuum_turns``), small
subclasses of ``vllite.sched.Scheduler`` that override narrow decisions; Continuum's tool-call estimators
(``estimators``) and parsers (``tool_parsers``, the families' ``tool_parsers_*`` under vLLM's names in
``tool_parser_families``, their shared ``tool_parser_base``); the step tracer (``trace``); the simulated executor
(``sim_executor``) and the agent-trace replay behind ``vllite bench agent`` (``traces``, ``agent_bench``,
``agent_report``). Registration: ``builtin``, ``continuum_plugin``, ``trace`` and ``bench_plugin``, which import
their classes inside the register hooks so start-up stays light. Layering: imports the kernel (``vllite.sched``,
``vllite.request``, ``vllite.kv_cache``, ``vllite.executor``, ...), never ``vllite.plugins``; the kernel reaches
these modules only through the plugin manager's registries.
"""
