"""The ``SamplingParams`` of one realtime response: the model's defaults (``--generation-config``) under the
session's and the response's ``temperature``, and ``max_output_tokens`` within the room the context has left."""

from __future__ import annotations

from typing import Any

from vllite.plugins.openai_server.sampling import MODEL_DEFAULTED_FIELDS, OPENAI_DEFAULTS
from vllite.sampling_params import RequestOutputKind, SamplingParams


def turn_sampling_params(
    model_defaults: dict[str, Any], max_output_tokens: int | str, room: int, temperature: float | None
) -> SamplingParams:
    """Streaming (DELTA) parameters for a turn that may add ``room`` tokens to the session's context at most.

    ``max_output_tokens`` ``"inf"`` is the model's ``max_tokens`` default, else all the room left (the turn that
    fills the context ends the session). ``ValueError`` for a value ``SamplingParams`` refuses.
    """
    fields = {name: model_defaults.get(name, OPENAI_DEFAULTS[name]) for name in MODEL_DEFAULTED_FIELDS}
    if temperature is not None:
        fields["temperature"] = temperature
    if max_output_tokens == "inf":
        max_tokens = min(model_defaults.get("max_tokens") or room, room)
    else:
        max_tokens = min(int(max_output_tokens), room)
    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **fields)
