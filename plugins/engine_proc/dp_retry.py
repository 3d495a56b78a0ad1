"""``--dp-retry``: a dead data-parallel engine's requests continue on a live engine instead of failing.

``RetryLedger`` keeps, per request in flight, the request as it was sent and the tokens its engine has produced
so far (read from the merged stream). When the engine dies, ``continuation()`` builds the request that carries on
where it stopped: the prompt extended by the tokens already delivered, ``max_tokens`` and ``min_tokens`` reduced by
as many, prompt logprobs not asked again once delivered. The frontend keeps the request's id and its state (text,
stop strings, logprobs so far), so the client sees one uninterrupted output; greedy output is the same as had the
engine lived.

Not continued (they fail with the engine, as without ``--dp-retry``): a request that names the dead engine's rank,
and a structured-output request that already has tokens (its grammar state lived in the dead engine). Sampled
requests continue from their tokens with a fresh generator (a seeded request's later tokens differ from an
uninterrupted run), and frequency/presence penalties count the earlier tokens as prompt.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgspec

from vllite.protocol import EngineCoreOutputs, EngineCoreRequest


@dataclass
class _InFlight:
    request: EngineCoreRequest
    generated: list[int] = field(default_factory=list)


class RetryLedger:
    """The requests in flight and their tokens so far; thread-safe (the frontend adds, output threads record)."""

    def __init__(self) -> None:
        self._requests: dict[str, _InFlight] = {}
        self._lock = threading.Lock()

    def add(self, request: EngineCoreRequest) -> None:
        """Tracks a request about to be sent."""
        with self._lock:
            self._requests[request.request_id] = _InFlight(request)

    def forget(self, request_ids: list[str]) -> None:
        """Stops tracking requests (aborted, or never sent)."""
        with self._lock:
            for request_id in request_ids:
                self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._requests

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Records the tokens an engine produced; forgets the requests it finished."""
        with self._lock:
            requests = self._requests
            for output in outputs.outputs:
                entry = requests.get(output.request_id)
                if entry is None:
                    continue
                if output.finish_reason is not None:
                    del requests[output.request_id]
                elif output.new_token_ids:
                    entry.generated.extend(output.new_token_ids)
            for request_id in outputs.finished_requests or ():
                requests.pop(request_id, None)

    def continuation(self, request_id: str) -> EngineCoreRequest | None:
        """The request that carries ``request_id`` on from its tokens so far, or None when it cannot continue
        (unknown, finished, bound to its rank, or a structured-output request under way)."""
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            return None
        request, generated = entry.request, list(entry.generated)
        if request.data_parallel_rank is not None or request.sampling_params is None:
            return None
        params = request.sampling_params
        if (params.extra_args or {}).get("data_parallel_rank") is not None:
            return None
        if not generated:
            return request
        done = len(generated)
        if params.structured_outputs is not None or (params.max_tokens is not None and params.max_tokens <= done):
            return None
        params = msgspec.structs.replace(
            params,
            max_tokens=None if params.max_tokens is None else params.max_tokens - done,
            min_tokens=max(0, params.min_tokens - done),
            prompt_logprobs=None,
        )
        return msgspec.structs.replace(
            request, prompt_token_ids=[*(request.prompt_token_ids or []), *generated], sampling_params=params
        )
