"""The hook specifications: the whole contract between vllite and its plugins.

Components are contributed by *register-callback* hooks: vllite calls ``vllite_register_X(register)`` once at
start-up, and the plugin calls ``register(name, obj)`` for each component it provides — the object itself, or its
class path (``"pkg.mod:Class"``), which is imported only when an engine first uses that component, so listing the
plugins stays cheap. The plugin manager turns the results into plain ``name -> class`` registries, so no pluggy
call happens per token or per request. The
only hook called while the engine runs is :func:`vllite_step_observer`, at most once per engine step.

Write a plugin with the ``hookimpl`` marker::

    from vllite import hookimpl

    @hookimpl
    def vllite_register_schedulers(register):
        register("my-policy", MySchedulerClass)

and expose the module under the ``vllite`` entry-point group of your distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "vllite"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

# The callback handed to every register hook: register(name, component or "pkg.mod:Class").
Register = Callable[[str, Any], None]


@hookspec
def vllite_register_schedulers(register: Register) -> None:
    """Contribute scheduler classes, selectable with ``--scheduler-cls NAME``.

    When: once, when the plugin manager builds the ``schedulers`` registry (engine-core start-up, in every
    process that builds an engine core).
    Receives: ``register(name, cls)``; ``cls`` is a ``vllite.sched.SchedulerInterface`` implementation,
    usually a subclass of ``vllite.sched.Scheduler`` overriding a few policy methods.
    Returns: nothing. Not firstresult: every plugin is called. A name registered twice is an error naming both.
    Hot path: no; called once per process.
    """


@hookspec
def vllite_register_logits_processors(register: Register) -> None:
    """Contribute logits-processor classes that are loaded for every engine.

    When: once, when the engine's logits processors are built (executor start-up).
    Receives: ``register(name, cls)``; ``cls`` follows ``vllite.logits_processor.LogitsProcessor`` (or vLLM's
    newer slot-based interface, which is adapted).
    Returns: nothing. Not firstresult. Builtins (min-p, logit bias, min tokens, thinking budget) come first.
    Hot path: no; the processors' own ``apply`` runs per step, the hook does not.
    """


@hookspec
def vllite_register_executors(register: Register) -> None:
    """Contribute executor classes (what runs the model), selectable with ``--executor NAME`` or ``--device``.

    When: once, at engine-core start-up.
    Receives: ``register(name, cls)``; ``cls`` implements ``vllite.executor.Executor``.
    Returns: nothing. Not firstresult. Hot path: no.
    """


@hookspec
def vllite_register_engine_clients(register: Register) -> None:
    """Contribute engine-client classes: how the frontend reaches the engine core (in-process, ZMQ, ...).

    When: once, when an ``LLM``/``LLMEngine``/``AsyncLLM`` is created.
    Receives: ``register(name, cls)``; ``cls`` implements ``vllite.engine.core_client.EngineCoreClient``.
    Returns: nothing. Not firstresult. Hot path: no.
    """


@hookspec
def vllite_register_kv_connectors(register: Register) -> None:
    """Contribute KV connectors (moving KV blocks to and from outside the engine).

    When: once, at engine-core start-up, if a connector is configured.
    Receives: ``register(name, cls)``. Returns: nothing. Not firstresult. Hot path: no.
    """


@hookspec
def vllite_register_structured_output_backends(register: Register) -> None:
    """Contribute grammar backends for structured outputs (``structured_outputs_config={"backend": NAME}``).

    When: once, when the frontend first validates a constrained request or the engine core first compiles one.
    Receives: ``register(name, cls)``; ``cls`` subclasses
    ``vllite.structured_output.backend.StructuredOutputBackend``: a ``validate(spec)`` class method (submit-time
    checks without a tokenizer, ``ValueError`` naming the problem), ``cls(tokenizer, vocab_size, eos_token_ids)``,
    ``compile(spec)`` (on a compile thread; the result is cached per constraint) and ``new_grammar(compiled)`` (a
    per-request matcher: ``accept_tokens``, ``validate_tokens``, ``rollback``, ``fill_bitmask``, ``is_terminated``).
    Builtins: ``xgrammar`` and ``guidance``.
    Returns: nothing. Not firstresult. Hot path: no (a matcher's methods run per step; the hook does not).
    """


@hookspec
def vllite_register_tool_call_estimators(register: Register) -> None:
    """Contribute tool-call estimators for the Continuum scheduler (``--tool-call-estimator NAME``).

    When: once, when a scheduler that pins KV across tool calls is built.
    Receives: ``register(name, cls)``; ``cls(config)`` has ``request_arrives(request, now)``,
    ``request_finished(request, now)`` and ``set_up_pin(request, now) -> float`` (the TTL in seconds, 0 = no pin).
    Returns: nothing. Not firstresult. Hot path: no (the estimator's methods run per request, not the hook).
    """


@hookspec
def vllite_register_tool_parsers(register: Register) -> None:
    """Contribute tool-call parsers: given a turn's text, name the tool it calls and extract its calls.

    When: once, when a scheduler or server needs tool parsing.
    Receives: ``register(name, cls)``; ``cls()`` must have ``parse(text) -> str | None`` (the tool's name, for the
    Continuum scheduler). For ``vllite serve --tool-call-parser`` it also needs ``extract(text) ->
    ExtractedToolCalls`` and ``stream() -> ToolCallStream`` (see ``vllite.plugins.tool_parsers.extraction``: the
    content outside the calls and each call's name and JSON arguments; a stream's ``feed`` and ``finish`` agree
    with ``extract`` however the text is split).
    Returns: nothing. Not firstresult. Hot path: no (a stream's ``feed`` runs once per streamed delta).
    """


@hookspec
def vllite_register_reasoning_parsers(register: Register) -> None:
    """Contribute reasoning parsers, selectable with ``vllite serve --reasoning-parser NAME`` (vLLM's names).

    When: once, when the server checks its flags (the frontend process only).
    Receives: ``register(name, cls)``; ``cls(thinking=..., prompt_open=...)`` has ``extract_reasoning(text) ->
    (reasoning, content)`` and ``stream()``, whose ``feed(delta) -> (reasoning_delta, content_delta)`` and
    ``finish()`` agree with it however the text is split, and ``start_marker``/``end_marker`` (the thinking budget
    and structured outputs use them); see ``vllite.plugins.reasoning.base``.
    Returns: nothing. Not firstresult. Hot path: no (a stream's ``feed`` runs once per streamed delta).
    """


@hookspec
def vllite_register_models(register: Register) -> None:
    """Contribute model classes for architectures transformers lacks.

    When: once, when the executor loads a model.
    Receives: ``register(architecture, cls)``; ``architecture`` matches ``config.json``'s ``architectures`` entry
    and ``cls`` has transformers' ``from_pretrained``/``forward`` contract.
    Returns: nothing. Not firstresult. Hot path: no.
    """


@hookspec
def vllite_register_commands(register: Register) -> None:
    """Contribute ``vllite`` CLI subcommands.

    When: once, when the ``vllite`` command builds its argument parser.
    Receives: ``register(name, command)``; ``command`` has ``help: str``, ``add_arguments(parser)`` and
    ``run(args) -> int | None``.
    Returns: nothing. Not firstresult. Hot path: no.
    """


@hookspec
def vllite_register_lora_resolvers(register: Register) -> None:
    """Contribute LoRA resolvers: ``vllite serve`` asks them for an adapter a request names that it does not serve.

    When: once, at server start-up, with ``--enable-lora`` and ``VLLITE_ALLOW_RUNTIME_LORA_UPDATING=1``.
    Receives: ``register(name, cls)``; ``cls()`` (or an instance) has ``resolve_lora(base_model_name, lora_name) ->
    LoRARequest | None`` (sync or async, as vLLM's ``LoRAResolver``); only its ``lora_path`` is used, the server
    gives the adapter its id and loads it. Builtin: ``filesystem`` (``$VLLITE_LORA_RESOLVER_CACHE_DIR/NAME``).
    Returns: nothing. Not firstresult; resolvers are asked in order, builtins first. Hot path: no (a resolver runs
    once per unknown adapter name).
    """


@hookspec
def vllite_register_kv_event_publishers(register: Register) -> None:
    """Contribute KV-cache event publishers, selected by ``--kv-events-config``'s ``publisher`` (vLLM's names).

    When: once, when an engine core starts with KV-cache events enabled (and when a config naming one is checked).
    Receives: ``register(name, cls)``; ``cls(config, data_parallel_rank)`` (``config``: a
    ``vllite.kv_events.KVEventsConfig``) has ``publish(events)``, called once per engine step with the events the
    block pool recorded (``vllite.kv_events`` structs; never blocks the engine), and ``shutdown()``. Builtin: ``zmq``.
    Returns: nothing. Not firstresult. Hot path: ``publish`` runs once per step; the hook does not.
    """


@hookspec
def vllite_register_step_wrappers(register: Register) -> None:
    """Contribute step wrappers: what every engine core enters around each step's model execution.

    When: once, when an engine core starts; each registered class is built for it.
    Receives: ``register(name, cls)``; ``cls(config, scheduler)`` has ``around(scheduler_output)``, a context
    manager entered around the executor's ``execute_model`` of every step (empty ones too). An exception leaving it
    is the step's failure: a wrapper may log it but must let it pass. Builtin: ``step_log`` (a failed step's dump,
    ``--enable-logging-iteration-details``).
    Returns: nothing. Not firstresult. Hot path: ``around`` is entered once per step; the hook is called once.
    """


@hookspec
def vllite_step_observer(step: dict[str, Any]) -> None:
    """Observe one engine step (tracing, metrics).

    When: after each engine step's scheduling decision, only if at least one plugin implements this hook
    (otherwise the engine never builds the ``step`` record, so it costs nothing).
    Receives: a dict with ``step`` (counter), ``time``, ``num_waiting``, ``num_running``, ``free_blocks``,
    ``cached_blocks``, ``new``/``resumed``/``running``/``preempted`` (request id -> scheduled tokens) and
    ``prefix_hits`` (request id -> cached tokens on admission).
    Returns: nothing. Not firstresult. Hot path: once per step, never per token or per request.
    """
