"""``InputProcessor``: turns a user prompt and ``SamplingParams`` into a validated ``EngineCoreRequest``.

It tokenizes text prompts, checks token ids and lengths against the model, clones the parameters and fills in
what the engine decides (``max_tokens`` when None, the model's extra EOS ids). It builds the request but does
not send it. Bad input raises ``ValueError`` (or ``TypeError`` for a wrong type) before anything is sent.
"""

from __future__ import annotations

import operator
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from vllite.config import EngineConfig
from vllite.engine.tokenizer import AnyTokenizer, apply_chat_template, load_generation_config
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams

# A prompt: text, {"prompt": text}, {"prompt_token_ids": [...]} (optionally with "prompt" and "cache_salt"),
# or a plain list of token ids.
PromptType = str | Mapping[str, Any] | Sequence[int]

DISABLE_ID_RANDOMIZATION_ENV = "VLLITE_DISABLE_REQUEST_ID_RANDOMIZATION"


def extract_prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text, if it has one (what ``RequestOutput.prompt`` shows)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


class InputProcessor:
    """Validates and tokenizes prompts into ``EngineCoreRequest``s (vLLM's ``InputProcessor``).

    ``tokenizer`` may be None (``skip_tokenizer_init``): then only token-id prompts are accepted.
    ``generation_config`` defaults to the model folder's ``generation_config.json``.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: AnyTokenizer | None,
        generation_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        if generation_config is None:
            generation_config = load_generation_config(self.model_config.model)
        self.generation_config_fields: dict[str, Any] = dict(generation_config)

    # ------------------------------------------------------------------ model facts
    @property
    def max_model_len(self) -> int | None:
        return self.model_config.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id: the tokenizer's, else the first of generation_config's / the model config's."""
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            return int(self.tokenizer.eos_token_id)
        for source in (self.generation_config_fields, _config_dict(self.model_config.hf_text_config)):
            eos = source.get("eos_token_id")
            if isinstance(eos, int):
                return eos
            if isinstance(eos, list) and eos:
                return int(eos[0])
        return None

    @property
    def vocab_size(self) -> int | None:
        """Token ids must be below this: the model's vocabulary when known, else the tokenizer's."""
        hf_vocab = getattr(self.model_config.hf_text_config, "vocab_size", None)
        if isinstance(hf_vocab, int) and hf_vocab > 0:
            return hf_vocab
        if self.tokenizer is not None:
            return len(self.tokenizer)
        return None

    # ------------------------------------------------------------------ main entry
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
        lora_name: str | None = None,
    ) -> EngineCoreRequest:
        """Builds the ``EngineCoreRequest`` for one prompt; the caller's ``params`` are never modified."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}.")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}.")
        token_ids, prompt_salt = self._tokenize(prompt, params)
        if cache_salt is None:
            cache_salt = prompt_salt
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}.")
        self._validate_prompt(token_ids)
        sampling_params = self._finalize_params(params, len(token_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_name=lora_name,
            cache_salt=cache_salt,
            priority=priority,
            trace_headers=dict(trace_headers) if trace_headers else None,
        )

    @staticmethod
    def assign_request_id(request: EngineCoreRequest) -> None:
        """Keeps the caller's id as ``external_req_id`` and gives the request a unique internal id.

        The internal id is ``f"{external}-{8 hex chars}"``, so equal external ids never collide in the engine;
        ``VLLITE_DISABLE_REQUEST_ID_RANDOMIZATION=1`` keeps the id as is.
        """
        if request.external_req_id is not None:
            raise ValueError(
                "The external_req_id field should not be set on EngineCoreRequests passed to vllite; "
                "use the request_id field."
            )
        request.external_req_id = request.request_id
        if os.environ.get(DISABLE_ID_RANDOMIZATION_ENV, "0") not in ("", "0", "false", "False"):
            return
        request.request_id = f"{request.external_req_id}-{uuid.uuid4().hex[:8]}"

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template (``ValueError``: none)."""
        return apply_chat_template(self.tokenizer, messages, **kwargs)

    # ------------------------------------------------------------------ steps
    def _tokenize(self, prompt: PromptType, params: SamplingParams) -> tuple[list[int], str | None]:
        salt = None
        if isinstance(prompt, str):
            token_ids = self._encode(prompt)
        elif isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "type", "arrival_time"}
            if unknown:
                raise ValueError(f"Unknown prompt keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids'.")
            salt = prompt.get("cache_salt")
            if prompt.get("prompt_token_ids") is not None:
                token_ids = _check_token_list(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                token_ids = self._encode(prompt["prompt"])
            else:
                raise ValueError("A dict prompt needs 'prompt' (a string) or 'prompt_token_ids' (a list of ints).")
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            token_ids = _check_token_list(prompt)
        else:
            raise TypeError(
                "A prompt must be a string, a dict with 'prompt' or 'prompt_token_ids', or a list of token "
                f"ids; got {type(prompt).__name__}."
            )
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            keep = self.max_model_len if truncate == -1 else truncate
            if keep is not None and len(token_ids) > keep:
                token_ids = token_ids[-keep:]
        return token_ids, salt

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "Text prompts need a tokenizer, but this engine was started without one "
                "(skip_tokenizer_init); pass {'prompt_token_ids': [...]} instead."
            )
        return [int(t) for t in self.tokenizer.encode(text)]

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty (0 tokens); give at least one token.")
        vocab = self.vocab_size
        lowest, highest = min(token_ids), max(token_ids)
        if lowest < 0 or (vocab is not None and highest >= vocab):
            bad = lowest if lowest < 0 else highest
            raise ValueError(f"Token id {bad} in the prompt is out of vocabulary (ids must be in [0, {vocab})).")
        max_len = self.max_model_len
        if max_len is not None and len(token_ids) > max_len:
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, longer than the maximum model length of "
                f"{max_len}. "
                "Shorten the prompt, raise --max-model-len, or set truncate_prompt_tokens."
            )

    def _finalize_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        vocab = self.vocab_size
        if vocab is not None:
            for name, ids in (
                ("allowed_token_ids", params.allowed_token_ids),
                ("logit_bias", params.logit_bias),
            ):
                out_of_range = [t for t in (ids or ()) if t >= vocab]
                if out_of_range:
                    raise ValueError(
                        f"SamplingParams.{name} has token ids out of vocabulary (size {vocab}): {out_of_range[:5]}."
                    )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop strings need a tokenizer; this engine has none.")
        sampling_params = params.clone()
        max_len = self.max_model_len
        if sampling_params.max_tokens is None and max_len is not None:
            sampling_params.max_tokens = max(1, max_len - prompt_len)
        sampling_params.update_from_generation_config(self.generation_config_fields, self.eos_token_id)
        return sampling_params


def _check_token_list(ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.")
    try:
        if any(isinstance(t, (bool, float)) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids must be a list of integers.") from None


def _config_dict(hf_config: Any) -> dict[str, Any]:
    if hf_config is None:
        return {}
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    return {"eos_token_id": getattr(hf_config, "eos_token_id", None)}
