"""``LLM``: the offline user API (vLLM-compatible): ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from vllite.engine.input_processor import PromptType
from vllite.engine.llm_pooling import LLMPoolingAPI
from vllite.engine_args import EngineArgs
from vllite.lora import LoRARequest
from vllite.lora.request import lora_per_prompt
from vllite.outputs import BeamSearchOutput, RequestOutput
from vllite.pooling_params import PoolingParams
from vllite.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM(LLMPoolingAPI):
    """An engine for offline batched generation, or, for a pooling model, embeddings, classes and scores
    (:class:`~vllite.engine.llm_pooling.LLMPoolingAPI`).

    ``model`` is a local model folder or Hub id (default: the embedded demo model). Other keyword arguments are
    ``EngineArgs`` fields (``max_model_len``, ``scheduler_cls``, ``runner``, ``enable_prefix_caching``, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        logits_processors: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        engine_args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            logits_processors=logits_processors,
            **kwargs,
        )
        self._init_engine(engine_args)

    def _init_engine(self, engine_args: EngineArgs) -> None:
        from vllite.engine.llm_engine import LLMEngine

        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.model_config = self.llm_engine.config.model_config
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._init_engine(engine_args)
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation-config defaults (``--generation-config``), used when no params are given."""
        return self.llm_engine.frontend.default_sampling_params()

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt and returns the finished outputs in input order.

        A request that fails alone — in the engine (a plugin raised while serving it) or here (its detokenizer,
        stop strings or logprobs raised) — does not fail the call: its output comes back in its place, finished,
        with ``outputs[i].finish_reason == "error"`` and the cause in ``outputs[i].error``, and the other results
        are returned as usual. Only an engine that dies (``EngineDeadError``) or is shut down fails the call.
        ``lora_request``: one adapter for every prompt, or one (or ``None``) per prompt (``enable_lora=True``).
        """
        # A single prompt (text, a dict, or a list of token ids) or a sequence of them.
        batch: list[PromptType]
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            batch = [cast("PromptType", prompts)]
        else:
            batch = list(cast("Sequence[PromptType]", prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(batch)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise ValueError(
                    f"Got {len(params_list)} SamplingParams for {len(batch)} prompts; give one, or one per prompt."
                )
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"Got {len(priority)} priorities for {len(batch)} prompts.")
        loras = lora_per_prompt(lora_request, len(batch))
        self._add_requests(batch, params_list, priority, loras)
        return self._run_engine(use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's API): a loop of one-token engine requests, one per live beam per
        step (the ``beam_search`` plugin, :mod:`vllite.plugins.beam_search`). Returns one ``BeamSearchOutput`` per
        prompt, its ``sequences`` best first, each with ``tokens`` (prompt and generated), ``cum_logprob``,
        ``logprobs`` and ``text`` (the whole sequence decoded). ``use_tqdm`` is accepted for vLLM's signature; there
        is no progress bar."""
        from vllite.plugins.beam_search.offline import beam_search

        return beam_search(self, prompts, params, lora_request=lora_request)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, through the tokenizer's chat template (or
        ``chat_template``, a Jinja template string, when given)."""
        # One conversation (a list of message dicts) or a list of conversations.
        conversations = cast(
            "list[list[dict[str, str]]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        prompts: list[PromptType] = []
        for conversation in conversations:
            token_ids = self.llm_engine.input_processor.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _add_requests(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams | PoolingParams],
        priority: list[int] | None,
        loras: list[LoRARequest | None],
    ) -> None:
        added: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                if isinstance(params, SamplingParams) and params.output_kind != RequestOutputKind.FINAL_ONLY:
                    # Offline generation only needs the final result (and n > 1 samples come back together).
                    params = params.clone()
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self._counter))
                added.append(request_id)  # first: a Ctrl-C inside add_request may leave it half-added
                self.llm_engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority else 0, lora_request=loras[i]
                )
        except BaseException:
            # One bad prompt (or Ctrl-C) fails the call, but leaves nothing half-submitted behind.
            if added:
                self.llm_engine.abort_request(added)
            raise

    def _run_engine(self, *, use_tqdm: bool) -> list[RequestOutput]:
        total = self.llm_engine.get_num_unfinished_requests()
        progress = None
        if use_tqdm and total:
            from tqdm.auto import tqdm

            progress = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        finished: list[RequestOutput] = []
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished.append(output)
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            # A failed step (or Ctrl-C) must not leave orphaned requests behind in a reusable engine.
            from vllite.exceptions import EngineClientClosedError, EngineDeadError

            if not isinstance(sys.exc_info()[1], (EngineDeadError, EngineClientClosedError)):
                self.llm_engine.abort_all_requests()
            raise
        finally:
            if progress is not None:
                progress.close()
        return sorted(finished, key=lambda out: int(out.request_id))

    # ------------------------------------------------------------------ utilities
    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter ahead of use (requests naming one load it too); False when already loaded."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps an adapter loaded (never evicted from the host cache)."""
        return self.llm_engine.pin_lora(lora_id)

    def sleep(self, level: int = 1) -> None:
        """Frees memory between uses (level 1: offload the weights, discard the KV cache; level 2: discard both).
        Needs ``LLM(..., enable_sleep_mode=True)``, as in vLLM; without it this raises ``ValueError``."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Starts ``torch.profiler`` in the engine; set ``VLLITE_TORCH_PROFILER_DIR`` (or vLLM's
        ``VLLM_TORCH_PROFILER_DIR``) to the trace directory first."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stops the profiler and writes the trace."""
        self.llm_engine.stop_profile()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Runs ``method`` on every worker and returns the results in order (vLLM's ``LLM.collective_rpc``): the name
        of a worker method, or a callable ``fn(worker, *args, **kwargs)`` when the engine runs in this process
        (``VLLITE_ENABLE_MULTIPROCESSING=0``; nothing is pickled to the engine process)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def shutdown(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
