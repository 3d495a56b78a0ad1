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

    def __init__(self, params: StructuredOutputsParams, backend_name: str, compiled: Future) -> None:
        self.params = params
        self.backend_name = backend_name
        self.compiled = compiled
        self.grammar: StructuredOutputGrammar | None = None

    def is_compiled(self) -> bool:
        """Whether the compilation finished (with a grammar or an error)."""
        return self.compiled.done()

    def make_grammar(self, backend: StructuredOutputBackend) -> StructuredOutputGrammar:
        """This request's matcher (made once); re-raises the compilation's error."""
        if self.grammar is None:
            self.grammar = backend.new_grammar(self.compiled.result())
        return self.grammar
