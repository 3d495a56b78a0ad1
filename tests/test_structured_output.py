"""Structured outputs without an engine: the request field, the config, submit-time validation (20 bad constraints,
each a ValueError naming the problem), the plugin registry, the backends' matchers and the strict-JSON rewrite."""

from __future__ import annotations

import json

import msgspec
import pytest

from vllite.plugins.structured_outputs.strict_json import strict_json_ebnf
from vllite.sampling_params import SamplingParams
from vllite.structured_output import StructuredOutputsConfig, StructuredOutputsParams
from vllite.structured_output.registry import validate_structured_outputs

P = StructuredOutputsParams
AUTO = StructuredOutputsConfig()
XGR = StructuredOutputsConfig(backend="xgrammar")
GUIDANCE = StructuredOutputsConfig(backend="guidance")

#: (id, constructor kwargs or a callable building the params, config, a regex the ValueError must match).
BAD_CASES = [
    ("no-constraint", dict(), AUTO, "exactly one constraint"),
    ("two-constraints", dict(regex="a+", choice=["a"]), AUTO, "exactly one constraint, got 2: regex, choice"),
    ("empty-choice", dict(choice=[]), AUTO, "choice must be a non-empty list"),
    ("choice-not-strings", dict(choice=["a", 3]), AUTO, "choice must hold non-empty strings"),
    ("empty-regex", dict(regex="  "), AUTO, "regex must not be empty"),
    ("bad-regex", dict(regex="[a-"), AUTO, "regex is invalid"),
    ("bad-regex-range", dict(regex="a{3,2}"), AUTO, "regex is invalid"),
    ("schema-not-json", dict(json="{not json"), AUTO, "json is not valid JSON"),
    ("schema-bad-type", dict(json={"type": "foo"}), AUTO, "(?i)type"),
    ("schema-bad-ref", dict(json={"$ref": "#/defs/missing"}), AUTO, "defs"),
    ("schema-bad-pattern", dict(json={"type": "string", "pattern": "[a-"}), AUTO, "(?i)regex|unclosed"),
    ("schema-not-object", dict(json="[1, 2]"), GUIDANCE, "must be a JSON object"),
    ("unsupported-by-xgrammar", dict(json={"type": "array", "contains": {"type": "integer"}}), XGR, "contains"),
    ("unsupported-by-both", dict(json={"type": "array", "uniqueItems": True}), AUTO, "uniqueItems"),
    ("grammar-undefined-rule", dict(grammar="root ::= foo"), AUTO, "foo"),
    ("grammar-syntax", dict(grammar='root ::= "a" ('), AUTO, "(?i)expect|error"),
    ("lark-for-xgrammar", dict(grammar='start: "a" | "b"'), XGR, "grammar is invalid for the xgrammar backend"),
    (
        "structural-tag-for-guidance",
        dict(structural_tag='{"structures": [], "triggers": []}'),
        GUIDANCE,
        "guidance backend does not support structured_outputs.structural_tag",
    ),
    ("structural-tag-malformed", dict(structural_tag='{"structures": 1}'), XGR, "structural_tag must be JSON like"),
    ("unknown-backend", dict(regex="a", backend="nope"), AUTO, "Unknown structured-output backend 'nope'"),
]


def _build(kwargs: dict) -> StructuredOutputsParams:
    return P(**kwargs)


