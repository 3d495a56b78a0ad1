"""``bad_words``: the builtin logits processor (vLLM's tokenization rule and its per-step ban) and the offline API,
``LLM.generate(..., SamplingParams(bad_words=[...]))``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllite import LLM, SamplingParams
from vllite.assets import default_model_path
from vllite.builtin_logitsprocs.bad_words import BadWordsLogitsProcessor, bad_words_token_ids
from vllite.engine.tokenizer import get_tokenizer
from vllite.logits_processor import BatchUpdate

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(default_model_path())


def test_a_word_is_banned_as_written_and_with_a_leading_space(tokenizer):
    bare = tokenizer.encode("time", add_special_tokens=False)
    spaced = tokenizer.encode(" time", add_special_tokens=False)
    expected = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
    assert bad_words_token_ids(["  time"], tokenizer) == expected
    assert bad_words_token_ids([], tokenizer) == []


def processor(config_tokenizer: str | None = None, skip: bool = False) -> BadWordsLogitsProcessor:
    model_config = SimpleNamespace(
        tokenizer=config_tokenizer or str(default_model_path()), model=None, skip_tokenizer_init=skip
    )
    return BadWordsLogitsProcessor(SimpleNamespace(model_config=model_config), torch.device("cpu"), False)


def test_the_last_token_is_banned_only_after_the_rest_of_the_word(tokenizer):
    proc = processor()
    [sequence, *_] = bad_words_token_ids(["upon a time"], tokenizer)
    assert len(sequence) > 1
    output: list[int] = []
    params = SamplingParams(bad_words=["upon a time"])
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[(1, params, [1], output)], moved=[]))
    vocab = len(tokenizer)
    logits = proc.apply(torch.zeros(2, vocab))
    assert math.isinf(logits[1, sequence[0]]) == (len(sequence) == 1)  # a one-token word only
    output.extend(sequence[:-1])  # the live output list now ends with the word's first tokens
    logits = proc.apply(torch.zeros(2, vocab))
    assert logits[1, sequence[-1]] == -math.inf
    assert torch.isfinite(logits[0]).all()  # another request's row is untouched
    assert int(torch.isinf(logits[1]).sum()) <= len(bad_words_token_ids(["upon a time"], tokenizer))
    output.append(7)
    assert torch.isfinite(proc.apply(torch.zeros(2, vocab))[1]).all()


def test_an_engine_without_a_tokenizer_fails_only_that_request():
    from vllite.exceptions import LogitsProcessorRowsError

    proc = processor(skip=True)
    params = SamplingParams(bad_words=["x"])
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [1], [])], moved=[]))
    with pytest.raises(LogitsProcessorRowsError) as info:
        proc.apply(torch.zeros(1, 8))
    assert list(info.value.rows) == [0] and "tokenizer" in info.value.rows[0]


@pytest.mark.parametrize("words", [["ok", ""], "word", [3]])
def test_bad_words_must_be_words(words):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=words)


def test_llm_generate_never_emits_a_bad_word(tokenizer):
    with LLM(str(default_model_path()), max_model_len=256) as llm:
        greedy = SamplingParams(max_tokens=16, temperature=0)
        [plain] = llm.generate([PROMPT], greedy, use_tqdm=False)
        words = plain.outputs[0].text.split()[:2]
        assert words
        banned = SamplingParams(max_tokens=16, temperature=0, bad_words=words)
        [out] = llm.generate([PROMPT], banned, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert tokens != plain.outputs[0].token_ids
    for sequence in bad_words_token_ids(words, tokenizer):
        n = len(sequence)
        assert all(tokens[i : i + n] != sequence for i in range(len(tokens) - n + 1)), (words, sequence, tokens)
