"""Backend lookup and submit-time validation.

Backends are plugins: ``vllite_register_structured_output_backends(register)`` contributes ``name -> class`` (a
:class:`~vllite.structured_output.backend.StructuredOutputBackend`); ``xgrammar`` and ``guidance`` are the builtins.
``auto`` tries :data:`AUTO_ORDER` in turn and takes the first that accepts the constraint.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, cast

import msgspec

from vllite.exceptions import VlliteError
from vllite.structured_output.backend import StructuredOutputBackend
from vllite.structured_output.params import AUTO, StructuredOutputsConfig, StructuredOutputsParams

if TYPE_CHECKING:
    from vllite.structured_output.params import GrammarSpec

#: The backends ``auto`` tries, in order.
AUTO_ORDER = ("xgrammar", "guidance")
#: The plugin registry kind of grammar backends.
REGISTRY_KIND = "structured_output_backends"


def backend_class(name: str) -> type[StructuredOutputBackend]:
    """The registered backend class ``name`` (``ValueError`` naming the registered ones when unknown)."""
    from vllite.plugin_manager import get_registry

    registry = get_registry(REGISTRY_KIND)
    cls = registry.get(name)
    if cls is None:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"Unknown structured-output backend {name!r}; registered: {known} (or 'auto').")
    return cast("type[StructuredOutputBackend]", cls)


def candidate_backends(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> tuple[str, ...]:
    """The backends to try for ``params``: the one it pins, else the engine's, else (``auto``) :data:`AUTO_ORDER`."""
    name = params.backend or config.backend
    return AUTO_ORDER if name == AUTO else (name,)


def validate_structured_outputs(
    params: StructuredOutputsParams, config: StructuredOutputsConfig
) -> StructuredOutputsParams:
    """``params`` with the engine's defaults filled in and ``backend`` set to the backend that will compile it.

    Raises ``ValueError`` naming the problem when no candidate backend accepts the constraint (a malformed schema,
    regex or grammar, or a feature the chosen backend does not support); with ``auto``, the message names what each
    backend said.
    """
    params = params.with_defaults(config)
    spec = params.spec()
    errors: list[str] = []
    for name in candidate_backends(params, config):
        try:
            cls = backend_class(name)
        except VlliteError as exc:  # a plugin failed to load
            raise ValueError(str(exc)) from None
        error = _validation_error(cls, spec)
        if error is not None:
            errors.append(error)
            continue
        return msgspec.structs.replace(params, backend=name)
    if len(errors) == 1:
        raise ValueError(errors[0])
    raise ValueError("; ".join(errors))


@functools.lru_cache(maxsize=1024)
def _validation_error(cls: type[StructuredOutputBackend], spec: GrammarSpec) -> str | None:
    """What ``cls`` says of ``spec`` (None: accepted). Cached: requests of a pipeline or an agent repeat one schema,
    and converting it costs a compilation's front half on every submit."""
    try:
        cls.validate(spec)
    except ValueError as exc:
        return str(exc)
    return None
