"""Step observers: builtins that watch engine steps.

``sched_trace``: one JSON line per engine step to ``$VLLITE_SCHED_TRACE_PATH`` (hook ``vllite_step_observer``; off,
no hook implementation at all, unless asked for). ``step_log``: the step wrapper every engine core enters around
each step's execution (hook ``vllite_register_step_wrappers``): a failed step's dump, and the per-step lines of
``--enable-logging-iteration-details``.
"""
