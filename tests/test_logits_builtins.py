"""The builtin processors' state and math, with the spec's worked traces (errata applied)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllite.builtin_logitsprocs.logit_bias import LogitBiasLogitsProcessor
from vllite.builtin_logitsprocs.min_p import MinPLogitsProcessor
from vllite.builtin_logitsprocs.min_tokens import MinTokensLogitsProcessor
from vllite.builtin_logitsprocs.thinking_budget import (
    FORCE_LOGIT,
    ThinkingBudgetLogitsProcessor,
    ThinkState,
    find_last_sequence_index,
)
from vllite.config import ModelConfig, SchedulerConfig, VllmConfig
from vllite.logits_processor import BatchUpdate, MoveDirectionality
from vllite.sampling_params import SamplingParams

SWAP, UNI = MoveDirectionality.SWAP, MoveDirectionality.UNIDIRECTIONAL
NEG_INF = -math.inf


def config(max_num_seqs=8, hf_config=None):
    return VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
        model_config=ModelConfig(hf_config=hf_config),
    )


def update(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved))


def add(index, output=None, prompt=(1,), **params):
    return (index, SamplingParams(**params), list(prompt), output if output is not None else [])


# ---------------------------------------------------------------- MinP
def test_min_p_construction_on_cpu():
    proc = MinPLogitsProcessor(config(6), torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is True
    assert proc.min_p_device is proc.min_p_cpu_tensor and proc.min_p_cpu_tensor.shape == (6,)
    proc.min_p_cpu[2] = 0.5
    assert proc.min_p_cpu_tensor[2] == 0.5  # the numpy view shares memory


def test_min_p_add_count_and_shape():
    proc = MinPLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(3, added=[add(0, min_p=0.1), add(1, min_p=0.0), add(2, min_p=0.05)]))
    assert proc.min_p_count == 2 and proc.min_p.shape == (3, 1)
    before = proc.min_p
    proc.update_state(None)
    assert proc.min_p is before and proc.min_p_count == 2


def test_min_p_r2_trace_corrected():
    """A11.1: the seed's invalid update (index 1 removed and added) ends with count 2, not 1."""
    proc = MinPLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(3, added=[add(0, min_p=0.1), add(2, min_p=0.05)]))
    proc.update_state(update(4, removed=[1], added=[add(1, min_p=0.2), add(3, min_p=0.0)], moved=[(2, 3, UNI)]))
    assert proc.min_p_cpu[:4].tolist() == pytest.approx([0.1, 0.0, 0.0, 0.05])
    assert proc.min_p_count == 2 and proc.min_p.shape == (4, 1)


def test_min_p_moves():
    proc = MinPLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(3, added=[add(0, min_p=0.1), add(1, min_p=0.3), add(2, min_p=0.0)]))
    proc.update_state(update(3, moved=[(0, 1, SWAP)]))
    assert proc.min_p_cpu[:2].tolist() == pytest.approx([0.3, 0.1]) and proc.min_p_count == 2
    proc.update_state(update(2, removed=[2], moved=[(0, 1, UNI)]))  # b held a value: it is lost
    assert proc.min_p_cpu[:2].tolist() == pytest.approx([0.0, 0.3]) and proc.min_p_count == 1


def test_min_p_math():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    proc = MinPLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(3, added=[add(0, min_p=0.2), add(1, min_p=0.5), add(2, min_p=0.0)]))
    out = proc.apply(row.repeat(3, 1))
    assert torch.isinf(out[0]).tolist() == [False, False, False, True]
    assert torch.isinf(out[1]).tolist() == [False, False, True, True]
    assert torch.equal(out[2], row)
    assert torch.equal(out[0, :3], row[:3])


def test_min_p_identity_when_unused():
    proc = MinPLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(2, added=[add(0), add(1)]))
    logits = torch.randn(2, 5)
    copy = logits.clone()
    assert proc.apply(logits) is logits and torch.equal(logits, copy)


def test_min_p_keeps_argmax():
    gen = torch.Generator().manual_seed(0)
    proc = MinPLogitsProcessor(config(16), "cpu", False)
    values = torch.rand(16, generator=gen).tolist()
    values[0] = 1.0
    proc.update_state(update(16, added=[add(i, min_p=v) for i, v in enumerate(values)]))
    logits = torch.randn(16, 50, generator=gen) * 3
    expected = logits.argmax(-1)
    assert torch.equal(proc.apply(logits.clone()).argmax(-1), expected)


