"""``LLM.beam_search``: the blocking loop over an ``LLM`` (the kernel's method forwards here).

Each step generates one token for every live beam, asking for the top logprobs the search needs, and hands them
to :class:`~vllite.plugins.beam_search.search.BeamSearch` until it is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllite.exceptions import RequestFailedError
from vllite.plugins.beam_search.search import BeamSearch, eos_token_ids

if TYPE_CHECKING:
    from vllite.engine.input_processor import PromptType
    from vllite.engine.llm import LLM
    from vllite.lora import LoRARequest
    from vllite.outputs import BeamSearchOutput, RequestOutput
    from vllite.sampling_params import BeamSearchParams


def beam_search(
    llm: LLM, prompts: Sequence[PromptType], params: BeamSearchParams, *, lora_request: LoRARequest | None = None
) -> list[BeamSearchOutput]:
    """One ``BeamSearchOutput`` per prompt (see ``LLM.beam_search``): a loop of one-token ``llm.generate`` calls,
    one request per live beam per step."""
    token_prompts = [prompt_token_ids(llm, prompt) for prompt in prompts]
    search = BeamSearch(
        token_prompts,
        params,
        eos_token_ids(llm.llm_engine.input_processor),
        max_model_len=llm.model_config.max_model_len,
        lora_request=lora_request,
    )
    step = search.step_params()
    while not search.done:
        beams = search.live_beams()
        outputs = llm.generate(
            [{"prompt_token_ids": beam.tokens} for beam in beams], step, use_tqdm=False, lora_request=lora_request
        )
        search.advance([_first_logprobs(output) for output in outputs])
    return search.outputs(llm.get_tokenizer(), whole_text=True)


def prompt_token_ids(llm: LLM, prompt: PromptType) -> list[int]:
    """A prompt's token ids: a text tokenized as the engine tokenizes it, ``{"prompt_token_ids": ...}`` or a list
    of ids as given."""
    if isinstance(prompt, dict) and prompt.get("prompt_token_ids") is not None:
        return [int(t) for t in prompt["prompt_token_ids"]]
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if isinstance(text, str):
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("Text prompts need a tokenizer; this engine has none (skip_tokenizer_init).")
        return [int(t) for t in tokenizer.encode(text)]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise TypeError(f"A beam-search prompt must be a text, a list of token ids or a dict; got {prompt!r}.")


def _first_logprobs(output: RequestOutput) -> dict[int, Any]:
    """The top logprobs of a one-token beam-search step (empty when the engine generated nothing)."""
    sample = output.outputs[0]
    if sample.finish_reason == "error":
        raise RequestFailedError(f"A beam-search step failed in the engine: {sample.error}")
    return sample.logprobs[0] if sample.logprobs else {}
