"""``InputProcessor``: turns a user prompt and ``SamplingParams`` into a validated ``EngineCoreRequest``.

It tokenizes text prompts, checks token ids and lengths against the model, clones the parameters and fills in
what the engine decides (``max_tokens`` when None, the model's extra EOS ids). It builds the request but does
not send it. Bad input raises ``ValueError`` (or ``TypeError`` for a wrong type) before anything is sent.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllite.config import ModelConfig
from vllite.engine.pooling import pooling_request
from vllite.engine.request_checks import check_embeds_request, check_prompt_embeds, check_task
from vllite.engine.tokenizer import AnyTokenizer, apply_chat_template
from vllite.lora import LoRAConfig, LoRARequest
from vllite.model_files import load_generation_config
from vllite.pooling_params import PoolingParams
from vllite.protocol import EngineCoreRequest, EngineInfo
from vllite.sampling_params import SamplingParams
from vllite.structured_output.params import StructuredOutputsConfig

# A prompt: text, {"prompt": text}, {"prompt_token_ids": [...]} (optionally with "prompt" and "cache_salt"),
# or a plain list of token ids. The one prompt type of every frontend (LLM, LLMEngine, AsyncLLM).
PromptType = str | Mapping[str, Any] | Sequence[int]


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

    Requests are checked against what the engine reported (``EngineInfo``: context length, vocabulary, EOS
    ids). ``tokenizer`` may be None (``skip_tokenizer_init``): then only token-id prompts are accepted.
    ``generation_config`` defaults to the model folder's ``generation_config.json`` (its EOS ids are added to
    every request's stop ids).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        engine_info: EngineInfo,
        tokenizer: AnyTokenizer | None,
        generation_config: Mapping[str, Any] | None = None,
        *,
        structured_outputs_config: StructuredOutputsConfig | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.lora_config = lora_config
        self.engine_info = engine_info
        self.tokenizer = tokenizer
        if generation_config is None:
            generation_config = load_generation_config(model_config.model)
        self.generation_config_fields: dict[str, Any] = dict(generation_config)
        self.max_model_len = engine_info.max_model_len
        self.vocab_size = engine_info.vocab_size
        self.eos_token_id = self._primary_eos_token_id()
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        if self.structured_outputs_config.backend != "auto":
            from vllite.structured_output.registry import backend_class

            backend_class(self.structured_outputs_config.backend)  # an unknown backend fails at start-up

    def _primary_eos_token_id(self) -> int | None:
        """The tokenizer's EOS id, else the first of generation_config's, else the first the model reports."""
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            return int(self.tokenizer.eos_token_id)
        eos = self.generation_config_fields.get("eos_token_id")
        if isinstance(eos, int):
            return eos
        if isinstance(eos, list) and eos:
            return int(eos[0])
        return self.engine_info.eos_token_ids[0] if self.engine_info.eos_token_ids else None

    # ------------------------------------------------------------------ main entry
    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        resumable: bool = False,
        continuation: bool = False,
    ) -> EngineCoreRequest:
        """Builds the ``EngineCoreRequest`` for one prompt; the caller's ``params`` are never modified.

        ``resumable``: the request is a session; ``continuation``: the prompt is a later input chunk of one, which
        may be empty and whose text is tokenized without special tokens."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        if isinstance(params, PoolingParams):
            arrival = time.time() if arrival_time is None else arrival_time
            return pooling_request(
                self, request_id, prompt, params, arrival_time=arrival, priority=priority, lora_request=lora_request
            )
        check_task("", "generate", self.engine_info)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}.")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}.")
        embeds = self._prompt_embeds(prompt, params, resumable or continuation)
        if embeds is None:
            token_ids, prompt_salt = self._tokenize(prompt, params, add_special_tokens=not continuation)
        else:
            token_ids, prompt_salt = [0] * len(embeds), prompt.get("cache_salt")  # type: ignore[union-attr]
        if cache_salt is None:
            cache_salt = prompt_salt
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}.")
        if embeds is None and (token_ids or not continuation):
            self._validate_prompt(token_ids)
        sampling_params = self._finalize_params(params, len(token_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids if embeds is None else None,
            sampling_params=sampling_params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_request=self._check_lora(lora_request),
            cache_salt=cache_salt,
            priority=priority,
            trace_headers=dict(trace_headers) if trace_headers else None,
            resumable=resumable,
            continuation=continuation,
            prompt_embeds=embeds,
        )

    def _prompt_embeds(self, prompt: PromptType, params: SamplingParams, session: bool) -> Any:
        """The tensor of an embeds prompt (vLLM's ``{"prompt_embeds": tensor}``), checked and on the CPU; ``None``
        for any other prompt. ``ValueError`` naming the problem (not enabled, shape, dtype, hidden size, empty)."""
        if not isinstance(prompt, Mapping) or prompt.get("prompt_embeds") is None:
            return None
        unknown = set(prompt) - {"prompt_embeds", "cache_salt", "type", "arrival_time"}
        if unknown:
            raise ValueError(f"Unknown keys {sorted(unknown)} in an embeds prompt; it takes 'prompt_embeds'.")
        embeds = prompt["prompt_embeds"]
        if getattr(embeds, "ndim", 0) == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]  # [1, num_tokens, hidden_size], as a model's embedding layer returns it
        truncate = params.truncate_prompt_tokens
        if truncate is not None and getattr(embeds, "ndim", 0) == 2:
            embeds = embeds[-(self.max_model_len if truncate == -1 else truncate) :]
        check_prompt_embeds("Invalid prompt:", embeds, self.engine_info)
        check_embeds_request("Invalid prompt:", params, False, session)
        return embeds.detach().cpu().contiguous()

    def _check_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        if self.lora_config is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled: start the engine with "
                "enable_lora=True (--enable-lora)."
            )
        return lora_request

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template (``ValueError``: none)."""
        return apply_chat_template(self.tokenizer, messages, **kwargs)

    # ------------------------------------------------------------------ steps
    def _tokenize(
        self, prompt: PromptType, params: SamplingParams | PoolingParams, *, add_special_tokens: bool = True
    ) -> tuple[list[int], str | None]:
        salt = None
        if isinstance(prompt, str):
            token_ids = self._encode(prompt, add_special_tokens)
        elif isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "type", "arrival_time"}
            if unknown:
                raise ValueError(f"Unknown prompt keys {sorted(unknown)}; use 'prompt' or 'prompt_token_ids'.")
            salt = prompt.get("cache_salt")
            if "prompt_embeds" in prompt:
                raise ValueError("prompt_embeds prompts are supported for generation requests only.")
            if prompt.get("prompt_token_ids") is not None:
                token_ids = _check_token_list(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                token_ids = self._encode(prompt["prompt"], add_special_tokens)
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

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "Text prompts need a tokenizer, but this engine was started without one "
                "(skip_tokenizer_init); pass {'prompt_token_ids': [...]} instead."
            )
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]

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

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """``logprobs`` / ``prompt_logprobs`` within ``max_logprobs`` (-1, the whole vocabulary, only when it is -1)
        and the vocabulary, as vLLM checks them at submit time."""
        max_logprobs = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is None:
                continue
            if name == "logprobs" and params.logprob_token_ids:
                continue  # bounded by MAX_LOGPROB_TOKEN_IDS (and the vocabulary, below) instead, as vLLM does
            if value == -1 and max_logprobs != -1:
                raise ValueError(
                    f"SamplingParams.{name}=-1 (the whole vocabulary) needs max_logprobs=-1; "
                    f"this engine allows at most {max_logprobs} (--max-logprobs)."
                )
            if max_logprobs != -1 and value > max_logprobs:
                raise ValueError(
                    f"Requested SamplingParams.{name}={value}, more than the engine allows: "
                    f"max_logprobs={max_logprobs} (--max-logprobs)."
                )
            if self.vocab_size is not None and value > self.vocab_size:
                raise ValueError(
                    f"Requested SamplingParams.{name}={value}, more than the vocabulary ({self.vocab_size} tokens)."
                )

    def _finalize_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        self._validate_logprobs(params)
        vocab = self.vocab_size
        if vocab is not None:
            for name, ids in (
                ("allowed_token_ids", params.allowed_token_ids),
                ("logit_bias", params.logit_bias),
                ("logprob_token_ids", params.logprob_token_ids),
            ):
                out_of_range = [t for t in (ids or ()) if t >= vocab]
                if out_of_range:
                    raise ValueError(
                        f"SamplingParams.{name} has token ids out of vocabulary (size {vocab}): {out_of_range[:5]}."
                    )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop strings need a tokenizer; this engine has none.")
        sampling_params = params.clone()
        if params.structured_outputs is not None:
            sampling_params.structured_outputs = self._validate_structured_outputs(params)
        max_len = self.max_model_len
        if sampling_params.max_tokens is None and max_len is not None:
            sampling_params.max_tokens = max(1, max_len - prompt_len)
        sampling_params.update_from_generation_config(self.generation_config_fields, self.eos_token_id)
        return sampling_params

    def _validate_structured_outputs(self, params: SamplingParams) -> Any:
        """The request's constraint with the engine's defaults and its backend resolved; ``ValueError`` naming the
        problem (a malformed schema, regex or grammar, a feature the backend lacks, no tokenizer)."""
        from vllite.structured_output.registry import validate_structured_outputs

        assert params.structured_outputs is not None
        if self.tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs a tokenizer; this engine has none.")
        return validate_structured_outputs(params.structured_outputs, self.structured_outputs_config)


def _check_token_list(ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.")
    try:
        if any(isinstance(t, (bool, float)) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids must be a list of integers.") from None