def test_min_p_reslices_when_batch_size_changes():
    proc = MinPLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(2, added=[add(0, min_p=0.1), add(1)]))
    proc.update_state(update(3, added=[add(2)]))  # no value change, batch grew
    assert proc.min_p.shape == (3, 1)


# ---------------------------------------------------------------- LogitBias
def test_logit_bias_s2_trace():
    proc = LogitBiasLogitsProcessor(config(), "cpu", False)
    assert proc.is_argmax_invariant() is False
    proc.update_state(update(3, added=[add(0, logit_bias={100: 0.5, 200: -0.3}), add(1), add(2, logit_bias={50: 1.0})]))
    reqs, toks = proc.logits_slice
    assert reqs.dtype == torch.int32 and reqs.tolist() == [0, 0, 2] and toks.tolist() == [100, 200, 50]
    assert proc.bias_tensor.dtype == torch.float32
    assert proc.bias_tensor.tolist() == pytest.approx([0.5, -0.3, 1.0])
    out = proc.apply(torch.zeros(3, 256))
    expected = torch.zeros(3, 256)
    expected[0, 100], expected[0, 200], expected[2, 50] = 0.5, -0.3, 1.0
    assert torch.equal(out, expected)


def test_logit_bias_empty_creates_no_state():
    proc = LogitBiasLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(2, added=[add(0, logit_bias={}), add(1)]))
    assert proc.biases == {}
    logits = torch.randn(2, 4)
    assert torch.equal(proc.apply(logits.clone()), logits)


def test_logit_bias_cleared_by_new_request_without_bias():
    proc = LogitBiasLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(1, added=[add(0, logit_bias={3: 2.0})]))
    proc.update_state(update(1, added=[add(0)]))
    assert proc.biases == {} and torch.equal(proc.apply(torch.zeros(1, 4)), torch.zeros(1, 4))


def test_logit_bias_follows_moves():
    proc = LogitBiasLogitsProcessor(config(), "cpu", False)
    proc.update_state(update(2, added=[add(0, logit_bias={1: 1.0}), add(1, logit_bias={2: 2.0})]))
    proc.update_state(update(2, moved=[(0, 1, SWAP)]))
    out = proc.apply(torch.zeros(2, 3))
    assert out.tolist() == [[0, 0, 2.0], [0, 1.0, 0]]


# ---------------------------------------------------------------- MinTokens
def stop_params(min_tokens, stops):
    return SamplingParams(min_tokens=min_tokens, stop_token_ids=list(stops))


def test_min_tokens_add_request():
    assert MinTokensLogitsProcessor.add_request(stop_params(0, [2]), None, []) is None
    assert MinTokensLogitsProcessor.add_request(stop_params(2, [2]), None, [5, 6]) is None
    out = [5]
    state = MinTokensLogitsProcessor.add_request(stop_params(2, [2, 7]), None, out)
    assert state[0] == 2 and state[1] is out and state[2] == {2, 7}


def test_min_tokens_masks_until_enough_tokens():
    proc = MinTokensLogitsProcessor(config(), "cpu", False)
    assert proc.is_argmax_invariant() is False
    out: list[int] = []
    proc.update_state(update(2, added=[(0, stop_params(3, [2, 7]), [1], out), add(1)]))
    logits = proc.apply(torch.zeros(2, 8))
    assert logits[0, 2] == NEG_INF and logits[0, 7] == NEG_INF
    assert torch.isinf(logits).sum() == 2 and not torch.isinf(logits[1]).any()
    out.extend([4, 5, 6])
    proc.update_state(None)
    assert proc.min_toks == {} and proc.logits_slice[0].numel() == 0
    assert not torch.isinf(proc.apply(torch.zeros(2, 8))).any()


def test_min_tokens_counts_eos_in_all_stop_token_ids():
    proc = MinTokensLogitsProcessor(config(), "cpu", False)
    params = SamplingParams(min_tokens=2, all_stop_token_ids=[0])
    proc.update_state(update(1, added=[(0, params, [1], [])]))
    assert proc.apply(torch.zeros(1, 3))[0].tolist() == [NEG_INF, 0, 0]


def test_min_tokens_spec_decode_trace():
    proc = MinTokensLogitsProcessor(config(), "cpu", False)
    proc.min_toks = {0: (10, [0] * 0, {2}), 1: (5, [0] * 3, {2, 7}), 2: (4, [0] * 3, {2})}
    logits = proc.apply_with_spec_decode(torch.zeros(6, 8), [2, 3, 1])
    masked = {tuple(x) for x in torch.nonzero(torch.isinf(logits)).tolist()}
    assert masked == {(0, 2), (1, 2), (2, 2), (2, 7), (3, 2), (3, 7), (5, 2)}


