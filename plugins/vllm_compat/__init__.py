"""vLLM plugins without vLLM: serves the ``vllm.*`` names that logits-processor plugins import.

A plugin written for vLLM begins with ``from vllm.v1.sample.logits_processor import LogitsProcessor`` (or
``vllm.config``, ``vllm.sampling_params``, ``vllm.logger`` ...). When no real vLLM is importable, the finder of
this package answers those imports with vllite's own objects (the same objects: ``vllm.v1.sample.
logits_processor.BatchUpdate`` *is* ``vllite.logits_processor.BatchUpdate``), listed in :data:`SERVED_MODULES`.

- It never shadows a real vLLM: asked for ``vllm``, it first asks every other finder, and steps aside when one
  finds the real package. It is a ``sys.meta_path`` finder, not a shipped ``vllm/`` folder.
- It is not active after ``import vllite`` (libraries probe ``find_spec("vllm")`` to decide whether vLLM is
  installed). vllite calls :func:`activate` before it imports any plugin, in the frontend and in the engine-core
  process (logits-processor loading and entry-point loading).
- It is a builtin adapter, not a registered plugin: the kernel imports it inside the functions that load plugins.
  Its old name ``vllite.vllm_compat`` is a deprecated alias for one release (``vllite.deprecated_aliases``).
- A ``vllm.*`` name it does not serve fails with :class:`~vllite.plugins.vllm_compat.finder.VllmCompatImportError` (a
  ``ModuleNotFoundError``) whose message names it and lists what the layer provides.
"""

from __future__ import annotations

from vllite.plugins.vllm_compat.finder import (
    SERVED_VERSION,
    VllmCompatFinder,
    VllmCompatLoader,
    activate,
    deactivate,
    is_active,
    is_shim_module,
    missing_message,
)
from vllite.plugins.vllm_compat.served import SERVED_MODULES, VLLM_API_VERSION

__all__ = [
    "SERVED_MODULES",
    "SERVED_VERSION",
    "VLLM_API_VERSION",
    "VllmCompatFinder",
    "VllmCompatLoader",
    "activate",
    "deactivate",
    "is_active",
    "is_shim_module",
    "missing_message",
]
