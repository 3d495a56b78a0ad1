"""Deprecated: scheduler test support moved to :mod:`vllite.testing` (``vllite.testing.scheduler``).

``FakeExecutor`` is now :class:`vllite.testing.ScriptedModelRunner`. This alias module re-exports the old names
with a ``DeprecationWarning`` and will be removed in the next release.
"""

from __future__ import annotations

import warnings

from vllite.testing.scheduler import (
    ScriptedModelRunner,
    TokenChooser,
    make_config,
    make_model_runner_output,
    make_request,
)

warnings.warn(
    "vllite.sched.testing is deprecated; import from vllite.testing instead "
    "(FakeExecutor is now vllite.testing.ScriptedModelRunner).",
    DeprecationWarning,
    stacklevel=2,
)

#: Deprecated name of :class:`vllite.testing.ScriptedModelRunner`.
FakeExecutor = ScriptedModelRunner

__all__ = [
    "FakeExecutor",
    "ScriptedModelRunner",
    "TokenChooser",
    "make_config",
    "make_model_runner_output",
    "make_request",
]