def test_min_tokens_spec_decode_noop_cases():
    proc = MinTokensLogitsProcessor(config(), "cpu", False)
    logits = torch.zeros(2, 4)
    assert proc.apply_with_spec_decode(logits, [1, 1]) is logits
    proc.min_toks = {0: (5, [], set())}
    assert not torch.isinf(proc.apply_with_spec_decode(logits, [1, 1])).any()


# ---------------------------------------------------------------- ThinkingBudget
@pytest.mark.parametrize(
    ("target", "ids", "expected"),
    [([1, 2, 3, 1, 2], [1, 2], 3), ([1, 2, 3], [4], -1), ([], [1], -1), ([1], [1, 2], -1), ([1, 2], [], -1)],
)
def test_find_last_sequence_index(target, ids, expected):
    assert find_last_sequence_index(target, ids) == expected


def test_think_state_from_prompt_mid_think():
    state = ThinkState.from_prompt([5, 1, 7, 8, 9], [], [1], [2], budget=10)
    assert state.in_think and state.think_count == 3 and not state.in_end
    spent = ThinkState.from_prompt([5, 1, 7, 8, 9], [], [1], [2], budget=3)
    assert spent.in_end and spent.forced_token() == 2
    closed = ThinkState.from_prompt([1, 7, 2, 9], [], [1], [2], budget=3)
    assert not closed.in_think and closed.forced_token() is None
    assert not ThinkState.from_prompt(None, [], [1], [2], budget=3).in_think


def think_proc(end_ids=(99,), budget=3, prompt=(5,), hf=None):
    hf = hf or SimpleNamespace(think_start_token_ids=[1], think_end_token_ids=list(end_ids))
    proc = ThinkingBudgetLogitsProcessor(config(hf_config=hf), "cpu", False)
    out: list[int] = []
    params = SamplingParams(extra_args={"thinking_token_budget": budget})
    proc.update_state(update(2, added=[(0, params, list(prompt), out), add(1)]))
    return proc, out


def forced_rows(proc, vocab=128):
    logits = proc.apply(torch.zeros(2, vocab))
    return {tuple(x) for x in torch.nonzero(logits == FORCE_LOGIT).tolist()}


def test_thinking_budget_trace_single_end_token():
    """Behaviour 68: start [1], end [99], budget 3."""
    proc, out = think_proc()
    assert proc.is_argmax_invariant() is False
    for token in (1, 10, 11):  # [1], [1,a], [1,a,b]: no forcing
        out.append(token)
        proc.update_state(None)
        assert forced_rows(proc) == set()
    out.append(12)  # [1,a,b,c]: budget spent
    proc.update_state(None)
    logits = proc.apply(torch.zeros(2, 128))
    assert logits[0, 99] == FORCE_LOGIT and torch.count_nonzero(logits) == 1
    out.append(99)
    proc.update_state(None)
    assert forced_rows(proc) == set() and not proc.states[0].in_think


def test_thinking_budget_multi_token_end_marker():
    """Behaviour 69: end [98, 99] is forced one token per step, then the budget resets."""
    proc, out = think_proc(end_ids=(98, 99), budget=1)
    out.extend([1, 10])
    proc.update_state(None)
    assert forced_rows(proc) == {(0, 98)}
    out.append(98)
    proc.update_state(None)
    assert forced_rows(proc) == {(0, 99)}
    out.append(99)
    proc.update_state(None)
    state = proc.states[0]
    assert forced_rows(proc) == set() and not state.in_end and state.think_count == 0
    out.extend([1, 20])  # a second think section gets a full budget again
    proc.update_state(None)
    assert forced_rows(proc) == {(0, 98)}


def test_thinking_budget_natural_end_and_partial_marker():
    proc, out = think_proc(end_ids=(98, 99), budget=5)
    out.extend([1, 10, 98, 99, 30, 31, 32, 33, 34, 35])  # thought ended by itself: never forced
    proc.update_state(None)
    assert forced_rows(proc) == set()
    proc, out = think_proc(end_ids=(98, 99), budget=2)
    out.extend([1, 10, 98])  # budget spent right after the model began the end marker itself
    proc.update_state(None)
    assert forced_rows(proc) == {(0, 99)}


