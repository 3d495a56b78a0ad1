"""From an OpenAI request to ``SamplingParams``: the model's defaults under the request's fields, vLLM's extras,
and Continuum's program fields in ``extra_args`` (exactly where the fork's scheduler reads them).

Every rejection is a :class:`BadRequestError` naming the field, so the server answers 400 with ``param`` set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import SamplingFields
from vllite.repetition import as_repetition_detection
from vllite.sampling_params import RequestOutputKind, SamplingParams
from vllite.structured_output.params import StructuredOutputsParams

#: Request fields that fall back to the model's generation config (``--generation-config``) when unset.
MODEL_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: OpenAI's defaults where neither the request nor the model says.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
#: The Continuum fork's request fields, copied into ``SamplingParams.extra_args`` when present.
CONTINUUM_FIELDS = ("job_id", "is_last_step", "this_func_call", "last_func_call")
#: ``vllm_xargs`` values: JSON scalars or lists of them (vLLM's rule).
_XARG_SCALARS = (str, int, float, bool)


def build_sampling_params(
    request: SamplingFields,
    model_defaults: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    vocab_size: int | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams`` (DELTA output when streaming, FINAL_ONLY otherwise).

    ``prompt_logprobs`` (the echo of completions) applies when the request sets none itself. ``vocab_size``: the
    model's, to name every ``logit_bias`` key outside it at once. Raises :class:`BadRequestError` naming the field
    for a value ``SamplingParams`` refuses.
    """
    fields: dict[str, Any] = {}
    for name in MODEL_DEFAULTED_FIELDS:
        value = getattr(request, name)
        if value is None:
            value = model_defaults.get(name, OPENAI_DEFAULTS[name])
        fields[name] = value
    if max_tokens is None:
        max_tokens = model_defaults.get("max_tokens")
    try:
        return SamplingParams(
            n=request.n,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=None if request.logprob_token_ids else logprobs,
            logprob_token_ids=request.logprob_token_ids or None,
            prompt_logprobs=request.prompt_logprobs if request.prompt_logprobs is not None else prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
            extra_args=extra_args(request),
            structured_outputs=structured_outputs,
            repetition_detection=as_repetition_detection(request.repetition_detection),
            **fields,
        )
    except BadRequestError:
        raise
    except (ValueError, TypeError) as exc:
        raise BadRequestError(str(exc), param=field_named_in(str(exc))) from None


def extra_args(request: SamplingFields) -> dict[str, Any] | None:
    """``extra_args`` (vllite's name), ``vllm_xargs`` (vLLM's), the Continuum fields and ``kv_transfer_params``
    (where KV connectors read it), merged in that order."""
    merged: dict[str, Any] = {}
    if request.extra_args:
        merged.update(request.extra_args)
    if request.vllm_xargs:
        for key, value in request.vllm_xargs.items():
            ok = isinstance(value, _XARG_SCALARS) or (
                isinstance(value, list) and all(isinstance(v, _XARG_SCALARS) for v in value)
            )
            if not ok:
                raise BadRequestError(
                    f"vllm_xargs[{key!r}] must be a string, number, boolean or a list of them; "
                    f"got {type(value).__name__}.",
                    param="vllm_xargs",
                )
            merged[key] = value
    for name in CONTINUUM_FIELDS:
        value = getattr(request, name)
        if value is not None:
            merged[name] = str(value) if name == "job_id" else value
    if request.kv_transfer_params is not None:
        merged["kv_transfer_params"] = request.kv_transfer_params
    return merged or None


def check_common_fields(request: SamplingFields, *, max_logprobs: int) -> None:
    """Checks that ``SamplingParams`` cannot name by themselves; raises :class:`BadRequestError`."""
    if request.stream_options is not None and not request.stream:
        raise BadRequestError("stream_options is only allowed when stream is true.", param="stream_options")
    if request.n < 1:
        raise BadRequestError(f"n must be at least 1, got {request.n}.", param="n")
    plp = request.prompt_logprobs
    if plp is not None and request.stream and (plp > 0 or plp == -1):
        # vLLM's rule: prompt logprobs come with the whole response, which a stream never sends.
        raise BadRequestError("prompt_logprobs are not available when stream is true.", param="prompt_logprobs")


def check_logprob_token_ids(request: SamplingFields, *, logprobs_field: str, logprobs_set: bool) -> None:
    """vLLM's rules for ``logprob_token_ids`` that ``SamplingParams`` cannot check by itself: the route's logprobs
    switch (``logprobs_field``) set, no beam search; raises :class:`BadRequestError` naming the field. (Ids outside
    the vocabulary are the engine's 400, as for ``allowed_token_ids``.)"""
    if not request.logprob_token_ids:
        return
    if not logprobs_set:
        raise BadRequestError(f"logprob_token_ids needs {logprobs_field} to be set.", param="logprob_token_ids")
    if request.use_beam_search:
        raise BadRequestError("logprob_token_ids is not supported with beam search.", param="logprob_token_ids")


def check_max_tokens(
    max_tokens: int | None,
    prompt_lengths: Sequence[int],
    *,
    max_model_len: int,
    param: str,
    truncate_prompt_tokens: int | None = None,
) -> None:
    """400 naming both numbers when the longest prompt and the ``max_tokens`` the request asks for do not fit in the
    context together (vLLM's check; the engine would otherwise stop at the context's end, a silent clamp).

    ``param`` is the request's field (``max_tokens`` or ``max_completion_tokens``); ``truncate_prompt_tokens`` is
    applied first, as the engine applies it. A prompt longer than the whole context is left to the engine's own 400.
    """
    if max_tokens is None or not prompt_lengths:
        return
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    longest = max(n if keep is None else min(n, keep) for n in prompt_lengths)
    if longest > max_model_len or longest + max_tokens <= max_model_len:
        return
    raise BadRequestError(
        f"{param}={max_tokens} is too large: this model's maximum context length is {max_model_len} tokens, and the "
        f"prompt takes {longest} of them, which leaves {max_model_len - longest} for the completion. Lower {param} "
        "or shorten the prompt.",
        param=param,
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None = None) -> dict[int, float] | None:
    """``{token_id: bias}`` of the request; one 400 naming every bad key and value (not only the first)."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    bad_keys: list[str] = []
    bad_values: list[str] = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            bad_keys.append(key)
        elif not -100.0 <= value <= 100.0:
            bad_values.append(f"{value} for {key}")
        else:
            out[token_id] = value
    problems = []
    if bad_keys:
        where = f" in [0, {vocab_size})" if vocab_size is not None else ""
        problems.append(f"logit_bias keys must be token ids{where}; these are not: {', '.join(map(repr, bad_keys))}.")
    if bad_values:
        problems.append(f"logit_bias values must be in [-100, 100]; got {', '.join(bad_values)}.")
    if problems:
        raise BadRequestError(" ".join(problems), param="logit_bias")
    return out


def field_named_in(message: str) -> str | None:
    """The field a ``SamplingParams`` error names (``"temperature must be ..."``, ``"SamplingParams.n ..."``)."""
    words = message.replace("SamplingParams.", "").replace("=", " ").split()
    for word in words[:6]:
        name = word.strip(".,:;'\"`()").split(".")[0]  # repetition_detection.min_count: the request's field
        if name in SamplingFields.model_fields or name in ("max_tokens", "logprobs", "prompt_logprobs"):
            return name
    return None
