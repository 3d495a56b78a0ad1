"""``StructuredOutputRequest``: a constrained request's grammar, compiled asynchronously, and its matcher."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Future

    from vllite.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
    from vllite.structured_output.params import StructuredOutputsParams


class StructuredOutputRequest:
    """The grammar side of one request (``Request.structured_output_request``).

    ``compiled`` completes on a compile thread with the backend's compiled grammar (shared through the cache);
    ``grammar`` is this request's own matcher, made on the engine thread once the compilation is in
    (:meth:`make_grammar`), and advanced by ``update_from_output`` with every accepted token.
    """

    def __init__(
        self,
        params: StructuredOutputsParams,
        backend_name: str,
        compiled: Future,
        reasoning_end: list[int] | None = None,
    ) -> None:
        self.params = params
        self.backend_name = backend_name
        self.compiled = compiled
        self.grammar: StructuredOutputGrammar | None = None
        # While set, the reply is still reasoning: the grammar starts after these token ids (vLLM's reasoning-aware
        # structured outputs); cleared once they were generated.
        self.reasoning_end = list(reasoning_end or [])
        self._recent: list[int] = []

    def is_compiled(self) -> bool:
        """Whether the compilation finished (with a grammar or an error)."""
        return self.compiled.done()

    def tokens_after_reasoning(self, token_ids: list[int]) -> list[int]:
        """The accepted ``token_ids`` the grammar must take: all of them once the reasoning ended, else those after
        its end marker (none while it goes on)."""
        if not self.reasoning_end:
            return token_ids
        marker = self.reasoning_end
        for index, token_id in enumerate(token_ids):
            self._recent = [*self._recent[1 - len(marker) :], token_id] if len(marker) > 1 else [token_id]
            if self._recent == marker:
                self.reasoning_end = []
                return list(token_ids[index + 1 :])
        return []

    def make_grammar(self, backend: StructuredOutputBackend) -> StructuredOutputGrammar:
        """This request's matcher (made once); re-raises the compilation's error."""
        if self.grammar is None:
            self.grammar = backend.new_grammar(self.compiled.result())
        return self.grammar