def test_thinking_budget_marker_split_across_prompt_and_output():
    hf = SimpleNamespace(think_start_token_ids=[1, 2, 3, 4], think_end_token_ids=[8, 9])
    proc = ThinkingBudgetLogitsProcessor(config(hf_config=hf), "cpu", False)
    out: list[int] = []
    params = SamplingParams(extra_args={"thinking_token_budget": 1})
    proc.update_state(update(1, added=[(0, params, [1, 2], out)]))  # prompt shorter than the marker window
    out.extend([3, 4])
    proc.update_state(None)
    assert proc.states[0].in_think is True and forced_rows(proc) == set()
    out.append(40)  # one thinking token: the budget is spent
    proc.update_state(None)
    assert forced_rows(proc) == {(0, 8)}


def test_thinking_budget_spent_in_prompt_and_zero_budget():
    proc, out = think_proc(prompt=(5, 1, 7, 8, 9), budget=3)
    assert forced_rows(proc) == {(0, 99)}
    proc, out = think_proc(budget=0)
    out.append(1)
    proc.update_state(None)
    assert forced_rows(proc) == {(0, 99)}


def test_thinking_budget_untracked_without_markers_or_budget():
    proc = ThinkingBudgetLogitsProcessor(config(hf_config=None), "cpu", False)
    params = SamplingParams(extra_args={"thinking_token_budget": 0})
    proc.update_state(update(2, added=[(0, params, [1], [1, 1]), add(1, output=[1, 1])]))
    assert proc.states == {}
    # markers given per request instead of by the model config
    params = SamplingParams(
        extra_args={"thinking_token_budget": 0, "think_start_token_ids": 1, "think_end_token_ids": [4]}
    )
    proc.update_state(update(2, added=[(1, params, [1], [])]))
    assert forced_rows(proc) == {(1, 4)}


def test_thinking_budget_config_single_id_attributes():
    hf = SimpleNamespace(think_start_token_id=3, think_end_token_id=4)
    proc = ThinkingBudgetLogitsProcessor(config(hf_config=hf), "cpu", False)
    assert proc.start_ids == [3] and proc.end_ids == [4]
    nested = SimpleNamespace(text_config=SimpleNamespace(reasoning_start_token_ids=[5, 6], think_end_token_id=7))
    proc = ThinkingBudgetLogitsProcessor(config(hf_config=nested), "cpu", False)
    assert proc.start_ids == [5, 6] and proc.end_ids == [7]


def test_thinking_budget_follows_moves():
    proc, _ = think_proc(prompt=(5, 1, 7, 8, 9), budget=3)
    proc.update_state(update(2, moved=[(0, 1, SWAP)]))
    assert forced_rows(proc) == {(1, 99)}
    proc.update_state(update(1, removed=[0], moved=[(1, 0, UNI)]))
    assert forced_rows(proc) == {(0, 99)}


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking_token_budget": -1},
        {"thinking_token_budget": "10"},
        {"thinking_token_budget": True},
        {"thinking_token_budget": 4, "think_end_token_ids": []},
        {"think_start_token_ids": ["a"]},
        {"think_end_token_ids": [-3]},
    ],
)
def test_thinking_budget_validate_params_rejects(extra):
    with pytest.raises(ValueError):
        ThinkingBudgetLogitsProcessor.validate_params(SamplingParams(extra_args=extra))


def test_thinking_budget_validate_params_accepts():
    ThinkingBudgetLogitsProcessor.validate_params(SamplingParams())
    ThinkingBudgetLogitsProcessor.validate_params(
        SamplingParams(extra_args={"thinking_token_budget": 0, "think_end_token_ids": 7})
    )


@pytest.mark.cuda
def test_builtins_on_cuda_match_cpu():
    """Device tensors, the min-p double buffer and pinned host memory: CUDA results equal the CPU ones."""
    hf = SimpleNamespace(think_start_token_ids=[1], think_end_token_ids=[2])
    added = [
        add(0, min_p=0.3, logit_bias={3: 2.0}, min_tokens=2, stop_token_ids=[4]),
        add(1, output=[1], extra_args={"thinking_token_budget": 0}),
        add(2, min_p=0.1),
    ]
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    classes = [MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor, ThinkingBudgetLogitsProcessor]
    for cls in classes:
        results = []
        for device, pin in (("cpu", False), ("cuda", True)):
            proc = cls(config(hf_config=hf), torch.device(device), pin)
            proc.update_state(update(3, added=added))
            proc.update_state(update(3, moved=[(0, 2, SWAP)]))
            results.append(proc.apply(logits.clone().to(device)).cpu())
        assert torch.equal(results[0], results[1]), cls.__name__
