"""``SamplingParams``: how one request is sampled, validated the moment it is built.

A ``msgspec.Struct`` so it travels inside ``EngineCoreRequest`` over the wire without pickle. Field names and
defaults follow vLLM, so code written for vLLM's ``SamplingParams`` runs unchanged. Every invalid value raises
``ValueError`` naming the field and the allowed range, both on construction and when decoded from the wire.
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any

import msgspec

from vllite.repetition import RepetitionDetectionParams, as_repetition_detection
from vllite.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
_MAX_LOGIT_BIAS = 100.0
#: ``seed`` is a signed 64-bit integer (the engine's wire format and the per-request generators take that range).
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1
#: The most samples one request may ask for (``n``): each is a full request in the engine.
MAX_N = 128
#: The most token ids ``logprob_token_ids`` may name (vLLM's bound).
MAX_LOGPROB_TOKEN_IDS = 128


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a streaming request carries."""

    CUMULATIVE = 0  # the whole output so far, every time
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


class SamplingType(enum.IntEnum):
    """How the sampler treats a request: argmax, random, or random from its own seeded generator."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters of one request (vLLM-compatible names and defaults).

    ``n`` is capped at ``MAX_N`` (128) samples per request. ``temperature=0`` means greedy. ``top_k`` of 0 or -1
    disables top-k. ``max_tokens=None`` lets the request run to ``max_model_len``. Per-request arguments for logits
    processors go in ``extra_args``.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Score exactly these token ids at every generated position (with the sampled token) instead of the top-N;
    # ``logprobs`` then defaults to (and must equal) their number. For label scoring without a whole-vocabulary top-N.
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Words the output must not contain: each word's tokens (with and without a leading space) are banned as a
    # continuation (the builtin ``bad_words`` logits processor).
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    # A JSON-schema / regex / choice / grammar constraint on the output (vllite.structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # End the output once it repeats an N-gram back to back (vLLM's field; finish_reason "repetition").
    repetition_detection: RepetitionDetectionParams | None = None
    # Filled by the engine (eos and generation-config stop ids); part of the wire format on purpose.
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if isinstance(self.logprob_token_ids, tuple):
            self.logprob_token_ids = list(self.logprob_token_ids)
        if self.logprob_token_ids and self.logprobs is None:
            self.logprobs = len(self.logprob_token_ids)
        if self.repetition_detection is not None:
            self.repetition_detection = as_repetition_detection(self.repetition_detection)
        self._verify()
        for token_id in self.stop_token_ids:
            if token_id not in self.all_stop_token_ids:
                self.all_stop_token_ids.append(token_id)

    # ------------------------------------------------------------------ validation
    def _verify(self) -> None:
        self._verify_sampling()
        self._verify_lengths()
        self._verify_tokens()
        self._verify_flags()

    def _bad(self, field: str, allowed: str) -> ValueError:
        return ValueError(f"SamplingParams.{field} must be {allowed}, got {getattr(self, field)!r}.")

    def _verify_sampling(self) -> None:
        bad = self._bad
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "a number in (0, 10]")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 1e4:
            raise bad("temperature", "a finite number >= 0 (0 means greedy)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable top-k")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise bad("seed", "None or an integer in the signed 64-bit range [-2**63, 2**63 - 1]")

    def _verify_lengths(self) -> None:
        bad = self._bad
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1, or None for 'up to max_model_len'")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise bad(name, "None, -1 (the whole vocabulary) or an integer >= 0")
        self._verify_logprob_token_ids()
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise bad("truncate_prompt_tokens", "None, -1 (truncate to max_model_len) or an integer >= 1")

    def _verify_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not _is_id_list(ids) or not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS or len(set(ids)) != len(ids):
            raise self._bad(
                "logprob_token_ids",
                f"None or a list of 1 to {MAX_LOGPROB_TOKEN_IDS} distinct token ids (integers >= 0)",
            )
        if self.logprobs != len(ids):
            raise ValueError(
                f"SamplingParams.logprob_token_ids names {len(ids)} tokens but logprobs={self.logprobs}: when both "
                "are set, logprobs must equal len(logprob_token_ids)."
            )

    def _verify_tokens(self) -> None:
        bad = self._bad
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not _is_id_list(self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids (integers >= 0)")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids >= 0, got {token_id}.")
                if not math.isfinite(bias) or abs(bias) > _MAX_LOGIT_BIAS:
                    raise ValueError(
                        f"SamplingParams.logit_bias values must be in [-100, 100], got {bias} for token {token_id}."
                    )
        if self.allowed_token_ids is not None and (
            not _is_id_list(self.allowed_token_ids) or not self.allowed_token_ids
        ):
            raise bad("allowed_token_ids", "None or a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "None or a list of words (non-blank strings)")

    def _verify_flags(self) -> None:
        bad = self._bad
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "None or a dict")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "None or a StructuredOutputsParams")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop strings need detokenize=True (stop strings match decoded text).")

    # ------------------------------------------------------------------ derived values
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back from streamed text so a partially matched stop string is never shown."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self) -> SamplingParams:
        """An independent copy, so the engine can fill in defaults without touching the user's object.

        Scalars are shared (immutable); every mutable field gets its own copy. About 15x cheaper than
        ``copy.deepcopy``, which matters when a batch of thousands of prompts is submitted.
        """
        return msgspec.structs.replace(
            self,
            stop=list(self.stop or ()),
            stop_token_ids=list(self.stop_token_ids or ()),
            all_stop_token_ids=list(self.all_stop_token_ids),
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            logprob_token_ids=list(self.logprob_token_ids) if self.logprob_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words is not None else None,
            extra_args=copy.deepcopy(self.extra_args) if self.extra_args else self.extra_args,
            structured_outputs=(
                msgspec.structs.replace(self.structured_outputs) if self.structured_outputs is not None else None
            ),
            repetition_detection=(
                msgspec.structs.replace(self.repetition_detection) if self.repetition_detection is not None else None
            ),
        )

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | list[int] | None = None
    ) -> None:
        """Adds the model's extra EOS ids (generation_config.json) as stop tokens, unless ``ignore_eos``."""
        if self.ignore_eos:
            return
        ids = generation_config.get("eos_token_id")
        if ids is None:
            return
        ids = [ids] if isinstance(ids, int) else list(ids)
        primary = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])
        for token_id in ids:
            if token_id not in primary and token_id not in self.all_stop_token_ids:
                self.all_stop_token_ids.append(token_id)


