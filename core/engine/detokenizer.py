"""Incremental detokenization with stop strings, as the output processor runs it once per step and request.

Decoding token by token is wrong for byte-level BPE and SentencePiece: one character may span several tokens,
and a token's leading space depends on its left neighbour. ``IncrementalDetokenizer`` therefore decodes a
small window ``tokens[prefix_offset:]`` and emits only the text beyond what
``tokens[prefix_offset:read_offset]`` already produced, holding back while the text ends in an incomplete
character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllite.protocol import EngineCoreRequest

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


class IncrementalDetokenizer:
    """Tracks a request's output token ids and, with a tokenizer, its text and stop strings.

    Without a tokenizer (``detokenize=False`` or ``skip_tokenizer_init``) only token ids are tracked and the
    text stays empty. Use :meth:`from_new_request` to build one.
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
    ) -> None:
        self.tokenizer = tokenizer
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
        )

    @property
    def output_token_ids(self) -> list[int]:
        """Every generated token id so far (stop tokens included)."""
        return self._tokens[self._num_context :]

    def num_output_tokens(self) -> int:
        return len(self._tokens) - self._num_context

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Adds one step's tokens; returns the stop string that matched, if any (the text is then truncated).

        ``stop_terminated``: the engine stopped on a stop token, which is not decoded into the text unless
        ``include_stop_str_in_output``.
        """
        if self.tokenizer is None:
            self._tokens.extend(new_token_ids)
            return None
        new_token_ids = list(new_token_ids)
        skipped = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
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
        buffer_length = 0 if finished else self.stop_buffer_length
        end = max(0, len(self.output_text) - buffer_length)
        if not delta:
            return self.output_text[:end] if buffer_length else self.output_text
        start = self._last_output_text_offset
        if start < end:
            self._last_output_text_offset = end
            return self.output_text[start:end]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_next(self) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) < len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]
