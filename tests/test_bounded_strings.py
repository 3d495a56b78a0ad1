"""The chain rewrite of length-bounded JSON strings leaves the language unchanged: along random token paths the
rewritten grammar's matcher allows exactly the tokens the converter's own grammar allows, step by step."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllite.plugins.structured_outputs.bounded_strings import MAX_CHAIN, chain_bounded_strings
from vllite.plugins.structured_outputs.strict_json import strict_json_ebnf

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

VOCAB = 4096
# How the converter writes a string of bounded length (from 2 characters up; shorter ones have no repetition).
BOUNDED_REPETITION = re.compile(r'"\\"" \w+\{\d+, \d+\} "\\""')


@pytest.fixture(scope="module")
def compiler():
    from vllite.engine.tokenizer import get_tokenizer
    from vllite.testing.models import make_tiny_model_dir_cached

    tokenizer = get_tokenizer(make_tiny_model_dir_cached("llama"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def converted(schema: dict) -> str:
    """xgrammar's grammar for ``schema`` as the backend writes it before the chain rewrite."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return strict_json_ebnf(str(grammar))


def allowed_tokens(matcher, bitmask) -> list[int]:
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return [32 * j + b for j, word in enumerate(words) for b in range(32) if (word >> b) & 1 and 32 * j + b < VOCAB]


def assert_same_masks(compiler, reference: str, rewritten: str, seed: int, paths: int = 8, steps: int = 80) -> None:
    """Walks ``paths`` random token paths through both grammars (the same token each step) comparing the masks."""
    ref_grammar, new_grammar = compiler.compile_grammar(reference), compiler.compile_grammar(rewritten)
    bitmask = torch.zeros((1, VOCAB // 32), dtype=torch.int32)
    rng = random.Random(seed)
    for _ in range(paths):
        ref, new = xgr.GrammarMatcher(ref_grammar), xgr.GrammarMatcher(new_grammar)
        for _ in range(steps):
            assert ref.is_terminated() == new.is_terminated()
            if ref.is_terminated():
                break
            allowed = allowed_tokens(ref, bitmask)
            assert allowed_tokens(new, bitmask) == allowed
            token = rng.choice(allowed)
            assert ref.accept_token(token) and new.accept_token(token)


def bounded_string(low: int, high: int) -> dict:
    return {"type": "string", "minLength": low, "maxLength": high}


@settings(max_examples=12, deadline=None)
@given(
    low=st.integers(0, 4),
    extra=st.integers(0, 10),
    tag_max=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
@example(low=2, extra=0, tag_max=0, seed=0)  # a fixed length: written out, no chain
@example(low=0, extra=1, tag_max=1, seed=1)  # at most one character: the converter writes no repetition
@example(low=1, extra=15, tag_max=3, seed=2)  # the benchmark's bounds
def test_bounded_strings_allow_the_same_tokens_at_every_step(compiler, low, extra, tag_max, seed):
    schema = {
        "type": "object",
        "properties": {
            "name": bounded_string(low, low + extra),
            "tags": {"type": "array", "items": {"type": "string", "maxLength": tag_max}, "maxItems": 3},
            "free": {"type": "string"},
        },
        "required": ["name", "tags", "free"],
    }
    reference = converted(schema)
    rewritten = chain_bounded_strings(reference)
    assert not BOUNDED_REPETITION.search(rewritten)  # every bounded string became a chain
    assert_same_masks(compiler, reference, rewritten, seed)


def test_every_bounded_string_up_to_the_limit_is_chained():
    schema = {
        "type": "object",
        "properties": {"a": bounded_string(1, 16), "b": bounded_string(0, 8), "c": bounded_string(3, 3)},
        "required": ["a", "b", "c"],
    }
    reference = converted(schema)
    assert len(BOUNDED_REPETITION.findall(reference)) == 3
    rewritten = chain_bounded_strings(reference)
    assert not BOUNDED_REPETITION.search(rewritten)
    assert rewritten.count("_upto_") > 15 + 7


def test_a_bound_above_the_limit_keeps_the_converters_repetition():
    reference = converted({"type": "string", "maxLength": MAX_CHAIN + 1})
    assert chain_bounded_strings(reference) == reference


def test_chain_names_avoid_rules_the_grammar_already_has(compiler):
    reference = converted({"type": "string", "minLength": 1, "maxLength": 3})
    char_rule = reference.split('"\\"" ')[-1].split("{")[0]
    taken = f'{char_rule}_upto_1 ::= ("x")\n'
    rewritten = chain_bounded_strings(reference + taken)
    assert rewritten.count(f"{char_rule}_upto_1 ::=") == 1 and f"{char_rule}_upto_x_1 ::=" in rewritten
    assert_same_masks(compiler, reference + taken, rewritten, seed=0, paths=4)
