"""Bad words: a word of ``SamplingParams.bad_words`` never appears as a continuation of the output.

vLLM's semantics: each word is tokenized twice, as written (leading spaces stripped) and with one leading space (the
form it takes inside a sentence, for tokenizers that fold the space into the word's first token); the second form
counts only where it is a different word token of the same length. A word of one token is banned outright; a word
of several is banned at its last token once the output ends with the tokens before it. Only the output is looked at,
not the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllite.exceptions import LogitsProcessorRowsError
from vllite.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllite.sampling_params import SamplingParams

# (token sequences of the request's words, its live output token list), or an error message for the request
BadWordsState = tuple[list[list[int]], Sequence[int]] | str


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """The token sequences ``words`` ban (vLLM's rule: each word as written, and with a leading space when that is
    another first token of the same length)."""
    sequences: list[list[int]] = []
    for word in words:
        bare = [int(t) for t in tokenizer.encode(word.lstrip(), add_special_tokens=False)]
        if not bare:
            continue
        sequences.append(bare)
        spaced = [int(t) for t in tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)]
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


class BadWordsLogitsProcessor(LogitsProcessor):
    """Sets the logit of a bad word's next token to -inf wherever the output ends with the word's other tokens.

    Not argmax-invariant. The words of a request are tokenized once, when it joins the batch, with the engine's
    tokenizer (loaded on first use, so engines whose requests never ask for bad words never load it); the
    per-step check compares the tail of each request's live output list with each word, so its cost is the number
    of bad words in the batch. An engine without a tokenizer (``skip_tokenizer_init``) fails such a request alone.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        model_config = getattr(vllm_config, "model_config", None)
        self._skip_tokenizer = bool(getattr(model_config, "skip_tokenizer_init", False))
        self._tokenizer_path = getattr(model_config, "tokenizer", None) or getattr(model_config, "model", None)
        self._trust_remote_code = bool(getattr(model_config, "trust_remote_code", False))
        self._tokenizer: Any = None
        self._cache: dict[tuple[str, ...], list[list[int]]] = {}
        self.states: dict[int, BadWordsState] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def _word_ids(self, words: Sequence[str]) -> list[list[int]]:
        key = tuple(words)
        if key not in self._cache:
            if self._tokenizer is None:
                from vllite.engine.tokenizer import get_tokenizer

                self._tokenizer = get_tokenizer(str(self._tokenizer_path), trust_remote_code=self._trust_remote_code)
            self._cache[key] = bad_words_token_ids(words, self._tokenizer)
        return self._cache[key]

    def _new_state(
        self, params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]
    ) -> BadWordsState | None:
        words = getattr(params, "bad_words", None)
        if not words:
            return None
        if self._skip_tokenizer or self._tokenizer_path is None:
            return "SamplingParams.bad_words needs a tokenizer; this engine has none (skip_tokenizer_init)."
        return self._word_ids(words), output_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.states, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        rows: list[int] = []
        cols: list[int] = []
        failed: dict[int, str] = {}
        vocab = logits.shape[-1]
        for row, state in self.states.items():
            if isinstance(state, str):
                failed[row] = state
                continue
            sequences, output = state
            for sequence in sequences:
                prefix = len(sequence) - 1
                if prefix > len(output) or sequence[-1] >= vocab:
                    continue
                if prefix == 0 or list(output[len(output) - prefix :]) == sequence[:-1]:
                    rows.append(row)
                    cols.append(sequence[-1])
        if rows:
            index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
            logits.index_put_(index, torch.tensor(-float("inf"), dtype=logits.dtype, device=self.device))
        if failed:
            raise LogitsProcessorRowsError(failed, logits)
        return logits

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        words = getattr(sampling_params, "bad_words", None)
        if words is not None and not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a list of non-blank words, got {words!r}.")
