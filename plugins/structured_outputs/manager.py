"""``StructuredOutputManager``: the engine core's side of structured outputs, the builtin implementation of
:class:`vllite.structured_output.manager.StructuredOutputManagerInterface` (resolved by class path at engine start).

- :meth:`grammar_init`, when a request is added: its constraint compiles on a thread pool (through a compiled-grammar
  cache keyed by backend and constraint) while the request waits in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, which
  admission skips without holding up the requests behind it;
- :meth:`update_waiting`, before each schedule: compiled requests become ``WAITING`` with their own matcher; a
  request whose constraint failed to compile ends alone with ERROR and the compiler's message;
- :meth:`start_grammar_bitmask`, after each schedule: the step's bitmask for the constrained requests that sample,
  filled on a worker thread while the model runs on an accelerator (the executor waits for it right before
  sampling), or right away on the CPU, where the forward pass keeps every core busy and a thread beside it only
  slows it down (256 requests on 2 cores: 13% overhead filled in place, 17% on the thread);
- the scheduler advances each matcher with the accepted tokens and cuts drafts the grammar refuses itself, through
  the kernel's ``advance_grammar`` / ``filter_drafts`` (:mod:`vllite.structured_output.manager`).

Backends (and the tokenizer they need) are built at first use, on a compile thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from vllite.exceptions import PluginHookError
from vllite.request import Request, RequestStatus
from vllite.structured_output.bitmask import GrammarOutput
from vllite.structured_output.manager import REASONING_END_KEY, StructuredOutputManagerInterface
from vllite.structured_output.params import StructuredOutputsConfig
from vllite.structured_output.registry import backend_class, candidate_backends
from vllite.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from vllite.config import EngineConfig
    from vllite.sched.output import SchedulerOutput
    from vllite.structured_output.backend import StructuredOutputBackend
    from vllite.structured_output.params import GrammarSpec

logger = logging.getLogger(__name__)


class StructuredOutputManager(StructuredOutputManagerInterface):
    """Compiles constrained requests' grammars and builds each step's bitmask (see the module docstring)."""

    def __init__(self, config: EngineConfig, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.config = config
        self.so_config = StructuredOutputsConfig.resolve(getattr(config, "structured_outputs_config", None))
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._cache: OrderedDict[tuple[str, GrammarSpec], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compile_pool: ThreadPoolExecutor | None = None
        self._fill_pool: ThreadPoolExecutor | None = None
        # Requests whose grammar is compiling (req_id -> request), in arrival order.
        self.compiling: dict[str, Request] = {}
        self.used = False  # a constrained request was ever added (else the per-step work is skipped)
        # Fill while the model runs only where it runs elsewhere than on the CPU cores (see the module docstring).
        self.fill_during_forward = config.device_config.device_type != "cpu"

    # ------------------------------------------------------------------ backends
    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from vllite.engine.tokenizer import get_tokenizer

            model_config = self.config.model_config
            path = model_config.tokenizer or model_config.model
            assert path is not None
            self._tokenizer = get_tokenizer(path, trust_remote_code=model_config.trust_remote_code)
        return self._tokenizer

    def backend(self, name: str) -> StructuredOutputBackend:
        """The backend ``name``, built at first use (thread-safe)."""
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                eos = self.eos_token_ids
                tokenizer = self._load_tokenizer()
                if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
                    eos = [int(tokenizer.eos_token_id)]
                backend = self._backends[name] = backend_class(name)(tokenizer, self.vocab_size, eos)
            return backend

    def _compile(self, name: str, spec: GrammarSpec) -> Any:
        return self.backend(name).compile(spec)

    def compiled_grammar(self, name: str, spec: GrammarSpec) -> Future:
        """The (cached) compilation of ``spec`` by backend ``name``; a failed one leaves the cache."""
        key = (name, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._compile_pool is None:
                self._compile_pool = ThreadPoolExecutor(
                    self.so_config.compile_threads, thread_name_prefix="vllite-grammar"
                )
            future = self._compile_pool.submit(self._compile, name, spec)
            self._cache[key] = future
            while len(self._cache) > self.so_config.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        return future

    def _forget_failed(self, key: tuple[str, GrammarSpec], future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    # ------------------------------------------------------------------ requests
    def grammar_init(self, request: Request) -> None:
        """Starts compiling a constrained request's grammar; it waits in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``
        until :meth:`update_waiting` sees the compilation done. Unconstrained requests are left alone."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self.used = True
        if params.disable_any_whitespace is None:  # not through the frontend: fill the engine's defaults
            params = params.with_defaults(self.so_config)
        name = params.backend or candidate_backends(params, self.so_config)[0]
        future = self.compiled_grammar(name, params.spec())
        end = (request.sampling_params.extra_args or {}).get(REASONING_END_KEY)
        request.structured_output_request = StructuredOutputRequest(params, name, future, end)
        request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.compiling[request.request_id] = request

    def update_waiting(self, scheduler: Any) -> None:
        """Before a schedule: compiled requests become ``WAITING`` (with their matcher); failed ones end with ERROR
        and the compiler's message; aborted ones are forgotten."""
        if not self.compiling:
            return
        if not scheduler.running and len(self.compiling) >= len(scheduler.waiting):
            # Nothing can run until a grammar is in: wait for one instead of spinning (bounded, so new requests
            # and aborts are still seen).
            pending = [
                r.structured_output_request.compiled for r in self.compiling.values() if r.structured_output_request
            ]
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
        for req_id, request in list(self.compiling.items()):
            so_request = request.structured_output_request
            if request.is_finished() or so_request is None or scheduler.requests.get(req_id) is not request:
                del self.compiling[req_id]  # aborted, or rejected before it was queued
                continue
            if not so_request.is_compiled():
                continue
            del self.compiling[req_id]
            try:
                so_request.make_grammar(self.backend(so_request.backend_name))
            except Exception as exc:
                message = (
                    f"The {so_request.params.kind} constraint of request {req_id!r} failed to compile with the "
                    f"{so_request.backend_name} backend: {exc}"
                )
                if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                    scheduler.waiting.remove_requests([request])
                    scheduler.fail_request(request, message)
                continue
            if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                request.status = RequestStatus.WAITING

    # ------------------------------------------------------------------ per step
    def start_grammar_bitmask(self, scheduler: Any, scheduler_output: SchedulerOutput) -> None:
        """Sets ``scheduler_output.grammar_output``: ``None`` when no constrained request samples this step, else
        the step's :class:`GrammarOutput`, or a future of it filled on a worker thread while the model runs
        (``fill_during_forward``)."""
        scheduler_output.grammar_output = None
        if not self.used:
            return
        requests = scheduler.requests
        chosen: list[tuple[str, StructuredOutputRequest, list[int]]] = []
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.structured_output_request is None or request.is_prefill_chunk:
                continue
            if (
                request.structured_output_request.grammar is not None
                and not request.structured_output_request.reasoning_end
            ):
                chosen.append((req_id, request.structured_output_request, spec_tokens.get(req_id) or []))
        if not chosen:
            return
        if not self.fill_during_forward:
            scheduler_output.grammar_output = self._fill(chosen)
            return
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="vllite-bitmask")
        scheduler_output.grammar_output = self._fill_pool.submit(self._fill, chosen)

    def _fill(self, chosen: list[tuple[str, StructuredOutputRequest, list[int]]]) -> GrammarOutput:
        import torch

        num_rows = sum(1 + len(drafts) for _, _, drafts in chosen)
        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        req_id_to_row: dict[str, int] = {}
        failed: dict[str, str] = {}
        # Requests without drafts: one batched fill per backend; with drafts: a row per draft position.
        batches: dict[str, tuple[list[Any], list[int], list[str]]] = {}
        row = 0
        for req_id, so_request, drafts in chosen:
            req_id_to_row[req_id] = row
            if drafts:
                try:
                    fill_rows(so_request.grammar, drafts, bitmask, row)
                except Exception as exc:
                    failed[req_id] = str(PluginHookError(so_request.grammar, "fill_bitmask", exc))
            else:
                grammars, rows, req_ids = batches.setdefault(so_request.backend_name, ([], [], []))
                grammars.append(so_request.grammar)
                rows.append(row)
                req_ids.append(req_id)
            row += 1 + len(drafts)
        for name, (grammars, rows, req_ids) in batches.items():
            try:
                self.backend(name).fill_bitmasks(grammars, bitmask, rows)
            except Exception:  # find the grammars that fail: only their requests end
                failed.update(fill_one_by_one(grammars, bitmask, rows, req_ids))
        for req_id in failed:
            bitmask[req_id_to_row[req_id]] = -1  # its token is discarded: the request ends with ERROR
        if failed:
            logger.error("Filling the grammar bitmask failed: %s", "; ".join(failed.values()))
        return GrammarOutput([req_id for req_id, _, _ in chosen], bitmask, req_id_to_row, failed)

    def shutdown(self) -> None:
        """Stops the compile and fill threads and releases the backends."""
        for pool in (self._compile_pool, self._fill_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool = self._fill_pool = None
        self._backends.clear()


def fill_one_by_one(grammars: list[Any], bitmask: Any, rows: list[int], req_ids: list[str]) -> dict[str, str]:
    """Fills each row alone (after a batched fill raised); request id -> message for each grammar that raises."""
    failed: dict[str, str] = {}
    for grammar, row, req_id in zip(grammars, rows, req_ids, strict=True):
        try:
            grammar.fill_bitmask(bitmask, row)
        except Exception as exc:
            failed[req_id] = str(PluginHookError(grammar, "fill_bitmask", exc))
    return failed


def fill_rows(grammar: Any, drafts: list[int], bitmask: Any, row: int) -> None:
    """Rows ``row .. row + len(drafts)``: the tokens allowed now and after each draft (the matcher takes the drafts
    and gives them back). Rows after a draft the grammar refuses stay all-allowed: verification stops there."""
    grammar.fill_bitmask(bitmask, row)
    accepted = 0
    for k, token_id in enumerate(drafts, 1):
        if grammar.is_terminated() or not grammar.accept_tokens([token_id]):
            break
        accepted += 1
        grammar.fill_bitmask(bitmask, row + k)
    grammar.rollback(accepted)