@pytest.mark.parametrize(("case", "kwargs", "config", "match"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_constraints_are_value_errors_naming_the_problem(case, kwargs, config, match):
    with pytest.raises(ValueError, match=match):
        validate_structured_outputs(_build(kwargs), config)


def test_twenty_bad_cases():
    assert len(BAD_CASES) == 20


def test_good_constraints_resolve_a_backend_and_the_engine_defaults():
    config = StructuredOutputsConfig(disable_any_whitespace=True)
    params = validate_structured_outputs(P(json={"type": "object"}), config)
    assert params.backend == "xgrammar" and params.disable_any_whitespace is True
    # auto falls back where xgrammar refuses (a keyword it would ignore, or Lark syntax).
    assert validate_structured_outputs(P(json={"type": "object", "minProperties": 1}), AUTO).backend == "guidance"
    assert validate_structured_outputs(P(grammar='start: "a" | "b"'), AUTO).backend == "guidance"
    assert (
        validate_structured_outputs(P(regex="a+", disable_any_whitespace=False), config).disable_any_whitespace is False
    )
    assert validate_structured_outputs(P(choice=["x"]), GUIDANCE).backend == "guidance"


def test_params_travel_on_the_wire_with_sampling_params():
    params = SamplingParams(structured_outputs=P(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.structured_outputs == params.structured_outputs
    assert params.clone().structured_outputs == params.structured_outputs
    assert params.clone().structured_outputs is not params.structured_outputs


def test_spec_is_the_cache_key():
    a = P(json={"b": 1, "a": 2}).spec()
    assert a == P(json={"b": 1, "a": 2}).spec()
    assert a != P(json={"a": 2, "b": 1}).spec()  # the property order is the output's
    assert a != P(json={"b": 1, "a": 2}, disable_any_whitespace=True).spec()
    assert P(choice=["x", "y"]).spec().text == json.dumps(["x", "y"])


def test_config_resolves_from_json_and_names_bad_fields():
    assert StructuredOutputsConfig.resolve('{"backend": "guidance"}').backend == "guidance"
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsConfig.resolve({"bakend": "x"})
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        StructuredOutputsConfig.resolve({"disable_any_whitespace": "yes"})


def test_engine_args_and_cli_carry_the_config():
    import argparse

    from vllite.engine_args import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.structured_outputs_config == StructuredOutputsConfig("guidance", disable_any_whitespace=True)


def test_backends_are_registered_plugins():
    from vllite.plugin_manager import get_registry
    from vllite.plugins.structured_outputs.guidance_backend import GuidanceBackend
    from vllite.plugins.structured_outputs.xgrammar_backend import XgrammarBackend

    registry = get_registry("structured_output_backends")
    assert registry["xgrammar"] is XgrammarBackend and registry["guidance"] is GuidanceBackend


def test_strict_json_rewrite_excludes_control_characters_and_surrogates(tokenizer):
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096)
    prefix = tokenizer.encode('{"s": "', add_special_tokens=False)
    tab = tokenizer.convert_tokens_to_ids("\u0109")  # the byte-level token of a raw tab (0x09)
    surrogate = tokenizer.convert_tokens_to_ids(["\u00ed", "\u00be"])  # bytes ED BE: a UTF-16 surrogate's UTF-8
    for text, allowed in ((ebnf, True), (strict_json_ebnf(ebnf), False)):
        for tail in ([tab], surrogate):
            matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(text))
            assert all(matcher.accept_token(t) for t in prefix)
            assert all(matcher.accept_token(t) for t in tail) is allowed


@pytest.fixture(scope="module")
def tokenizer():
    from vllite.engine.tokenizer import get_tokenizer
    from vllite.testing.models import make_tiny_model_dir_cached

    return get_tokenizer(make_tiny_model_dir_cached("llama"))


@pytest.mark.parametrize("backend_name", ["xgrammar", "guidance"])
def test_matcher_contract(tokenizer, backend_name):
    """accept / validate (drafts) / rollback / bitmask / termination agree for both builtin backends."""
    import torch

    from vllite.structured_output.bitmask import unpack_bitmask
    from vllite.structured_output.registry import backend_class

    vocab = 4096
    backend = backend_class(backend_name)(tokenizer, vocab, [tokenizer.eos_token_id])
    grammar = backend.new_grammar(backend.compile(P(choice=["yes", "no"]).spec()))
    bitmask = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 1)
    allowed = {tokenizer.decode([t]) for t in (~unpack_bitmask(bitmask[1:], vocab)[0]).nonzero().flatten().tolist()}
    assert allowed and allowed <= {"y", "ye", "yes", "n", "no"}
    yes = tokenizer.encode("yes", add_special_tokens=False)
    bad = tokenizer.encode("maybe", add_special_tokens=False)
    assert grammar.validate_tokens(bad) == []
    assert grammar.validate_tokens([*yes, *bad]) == yes  # drafts cut at the first refused token
    assert grammar.accept_tokens(yes)
    grammar.fill_bitmask(bitmask, 0)
    after = (~unpack_bitmask(bitmask[:1], vocab)[0]).nonzero().flatten().tolist()
    assert after == [tokenizer.eos_token_id]
    assert grammar.accept_tokens([tokenizer.eos_token_id]) and grammar.is_terminated()
    # Rollback (what draft checks rely on): tokens taken back can be taken again.
    regex = backend.new_grammar(backend.compile(P(regex="[ab]{1,8}").spec()))
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    assert regex.accept_tokens([a, b, a])
    regex.rollback(2)
    assert regex.validate_tokens([b, b, 7]) == [b, b] and regex.accept_tokens([b])
    assert not regex.is_terminated()


def test_draft_rows_and_filtering(tokenizer):
    """Speculative decoding: drafts are cut at the first token the grammar refuses, the bitmask has a row per draft
    position (the matcher is left where it was), and the kept logits rows map onto them."""
    from concurrent.futures import Future

    import torch

    from vllite.plugins.structured_outputs.manager import fill_rows
    from vllite.request import Request
    from vllite.structured_output.bitmask import draft_token_mask, unpack_bitmask
    from vllite.structured_output.manager import filter_drafts
    from vllite.structured_output.registry import backend_class
    from vllite.structured_output.request import StructuredOutputRequest

    vocab = 4096
    backend = backend_class("xgrammar")(tokenizer, vocab, [tokenizer.eos_token_id])
    params = P(regex="(ab)+")
    compiled: Future = Future()
    compiled.set_result(backend.compile(params.spec()))
    request = Request("r", [1, 2], SamplingParams(structured_outputs=params))
    request.structured_output_request = StructuredOutputRequest(params, "xgrammar", compiled)
    grammar = request.structured_output_request.make_grammar(backend)
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    assert filter_drafts(request, [a, b, b, a]) == [a, b]
    bitmask = torch.full((4, (vocab + 31) // 32), -1, dtype=torch.int32)
    fill_rows(grammar, [a, b], bitmask, 1)
    allowed = [set((~unpack_bitmask(bitmask[i : i + 1], vocab)[0]).nonzero().flatten().tolist()) for i in range(4)]
    assert a in allowed[1] and b not in allowed[1]  # before the drafts: "a"
    assert b in allowed[2] and a not in allowed[2]  # after "a": "b"
    assert a in allowed[3] and tokenizer.eos_token_id in allowed[3]  # after "ab": more, or the end
    assert grammar.validate_tokens([a]) == [a]  # the matcher is back at the start
    from vllite.structured_output.bitmask import GrammarOutput

    output = GrammarOutput(["r"], bitmask, {"r": 1})
    mask = draft_token_mask(output, ["x", "r"], [1, 2], vocab, torch.device("cpu"))
    assert mask is not None and mask.shape == (5, vocab)
    assert not mask[:2].any()  # the unconstrained request's rows
    assert torch.equal(mask[2:], unpack_bitmask(bitmask[1:4], vocab))


@pytest.mark.parametrize("order", ["aligned", "shuffled"])
def test_batch_token_mask_bans_what_each_requests_bitmask_row_bans(order):
    """The sampler's mask for a batch: a constrained request's row is its bitmask row (in the fill's order or not),
    tokens past the bitmask's words are banned, an unconstrained request's row bans nothing."""
    import torch

    from vllite.structured_output.bitmask import GrammarOutput, batch_token_mask, unpack_bitmask

    vocab, wider = 128, 150  # logits wider than the bitmask: the tokens past its words are banned
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    fill_order = ["a", "b", "c"] if order == "aligned" else ["c", "a", "b"]
    output = GrammarOutput(fill_order, bitmask, {req_id: row for row, req_id in enumerate(fill_order)})
    req_ids = ["a", "b", "c"] if order == "aligned" else ["a", "free", "b", "c"]
    mask = batch_token_mask(output, req_ids, wider, torch.device("cpu"))
    assert mask is not None and mask.shape == (len(req_ids), wider)
    for i, req_id in enumerate(req_ids):
        if req_id == "free":
            assert not mask[i].any()
            continue
        row = output.req_id_to_row[req_id]
        assert torch.equal(mask[i, :vocab], unpack_bitmask(bitmask[row : row + 1], vocab)[0])
        assert mask[i, vocab:].all()
    assert batch_token_mask(output, ["free"], wider, torch.device("cpu")) is None


@pytest.mark.parametrize("vocab", [64, 50, 100])
def test_unpack_bitmask_reads_bit_i_of_word_j_as_token_32j_plus_i(vocab):
    """Against a bit-by-bit reference: a 0 bit bans its token; a vocabulary past the words (100 > 64) is banned."""
    import torch

    from vllite.structured_output.bitmask import unpack_bitmask

    gen = torch.Generator().manual_seed(2)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 2), generator=gen, dtype=torch.int32)
    banned = unpack_bitmask(bitmask, vocab)
    assert banned.shape == (3, vocab) and banned.dtype == torch.bool
    for row in range(3):
        for token in range(vocab):
            allowed = token < 64 and (int(bitmask[row, token // 32]) >> (token % 32)) & 1 == 1
            assert bool(banned[row, token]) is not allowed
