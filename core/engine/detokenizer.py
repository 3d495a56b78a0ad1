"""Incremental detokenization with stop strings, as the output processor runs it once per step and request.

Decoding token by token is wrong for byte-level BPE and SentencePiece: one character may span several tokens,
and a token's leading space depends on its left neighbour. ``IncrementalDetokenizer`` therefore decodes a
small window ``tokens[prefix_offset:]`` and emits only the text beyond what
``tokens[prefix_offset:read_offset]`` already produced, holding back while the text ends in an incomplete
character (U+FFFD).

The window is decoded by the ``tokenizers`` backend directly when the tokenizer is a plain fast tokenizer (the same
text as ``decode(..., clean_up_tokenization_spaces=False)``, without the Python wrapper's cost per call).

A request that needs no text before it finishes (output kind FINAL_ONLY, no stop strings) is *deferred*: its
tokens are only recorded, and the text is produced once, when it finishes. For a byte-level decoder that is one
``decode()`` of context + output (exactly the incremental text whenever that decodes without U+FFFD, since every
window then starts and ends on a character boundary); otherwise the incremental windows are replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import RequestOutputKind

# Prompt tokens used as left context for the first output token (leading spaces, merged pieces).
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Finds the first stop string that ends in the last ``new_char_count`` characters.

    Returns ``(stop_string, truncate_to)``: the text should be cut to ``output_text[:truncate_to]``, or left
    as is when ``truncate_to == -1``. With ``include_in_output`` the cut falls after the stop string.
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        start = max(0, len(output_text) + 1 - new_char_count - len(stop_str))
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        if include_in_output:
            index += len(stop_str)
            if index >= len(output_text):
                return stop_str, -1
        return stop_str, index
    return None


DecodeFn = Callable[[list[int], bool], str]


def make_decode_fn(tokenizer: Any) -> tuple[DecodeFn, bool]:
    """``(decode(ids, skip_special_tokens), byte_level)`` for ``tokenizer``, without clean-up of spaces.

    A transformers fast tokenizer that does not override decoding is decoded by its ``tokenizers`` backend
    directly; ``byte_level`` is True when that backend's decoder is a plain ``ByteLevel`` decoder (the text is
    the lossy UTF-8 decoding of the tokens' bytes). Any other tokenizer goes through its own ``decode``.
    """
    backend: Any = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer, decoders
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - transformers and tokenizers are dependencies
        pass
    else:
        plain = (
            isinstance(tokenizer, TokenizersBackend)
            and type(tokenizer)._decode is TokenizersBackend._decode
            and type(tokenizer).decode is PreTrainedTokenizerBase.decode
            and isinstance(backend, Tokenizer)
        )
        if plain:
            byte_level = isinstance(backend.decoder, decoders.ByteLevel)
            decode_backend = backend.decode
            return (lambda ids, skip: decode_backend(ids, skip_special_tokens=skip)), byte_level

    def decode(ids: list[int], skip: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    return decode, False


class IncrementalDetokenizer:
    """Tracks a request's output token ids and, with a tokenizer, its text and stop strings.

    Without a tokenizer (``detokenize=False`` or ``skip_tokenizer_init``) only token ids are tracked and the
    text stays empty. With ``defer`` (ignored when there are stop strings) the text is produced only once the request
    finishes (see the module docstring). Use :meth:`from_new_request` to build one.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        stop_buffer_length: int = 0,
        defer: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.defer = defer and tokenizer is not None and not stop  # stop strings need the text every step
        self._decode_fn: DecodeFn | None = None
        self._byte_level = False
        if tokenizer is not None:
            self._decode_fn, self._byte_level = make_decode_fn(tokenizer)
        self._num_undecoded = 0  # deferred: tokens recorded since the text was last brought up to date
        self._skipped_last = False  # the last token is a stop token kept out of the text
        self.stop = list(stop)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.stop_buffer_length = stop_buffer_length
        self.output_text = ""
        self._last_output_text_offset = 0
        context = list(prompt_token_ids or ())[-INITIAL_CONTEXT_TOKENS:]
        self._num_context = len(context)
        self._tokens: list[int] = context  # context + output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)

    @classmethod
    def from_new_request(cls, tokenizer: Any, request: EngineCoreRequest) -> IncrementalDetokenizer:
        """The detokenizer ``request``'s parameters ask for (deferred for FINAL_ONLY without stop strings)."""
        params = request.params
        if tokenizer is None or not params.detokenize:
            return cls(None)
        return cls(
            tokenizer,
            request.prompt_token_ids,
            stop=params.stop or (),
            min_tokens=params.min_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            stop_buffer_length=params.output_text_buffer_length,
            defer=params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop,
        )

    @property
    def output_token_ids(self) -> list[int]:
        """Every generated token id so far (stop tokens included)."""
        return self._tokens[self._num_context :]

    def num_output_tokens(self) -> int:
        """How many tokens were generated so far (stop tokens included)."""
        return len(self._tokens) - self._num_context

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Adds one step's tokens; returns the stop string that matched, if any (the text is then truncated).

        ``stop_terminated``: the engine stopped on a stop token, which is not decoded into the text unless
        ``include_stop_str_in_output``.
        """
        if self.tokenizer is None:
            self._tokens.extend(new_token_ids)
            return None
        skip_stop = stop_terminated and bool(new_token_ids) and not self.include_stop_str_in_output
        if self.defer:
            self._tokens.extend(new_token_ids)
            self._num_undecoded += len(new_token_ids) - skip_stop
            self._skipped_last = skip_stop
            return None
        new_token_ids = list(new_token_ids)
        skipped = None
        if skip_stop:
            skipped = new_token_ids.pop()
        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self._tokens.append(token_id)
            self.output_text += self._decode_next()
            if self.min_tokens and self.num_output_tokens() <= self.min_tokens:
                stop_check_offset = len(self.output_text)  # stop strings may not end inside min_tokens
        if skipped is not None:
            self._tokens.append(skipped)
        if not self.stop or self.num_output_tokens() <= self.min_tokens:
            return None
        found = check_stop_strings(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if found is None:
            return None
        stop_str, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show: all of it, or (``delta``) what is new; a partial stop string is held back."""
        if self.defer:
            if not finished:
                return ""
            self._catch_up()
        buffer_length = 0 if finished else self.stop_buffer_length
        end = max(0, len(self.output_text) - buffer_length)
        if not delta:
            return self.output_text[:end] if buffer_length else self.output_text
        start = self._last_output_text_offset
        if start < end:
            self._last_output_text_offset = end
            return self.output_text[start:end]
        return ""

    def text_so_far(self) -> str:
        """The text of every token recorded so far, for a request ending in an error: a deferred request decodes
        now, keeping the text before a token that fails to decode (the failure itself was reported already)."""
        if self.defer:
            try:
                self._catch_up()
            except Exception:  # the partial text is what is wanted; the error was reported already
                pass
        return self.output_text

    def _decode(self, ids: list[int]) -> str:
        assert self._decode_fn is not None
        return self._decode_fn(ids, self.skip_special_tokens)

    def _catch_up(self) -> None:
        """Deferred: brings ``output_text`` up to date with every recorded token, in one go."""
        if not self._num_undecoded:
            return
        tokens = self._tokens
        end = len(tokens) - self._skipped_last
        start = end - self._num_undecoded
        self._num_undecoded = 0
        if self._byte_level and start == self._num_context:
            try:
                full = self._decode(tokens[:end])
            except Exception:  # decode token by token below: the text before a failing token is kept
                full = _REPLACEMENT_CHAR
            if _REPLACEMENT_CHAR not in full:
                prefix = self._decode(tokens[: self._num_context])
                if full.startswith(prefix):
                    self.output_text = full[len(prefix) :]
                    self._prefix_offset = self._read_offset = end
                    return
        self._tokens = tokens[:start]
        pieces = [self.output_text]
        try:
            for token_id in tokens[start:end]:
                self._tokens.append(token_id)
                pieces.append(self._decode_next())
        finally:  # a token that fails to decode leaves the text decoded before it, as per-step decoding did
            self._tokens = tokens
            self.output_text = "".join(pieces)

    def _decode_next(self) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) < len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]
