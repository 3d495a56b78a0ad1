"""The grammar-backend contract: a backend compiles constraints into grammars; a grammar is one request's matcher.

A backend plugin registers a :class:`StructuredOutputBackend` subclass through
``vllite_register_structured_output_backends``. The engine core builds one instance per backend at first use, with
the tokenizer and the model's vocabulary size (the logits' width, which may exceed the tokenizer's), and asks it to
:meth:`~StructuredOutputBackend.compile` a :class:`~vllite.structured_output.params.GrammarSpec` for every
constrained request, on a compile thread. The frontend calls the class method
:meth:`~StructuredOutputBackend.validate` at submit time, without a tokenizer, so a bad constraint never reaches the
engine. Compiled grammars are cached by the manager (keyed by backend and spec); ``compile`` returns a fresh
matcher each time (a :class:`StructuredOutputGrammar`).

Bitmasks are ``torch.int32`` tensors ``[rows, ceil(vocab_size / 32)]`` on the CPU; bit ``i`` of word ``j`` set means
token ``32 * j + i`` is allowed.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from vllite.structured_output.params import GrammarSpec


class StructuredOutputGrammar(abc.ABC):
    """One request's grammar state (a matcher over the token vocabulary). Used from one thread at a time."""

    @abc.abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advances the matcher by ``token_ids`` (the request's accepted output tokens). False when a token is not
        allowed; the matcher then stays where the last allowed token left it."""

    @abc.abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of ``token_ids`` the grammar allows from its current state, without advancing it
        (drafts of speculative decoding are cut there)."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Writes the tokens allowed next into row ``index`` of ``bitmask``."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has finished (it accepted its stop token, or nothing can follow)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the start state (no token accepted)."""


class StructuredOutputBackend(abc.ABC):
    """A grammar backend: compiles :class:`GrammarSpec`\\s for one tokenizer and vocabulary.

    ``tokenizer`` is the Hugging Face tokenizer (a fast one), ``vocab_size`` the model's logits width,
    ``eos_token_ids`` the tokens that end a request (the grammar allows them once it is complete).
    """

    #: The kinds of constraint this backend compiles (``GrammarSpec.kind``).
    supported_kinds: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    @abc.abstractmethod
    def validate(cls, spec: GrammarSpec) -> None:
        """Raises ``ValueError`` naming the problem when ``spec`` is malformed (a bad schema, regex or grammar) or
        uses a feature this backend does not support. Needs no tokenizer; called by the frontend at submit."""

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """Compiles ``spec`` into this backend's compiled form (cached by the manager, shared across requests).
        Raises ``ValueError`` on a constraint that cannot compile. Runs on a compile thread."""

    @abc.abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over ``compiled`` (what :meth:`compile` returned), in its start state."""

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fills row ``rows[i]`` of ``bitmask`` for ``grammars[i]`` (this backend's matchers), once per step for the
        batch. Default: one :meth:`StructuredOutputGrammar.fill_bitmask` each; a backend with a batched fill
        overrides it."""
        for grammar, row in zip(grammars, rows, strict=True):
            grammar.fill_bitmask(bitmask, row)