def _normalize_logit_bias(logit_bias: object) -> dict[int, float]:
    """``{token_id: bias}`` with int keys and float values; string keys (as in JSON) are accepted."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"SamplingParams.logit_bias must be None or a dict {{token_id: bias}}, got {logit_bias!r}.")
    try:
        return {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError):
        raise ValueError(
            f"SamplingParams.logit_bias must map token ids (integers) to numbers, got {logit_bias!r}."
        ) from None


def _is_id_list(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(t) and t >= 0 for t in value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Beam search parameters (vLLM's ``BeamSearchParams``), for ``LLM.beam_search`` and ``use_beam_search``.

    ``beam_width`` beams, each up to ``max_tokens`` tokens. ``length_penalty`` divides a finished sequence's
    cumulative logprob by its generated length to that power (0: no normalisation; > 0 favours longer sequences).
    ``early_stopping`` (Hugging Face's and earlier vLLM's meaning): ``True`` stops once ``beam_width`` sequences
    finished, ``False`` once the best live beam cannot beat them at its current length, ``"never"`` once it cannot
    at any length. ``temperature`` is passed to the step requests; the candidates come from the model's raw
    logprobs, so it does not change them. The algorithm: :mod:`vllite.plugins.beam_search`.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_N:
            raise ValueError(
                f"BeamSearchParams.beam_width must be an integer in [1, {MAX_N}], got {self.beam_width!r}."
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _is_real(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}.")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            raise ValueError(
                f"BeamSearchParams.early_stopping must be True, False or 'never', got {self.early_stopping!r}."
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BeamSearchParams.{name} must be True or False, got {getattr(self, name)!r}.")
