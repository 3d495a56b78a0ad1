"""IncrementalDetokenizer's fast paths give exactly the text of the reference scheme (the tokenizer's own
``decode()`` on every window, token by token): the direct ``tokenizers`` backend decode, and the deferred
decoding of FINAL_ONLY requests, for a byte-level BPE and a SentencePiece-like (Metaspace, byte fallback)
tokenizer, with special tokens skipped or kept, stop tokens and invalid UTF-8."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_support import build_tiny_tokenizer

from vllite.engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import RequestOutputKind, SamplingParams

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld 日本語のテキスト 😀 émojis and ünïcode",
    "stop here STOP there END of text",
] * 4


def _sentencepiece_like():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte_level": build_tiny_tokenizer(CORPUS, vocab_size=320), "sentencepiece": _sentencepiece_like()}


class ReferenceDetokenizer(IncrementalDetokenizer):
    """The scheme as it was: ``tokenizer.decode(..., clean_up_tokenization_spaces=False)`` per window."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )


def _run(detok: IncrementalDetokenizer, steps: list[list[int]], stop_terminated: bool) -> str:
    for i, ids in enumerate(steps):
        detok.update(ids, stop_terminated and i == len(steps) - 1)
    return detok.get_next_output_text(finished=True, delta=False)


@st.composite
def token_steps(draw, vocab_size: int):
    """Either random ids (special tokens, broken UTF-8) or a slice of real text, cut into steps of 1-3."""
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=24))
    else:
        text = draw(st.sampled_from(CORPUS))
        start = draw(st.integers(0, len(text) - 2))
        ids = draw(st.just(text[start:]))  # encoded by the test (needs the tokenizer)
    sizes = draw(st.lists(st.integers(1, 3), min_size=24, max_size=24))
    return ids, sizes


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    context=st.lists(st.integers(0, 300), max_size=7),
    skip_special=st.booleans(),
    stop_terminated=st.booleans(),
)
def test_fast_and_deferred_text_equal_the_reference(name, data, context, skip_special, stop_terminated):
    tok = TOKENIZERS[name]
    ids, sizes = data.draw(token_steps(len(tok)))
    if isinstance(ids, str):
        ids = tok.encode(ids, add_special_tokens=False)[:24]
    steps, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        steps.append(ids[i : i + size])
        i += size
    kwargs = {"skip_special_tokens": skip_special}
    expected = _run(ReferenceDetokenizer(tok, context, **kwargs), steps, stop_terminated)
    assert _run(IncrementalDetokenizer(tok, context, **kwargs), steps, stop_terminated) == expected
    deferred = IncrementalDetokenizer(tok, context, defer=True, **kwargs)
    assert _run(deferred, steps, stop_terminated) == expected
    assert deferred.output_token_ids == ids


def test_backend_decode_is_used_for_fast_tokenizers():
    _, byte_level = make_decode_fn(TOKENIZERS["byte_level"])
    assert byte_level
    _, byte_level = make_decode_fn(TOKENIZERS["sentencepiece"])
    assert not byte_level


def test_deferred_decodes_nothing_until_finished():
    tok = TOKENIZERS["byte_level"]
    calls = []
    detok = IncrementalDetokenizer(tok, [5, 6], defer=True)
    decode = detok._decode_fn
    detok._decode_fn = lambda ids, skip: calls.append(len(ids)) or decode(ids, skip)
    ids = tok.encode("hello world, the quick brown fox", add_special_tokens=False)
    for token in ids:
        detok.update([token], False)
        assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert calls == []
    assert detok.get_next_output_text(finished=True, delta=False) == "hello world, the quick brown fox"
    assert len(calls) == 2  # context + output, and the context alone


def test_from_new_request_defers_only_final_only_without_stop_strings():
    tok = TOKENIZERS["byte_level"]

    def make(**kw):
        return IncrementalDetokenizer.from_new_request(
            tok, EngineCoreRequest("r", [5, 6], SamplingParams(**kw), 2, 0.0)
        )

    assert make(output_kind=RequestOutputKind.FINAL_ONLY).defer
    assert not make(output_kind=RequestOutputKind.FINAL_ONLY, stop=["END"]).defer
    assert not make(output_kind=RequestOutputKind.CUMULATIVE).defer
    assert not make(output_kind=RequestOutputKind.DELTA).defer
    assert not IncrementalDetokenizer(tok, [5], stop=["x"], defer=True).defer
