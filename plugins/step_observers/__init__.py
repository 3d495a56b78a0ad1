"""Step observers: builtins on the ``vllite_step_observer`` hook, off (no hook implementation at all) unless asked for.

``sched_trace``: one JSON line per engine step to ``$VLLITE_SCHED_TRACE_PATH``.
"""
