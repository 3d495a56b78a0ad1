"""``ParentRequest``: fans a request with ``n > 1`` out into ``n`` children and gathers their outputs."""

from __future__ import annotations

from vllite.outputs import CompletionOutput
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """The parent of ``n`` child requests ``f"{engine_id}-{i}"``, each sampling one sequence.

    Child ``i`` gets ``n=1`` and, when the parent has a seed, ``seed + i`` (otherwise all children share one
    params object). Under FINAL_ONLY the children's final outputs are gathered and returned together, ordered
    by index, once the last child finishes; otherwise each child's output is passed on as it comes.
    """

    def __init__(self, request: EngineCoreRequest, external_req_id: str) -> None:
        self.request_id = request.request_id  # the parent's engine id; only its children reach the engine
        self.external_req_id = external_req_id
        self.sampling_params = request.params
        self.n = self.sampling_params.n
        self.child_requests: set[str] = set()
        self.final_only = self.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        self.output_aggregator: list[CompletionOutput | None] = [None] * self.n if self.final_only else []
        self._shared_child_params: SamplingParams | None = None

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id and sampling params of child ``index``; registers the child as pending."""
        if not 0 <= index < self.n:
            raise IndexError(f"Child index {index} out of range for n={self.n}.")
        child_id = f"{self.request_id}-{index}"
        self.child_requests.add(child_id)
        return child_id, self._child_params(index)

    def _child_params(self, index: int) -> SamplingParams:
        seed = self.sampling_params.seed
        if seed is None:
            if self._shared_child_params is None:
                self._shared_child_params = self.sampling_params.clone()
                self._shared_child_params.n = 1
            return self._shared_child_params
        params = self.sampling_params.clone()
        params.n = 1
        params.seed = seed + index
        return params

    def get_outputs(self, child_request_id: str, output: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """What to emit for one child output, and whether the parent is now finished."""
        already_returned = False
        if output.finished():
            if child_request_id in self.child_requests:
                self.child_requests.remove(child_request_id)
            else:
                already_returned = True
        if already_returned:
            outputs = []
        elif self.final_only:
            self.output_aggregator[output.index] = output
            outputs = [] if self.child_requests else [o for o in self.output_aggregator if o is not None]
        else:
            outputs = [output]
        return outputs, not self.child_requests
