"""Test support for vllite and for plugin authors: build tiny models, drive a scheduler, run an engine without a model.

Nothing here is used by the engine itself; it is shipped so that vllite's own tests, its benchmarks and the test
suites of third-party plugins (schedulers, logits processors, executors) share one set of fixtures.

- :mod:`vllite.testing.models`: tiny random-weight Hugging Face model folders built locally (no download):
  :func:`make_tiny_model`, :func:`make_tiny_model_dir_cached`, :func:`make_model` (benchmark presets).
- :mod:`vllite.testing.scheduler`: :func:`make_config` (a small ``EngineConfig``), :func:`make_request` (a hashed
  ``Request``), :func:`make_model_runner_output`, and :class:`ScriptedModelRunner`, a model-free stand-in for a
  model runner that turns each ``SchedulerOutput`` into the ``ModelRunnerOutput`` with tokens the test chose.
- :mod:`vllite.testing.executors`: :class:`PositionTokenExecutor`, a model-free ``Executor`` whose tokens are
  ``1000 + position``; select it with ``executor="vllite.testing.executors:PositionTokenExecutor"``.

- :mod:`vllite.testing.kv_connector_conformance`: the conformance kit a KV connector's test suite runs
  (``run_conformance``, or the collected ``test_kv_connector_conformance``).

The folder is ``vllite_testing/``, beside the kernel (``core/``) rather than in it: nothing in the engine imports it.
Importing this package is cheap (no torch); torch and transformers load when a model is built.
"""

from __future__ import annotations

from vllite.testing.executors import PositionTokenExecutor
from vllite.testing.models import (
    MODEL_PRESETS,
    SUPPORTED_TINY_ARCHS,
    TOKENIZER_FILES,
    copy_demo_tokenizer,
    make_model,
    make_tiny_model,
    make_tiny_model_dir_cached,
    tiny_config,
)
from vllite.testing.scheduler import (
    ScriptedModelRunner,
    TokenChooser,
    make_config,
    make_model_runner_output,
    make_request,
)

__all__ = [
    "MODEL_PRESETS",
    "SUPPORTED_TINY_ARCHS",
    "TOKENIZER_FILES",
    "PositionTokenExecutor",
    "ScriptedModelRunner",
    "TokenChooser",
    "copy_demo_tokenizer",
    "make_config",
    "make_model",
    "make_model_runner_output",
    "make_request",
    "make_tiny_model",
    "make_tiny_model_dir_cached",
    "tiny_config",
]
