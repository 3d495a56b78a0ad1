"""SamplingParams: every invalid value names its field; edge cases; derived values; the wire round-trip."""

from __future__ import annotations

import math

import msgspec
import pytest

from vllite.plugins.engine_proc.serial import MsgpackDecoder, MsgpackEncoder
from vllite.sampling_params import RequestOutputKind, SamplingParams, SamplingType

INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("n", True),
    ("presence_penalty", 2.5),
    ("presence_penalty", math.nan),
    ("frequency_penalty", -2.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 11.0),
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("seed", 1.0),
    ("seed", "42"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("logprobs", 1.0),
    ("prompt_logprobs", -5),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", 5),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {1: math.nan}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {1: "x"}),
    ("logit_bias", [1, 2]),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-3]),
    ("allowed_token_ids", 7),
    ("extra_args", [1]),
    ("ignore_eos", 1),
    ("detokenize", "yes"),
    ("skip_special_tokens", None),
    ("spaces_between_special_tokens", 0),
    ("include_stop_str_in_output", 1),
    ("output_kind", 1),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


INVALID_ON_WIRE = [(f, v) for f, v in INVALID[:22] if not (isinstance(v, float) and not math.isfinite(v))]


@pytest.mark.parametrize(("field", "value"), INVALID_ON_WIRE, ids=[f"{f}={v!r}" for f, v in INVALID_ON_WIRE])
def test_invalid_value_from_the_wire_is_a_validation_error(field, value):
    raw = msgspec.msgpack.encode({field: value})
    with pytest.raises(msgspec.ValidationError, match=field):
        MsgpackDecoder(SamplingParams).decode(raw)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens=3"):
        SamplingParams(min_tokens=4, max_tokens=3)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 1e4},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 10.0},
        {"max_tokens": None},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": -1, "prompt_logprobs": 0},
        {"truncate_prompt_tokens": -1},
        {"logit_bias": {0: -100, 5: 100}},
        {"allowed_token_ids": [0]},
        {"seed": -(2**63)},
        {"stop": "a"},
        {"extra_args": {}},
    ],
)
def test_valid_edge_cases(kwargs):
    SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[7, 8], logit_bias={"3": 1})
    assert p.stop == ["END"]
    assert p.logit_bias == {3: 1.0} and isinstance(next(iter(p.logit_bias.values())), float)
    assert p.all_stop_token_ids == [7, 8]
    q = SamplingParams(stop=("a", "b"))
    assert q.stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.8).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.8, seed=1).sampling_type is SamplingType.RANDOM_SEED


def test_output_text_buffer_length():
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(stop=["ab", "wxyz"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["wxyz"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], logit_bias={1: 1.0}, extra_args={"a": [1]})
    c = p.clone()
    c.stop.append("y")
    c.extra_args["a"].append(2)
    c.all_stop_token_ids.append(9)
    c.logit_bias[2] = 3.0
    assert p.stop == ["x"] and p.extra_args == {"a": [1]} and p.all_stop_token_ids == []
    assert p.logit_bias == {1: 1.0}
    assert c == SamplingParams(
        stop=["x", "y"], logit_bias={1: 1.0, 2: 3.0}, extra_args={"a": [1, 2]}, all_stop_token_ids=[9]
    )


def test_update_from_generation_config():
    p = SamplingParams(stop_token_ids=[5])
    p.update_from_generation_config({"eos_token_id": [2, 3, 5]}, eos_token_id=2)
    assert p.all_stop_token_ids == [5, 3]
    p.update_from_generation_config({"eos_token_id": 4}, eos_token_id=[2])
    assert p.all_stop_token_ids == [5, 3, 4]
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": [3]}, eos_token_id=2)
    assert q.all_stop_token_ids == []
    r = SamplingParams()
    r.update_from_generation_config({}, eos_token_id=2)
    assert r.all_stop_token_ids == []


def test_wire_roundtrip():
    p = SamplingParams(
        n=2,
        temperature=0.3,
        top_k=4,
        seed=9,
        stop=["x"],
        stop_token_ids=[1],
        max_tokens=None,
        logit_bias={2: -5.0},
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"budget": 10},
    )
    p.update_from_generation_config({"eos_token_id": [6]}, eos_token_id=0)
    frames = MsgpackEncoder().encode(p)
    q = MsgpackDecoder(SamplingParams).decode(frames)
    assert q == p
    assert q.all_stop_token_ids == [1, 6] and q.max_tokens is None
    assert q.output_kind is RequestOutputKind.FINAL_ONLY
    # defaults are omitted on the wire (stop lists are normalised from None to [])
    assert set(msgspec.msgpack.decode(MsgpackEncoder().encode(SamplingParams())[0])) <= {
        "stop",
        "stop_token_ids",
    }
