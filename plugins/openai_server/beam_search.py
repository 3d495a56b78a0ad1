"""``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``: vLLM's frontend beam search over
``AsyncLLM`` (the algorithm is :mod:`vllite.plugins.beam_search.search`, shared with ``LLM.beam_search``).

``n`` is the beam width and the number of choices returned (best first); ``length_penalty``, ``early_stopping``,
``ignore_eos``, ``temperature`` and ``include_stop_str_in_output`` are the other knobs, as vLLM maps them. Each
step submits every live beam of every prompt as a one-token request, concurrently, and waits for all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from vllite.outputs import CompletionOutput, RequestOutput
from vllite.plugins.beam_search.search import BeamSearch, eos_token_ids
from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.errors import check_sample
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.plugins.openai_server.protocol import SamplingFields
from vllite.plugins.openai_server.streams import submit
from vllite.sampling_params import BeamSearchParams


def beam_search_params(request: SamplingFields, ctx: ServerContext, max_tokens: int | None) -> BeamSearchParams:
    """The request's ``BeamSearchParams``; :class:`BadRequestError` naming the field that beam search cannot take."""
    if request.stream:
        raise BadRequestError("use_beam_search does not stream; set stream to false.", param="stream")
    if getattr(request, "structured_outputs", None) is not None or getattr(request, "response_format", None):
        raise BadRequestError("use_beam_search cannot be combined with structured outputs.", param="use_beam_search")
    temperature = request.temperature
    if temperature is None:
        temperature = ctx.model_defaults.get("temperature", 1.0)
    try:
        return BeamSearchParams(
            beam_width=request.n,
            max_tokens=max_tokens or ctx.max_model_len,
            ignore_eos=request.ignore_eos,
            temperature=temperature,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
            early_stopping=request.early_stopping,
        )
    except ValueError as exc:
        raise BadRequestError(str(exc), param=str(exc).split()[0].removeprefix("BeamSearchParams.")) from None


async def run_beam_search(
    ctx: ServerContext,
    request_id: str,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    *,
    prompt_texts: Sequence[str | None] | None = None,
    lora_request: Any = None,
    priority: int = 0,
    data_parallel_rank: int | None = None,
    cache_salt: str | None = None,
) -> list[RequestOutput]:
    """One finished ``RequestOutput`` per prompt whose ``outputs`` are its best sequences (``index`` = rank), with
    their generated text, token ids, cumulative logprob, per-position logprobs and finish reason."""
    engine = ctx.engine
    search = BeamSearch(
        prompts,
        params,
        eos_token_ids(engine.input_processor),
        max_model_len=ctx.max_model_len,
        lora_request=lora_request,
    )
    step_params = search.step_params()
    if ctx.max_logprobs != -1 and search.num_logprobs > ctx.max_logprobs:
        raise BadRequestError(
            f"n={params.beam_width} beams need {search.num_logprobs} logprobs per step, more than the server allows "
            f"(--max-logprobs {ctx.max_logprobs}).",
            param="n",
        )
    for step in itertools.count():
        if search.done:
            break
        beams = search.live_beams()
        submitted = await submit(
            engine,
            f"{request_id}-beam{step}",
            [{"prompt_token_ids": beam.tokens} for beam in beams],
            step_params,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
            lora_request=lora_request,
            cache_salt=cache_salt,
        )
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in submitted.outputs():
                finals[index] = output
        finally:
            await submitted.abort_unfinished()
        step_logprobs = []
        for index in range(len(beams)):
            sample = finals[index].outputs[0]
            check_sample(sample)
            step_logprobs.append(sample.logprobs[0] if sample.logprobs else {})
        search.advance(step_logprobs)
    results: list[RequestOutput] = []
    texts = list(prompt_texts) if prompt_texts is not None else [None] * len(prompts)
    for prompt, text, best in zip(prompts, texts, search.outputs(ctx.tokenizer, whole_text=False)):
        samples = [
            CompletionOutput(
                index=rank,
                text=sequence.text or "",
                token_ids=sequence.tokens[len(prompt) :],
                cumulative_logprob=sequence.cum_logprob,
                logprobs=sequence.logprobs,
                finish_reason=sequence.finish_reason or "length",
                stop_reason=sequence.stop_reason,
            )
            for rank, sequence in enumerate(best.sequences)
        ]
        results.append(RequestOutput(request_id, text, list(prompt), None, samples, finished=True))
    return results
