"""What the command line adds to the engine flags of ``vllite generate``, ``chat`` and ``serve``.

- vLLM's engine flags that vllite does not implement are recognised and refused with one line saying what to use
  instead (:data:`VLLM_ONLY_FLAGS`), not argparse's "unrecognized arguments"; the few with nothing to do here
  (``--enforce-eager``: vllite captures no CUDA graphs) are accepted and ignored.
- :func:`check_engine_args` checks, before the engine process starts, what can be checked without loading the
  model (the model config alone takes seconds: transformers loads with it): the names of the scheduler, executor
  (or ``--device``), KV connector and grammar backend, and ``--max-model-len`` against the model's
  ``config.json``. A mistake then fails in about a second instead of after the engine's start-up.

vLLM's underscore spellings (``--max_model_len``) are rewritten by the command line
(:func:`vllite.plugins.commands.main.main`) before parsing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.engine_args import EngineArgs

_SCALE_OUT = "for scale-out use -dp N (--data-parallel-size)"
_LORA = (
    "it is a `vllite serve` flag (vllite serve --enable-lora --lora-modules NAME=PATH); "
    "from Python pass lora_request=LoRARequest(...) (see docs/lora.md)"
)
_SPECULATIVE = 'n-gram speculative decoding: --speculative-config \'{"method": "ngram", "num_speculative_tokens": 3}\''

#: vLLM engine flags vllite does not implement, each with what to use instead; ``None``: accepted and ignored (there
#: is nothing for it to change here). Hidden from ``--help``; docs/serving.md lists them.
VLLM_ONLY_FLAGS: dict[tuple[str, ...], str | None] = {
    ("--tensor-parallel-size", "-tp"): _SCALE_OUT,
    ("--pipeline-parallel-size", "-pp"): _SCALE_OUT,
    ("--distributed-executor-backend",): "data-parallel engines run as local processes or on Ray: "
    "--data-parallel-backend mp|ray",
    ("--lora-modules",): _LORA,
    ("--speculative-model",): _SPECULATIVE,
    ("--num-speculative-tokens",): _SPECULATIVE,
    ("--load-format",): "vllite loads the safetensors weights of the model folder",
    ("--swap-space",): "for a host-memory KV tier use --kv-offload-size GiB",
    ("--cpu-offload-gb",): "choose a model whose weights fit the device's memory",
    ("--enforce-eager",): None,  # vllite captures no CUDA graphs: it always runs eagerly
    ("--disable-log-requests",): None,  # requests are logged only with --enable-log-requests
}


class _VllmOnlyFlag(argparse.Action):
    """A vLLM flag vllite lacks: giving it raises ``ValueError`` saying what to use instead (``const``); a flag
    without advice is accepted and ignored."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if self.const is None:
            return
        name = self.option_strings[0]
        given = name if option_string in (None, name) else f"{option_string} ({name})"
        raise ValueError(f"{given} is not supported by vllite yet; {self.const}")


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    """Registers :data:`VLLM_ONLY_FLAGS` on ``parser`` (hidden from its help; they set nothing), except those the
    command implements itself (``serve``'s ``--lora-modules``)."""
    for flags, advice in VLLM_ONLY_FLAGS.items():
        if any(flag in parser._option_string_actions for flag in flags):
            continue
        parser.add_argument(
            *flags,
            action=_VllmOnlyFlag,
            nargs="?" if advice else 0,
            const=advice,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def check_engine_args(engine_args: EngineArgs) -> None:
    """Checks what can be checked without loading the model, before any engine starts: the component names given
    and ``--max-model-len`` against the model's ``config.json``. Bad input: a ``ValueError`` naming the value (an
    unknown name lists the registered ones)."""
    from vllite.exceptions import UnknownComponentError

    try:
        _check_component_names(engine_args)
    except UnknownComponentError as exc:
        raise ValueError(str(exc)) from None  # bad input (exit code 2), not a broken plugin
    _check_max_model_len(engine_args)


def _check_component_names(engine_args: EngineArgs) -> None:
    """The scheduler, executor (or ``--device``), KV connector and grammar backend named (class paths are
    imported where they are used) must be registered; nothing is imported."""
    from vllite.config import executor_name
    from vllite.plugin_manager import get_plugin_manager
    from vllite.structured_output.params import StructuredOutputsConfig
    from vllite.structured_output.registry import REGISTRY_KIND, backend_class

    manager = get_plugin_manager()
    if engine_args.scheduler_cls:
        manager.check_name("schedulers", engine_args.scheduler_cls)
    manager.check_name("executors", executor_name(engine_args.executor, engine_args.device))
    kv = engine_args.kv_transfer_config
    if isinstance(kv, dict) and isinstance(kv.get("kv_connector"), str) and not kv.get("kv_connector_module_path"):
        manager.check_name("kv_connectors", kv["kv_connector"])
    backend = StructuredOutputsConfig.resolve(engine_args.structured_outputs_config).backend
    if backend != "auto" and backend not in manager.components(REGISTRY_KIND):
        backend_class(backend)  # raises ValueError naming the registered backends


def _check_max_model_len(engine_args: EngineArgs) -> None:
    """``--max-model-len`` over ``max_position_embeddings`` fails now where the transformers executor will run the
    model (other executors may not use the model at all). ``config.json`` is read as JSON, without transformers;
    a missing or unreadable one is left to the model loader to report."""
    from vllite.assets import default_model_path
    from vllite.config import executor_name

    requested = engine_args.max_model_len
    if requested is None or executor_name(engine_args.executor, engine_args.device) not in ("default", "cpu", "cuda"):
        return
    try:
        config = json.loads(Path(engine_args.model or default_model_path(), "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    text_config = config.get("text_config")
    limit = (text_config if isinstance(text_config, dict) else config).get("max_position_embeddings")
    if isinstance(limit, int) and requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}; lower --max-model-len."
        )
