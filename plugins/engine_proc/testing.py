"""Deprecated: the model-free test executor moved to :mod:`vllite.testing.executors`.

``FakeTokenExecutor`` is now :class:`vllite.testing.PositionTokenExecutor` (class path
``"vllite.testing.executors:PositionTokenExecutor"``). This alias module keeps the old class path working with a
``DeprecationWarning`` and will be removed in the next release.
"""

from __future__ import annotations

import warnings

from vllite.testing.executors import PositionTokenExecutor

warnings.warn(
    "vllite.plugins.engine_proc.testing is deprecated; use vllite.testing.executors:PositionTokenExecutor "
    "(formerly FakeTokenExecutor).",
    DeprecationWarning,
    stacklevel=2,
)

#: Deprecated name of :class:`vllite.testing.PositionTokenExecutor`.
FakeTokenExecutor = PositionTokenExecutor

__all__ = ["FakeTokenExecutor", "PositionTokenExecutor"]
