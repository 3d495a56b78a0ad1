"""The logits-processor framework: BatchUpdate, the builder, the container, dict updates, the adapter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllite.exceptions import BatchStateError
from vllite.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    process_dict_updates,
)
from vllite.sampling_params import SamplingParams

SWAP, UNI = MoveDirectionality.SWAP, MoveDirectionality.UNIDIRECTIONAL
READ_ERROR = "Cannot register new removed request after self.removed has been read."


def bias_state(params, _prompt, _output):
    return params.logit_bias or None


def update(removed=(), added=(), moved=(), batch_size=4):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved))


# ---------------------------------------------------------------- BatchUpdate / MoveDirectionality
def test_move_directionality_has_two_members():
    assert {m.name for m in MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}


def test_batch_update_is_frozen():
    bu = update()
    for name in ("batch_size", "removed", "added", "moved"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(bu, name, None)


# ---------------------------------------------------------------- BatchUpdateBuilder
def test_pop_removed_returns_smallest_first():
    b = BatchUpdateBuilder()
    for i in (7, 3, 5):
        b.removed_append(i)
    assert [b.pop_removed(), b.pop_removed(), b.pop_removed(), b.pop_removed()] == [3, 5, 7, None]


def test_peek_removed_does_not_remove():
    b = BatchUpdateBuilder()
    b.removed_append(4)
    b.removed_append(2)
    assert b.peek_removed() == 2 and b.peek_removed() == 2 and b.has_removed()


@pytest.mark.parametrize("read", ["peek", "pop", "property"])
def test_removed_append_after_read_raises(read):
    b = BatchUpdateBuilder()
    b.removed_append(1)
    b.removed_append(0)
    {"peek": b.peek_removed, "pop": b.pop_removed, "property": lambda: b.removed}[read]()
    with pytest.raises(BatchStateError, match=READ_ERROR):
        b.removed_append(5)


def test_removed_property_sorts_even_when_empty():
    b = BatchUpdateBuilder()
    assert b.removed == []
    with pytest.raises(BatchStateError):
        b.removed_append(1)


def test_pop_on_empty_builder_keeps_append_allowed():
    b = BatchUpdateBuilder()
    assert b.pop_removed() is None and b.peek_removed() is None
    b.removed_append(3)
    assert b.removed == [3]


def test_append_allowed_again_after_reset_and_get_and_reset():
    b = BatchUpdateBuilder()
    b.removed_append(2)
    _ = b.removed
    b.get_and_reset(3)
    b.removed_append(1)
    _ = b.removed
    b.reset()
    b.removed_append(0)


def test_removed_property_is_descending():
    b = BatchUpdateBuilder()
    for i in (1, 9, 4, 6):
        b.removed_append(i)
    assert b.removed == [9, 6, 4, 1]


def test_get_and_reset_none_when_empty_and_resets_batch_changed():
    b = BatchUpdateBuilder()
    b.batch_changed = True
    assert b.get_and_reset(5) is None
    assert b.batch_changed is False


def test_get_and_reset_hands_over_lists():
    b = BatchUpdateBuilder()
    params = SamplingParams()
    b.removed_append(2)
    b.added.append((0, params, [1], []))
    b.moved.append((1, 0, UNI))
    old_added = b.added
    bu = b.get_and_reset(3)
    assert bu.batch_size == 3 and bu.removed == [2] and bu.added is old_added
    assert list(bu.moved) == [(1, 0, UNI)]
    b.added.append((1, params, None, []))
    b.removed_append(0)
    assert len(bu.added) == 1 and bu.removed == [2]


def test_batch_changed_and_reset():
    b = BatchUpdateBuilder()
    b.added.append((0, SamplingParams(), None, []))
    assert b.batch_changed is False  # only removed_append sets it
    b.removed_append(1)
    added = b.added
    assert b.reset() is True and b.reset() is False
    assert added == [] and b.added is added  # cleared in place


def test_reused_slot_is_not_reported_removed():
    b = BatchUpdateBuilder()
    b.removed_append(1)
    b.removed_append(3)
    slot = b.pop_removed()
    b.added.append((slot, SamplingParams(), None, []))
    bu = b.get_and_reset(4)
    assert list(bu.removed) == [3] and bu.added[0][0] == 1


def test_added_output_list_is_live():
    b = BatchUpdateBuilder()
    output: list[int] = []
    b.added.append((0, SamplingParams(), [5], output))
    bu = b.get_and_reset(1)
    output.append(9)
    assert bu.added[0][3] == [9]


# ---------------------------------------------------------------- LogitsProcessor ABC and container
class _Fixed(LogitsProcessor):
    def __init__(self, vllm_config=None, device=None, is_pin_memory=False, invariant=True):
        self.invariant = invariant
        self.calls: list = []

    def apply(self, logits):
        self.calls.append("apply")
        return logits + (1 if self.invariant else 10)

    def is_argmax_invariant(self):
        return self.invariant

    def update_state(self, batch_update):
        self.calls.append(batch_update)


def test_abc_requires_all_abstract_methods():
    class NoApply(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self):
            return True

        def update_state(self, batch_update):
            pass

    with pytest.raises(TypeError):
        NoApply(None, None, False)


def test_default_validate_params_accepts_anything():
    assert _Fixed.validate_params(SamplingParams(extra_args={"x": object()})) is None


def test_container_split_and_order():
    a, b, c = _Fixed(invariant=False), _Fixed(invariant=False), _Fixed(invariant=True)
    procs = LogitsProcessors([a, b, c])
    assert procs.argmax_invariant == [c] and procs.non_argmax_invariant == [a, b]
    assert list(procs.all) == [c, a, b] and list(procs.all) == [c, a, b]
    assert len(procs) == 3


def test_empty_container():
    for procs in (LogitsProcessors(), LogitsProcessors(None)):
        assert list(procs.all) == [] and procs.argmax_invariant == [] and procs.non_argmax_invariant == []


def test_split_decided_once():
    p = _Fixed(invariant=True)
    procs = LogitsProcessors([p])
    p.invariant = False
    assert procs.argmax_invariant == [p]


def test_container_update_and_apply_helpers():
    inv, non = _Fixed(invariant=True), _Fixed(invariant=False)
    procs = LogitsProcessors([inv, non])
    procs.update_state(None)
    assert inv.calls == [None] and non.calls == [None]
    out = procs.apply(torch.zeros(1, 2))
    assert torch.equal(out, torch.full((1, 2), 11.0))
    assert torch.equal(procs.apply_non_argmax_invariant(torch.zeros(1, 1)), torch.full((1, 1), 10.0))
    assert torch.equal(procs.apply_argmax_invariant(torch.zeros(1, 1)), torch.ones(1, 1))


# ---------------------------------------------------------------- process_dict_updates (Appendix N)
def test_none_or_empty_update_changes_nothing():
    entries = {0: {1: 1.0}}
    assert process_dict_updates(entries, None, bias_state) is False
    assert process_dict_updates(entries, update(), bias_state) is False
    assert entries == {0: {1: 1.0}}


def test_n1_add_with_bias():
    entries: dict = {}
    params = SamplingParams(logit_bias={100: 0.5, 200: -0.3})
    assert process_dict_updates(entries, update(added=[(0, params, [1], [])]), bias_state) is True
    assert entries == {0: {100: 0.5, 200: -0.3}}


def test_n2_remove():
    entries = {0: {100: 0.5}, 1: {200: -0.3}}
    assert process_dict_updates(entries, update(removed=[1]), bias_state) is True
    assert entries == {0: {100: 0.5}}


def test_n3_swap():
    entries = {0: {100: 0.5}, 1: {200: -0.3}}
    assert process_dict_updates(entries, update(moved=[(0, 1, SWAP)]), bias_state) is True
    assert entries == {0: {200: -0.3}, 1: {100: 0.5}}


def test_n4_unidirectional():
    entries = {0: {100: 0.5}, 2: {300: 0.8}}
    assert process_dict_updates(entries, update(moved=[(0, 1, UNI)]), bias_state) is True
    assert entries == {1: {100: 0.5}, 2: {300: 0.8}}


def test_n5_new_request_without_parameter_clears_slot():
    entries = {0: {100: 0.5}}
    assert process_dict_updates(entries, update(added=[(0, SamplingParams(), [1], [])]), bias_state) is True
    assert entries == {}


def test_add_without_parameter_on_empty_slot_is_no_change():
    entries = {1: {5: 1.0}}
    assert process_dict_updates(entries, update(added=[(0, SamplingParams(), None, [])]), bias_state) is False


@pytest.mark.parametrize(("start", "expected"), [({0: "a"}, {1: "a"}), ({1: "b"}, {0: "b"})])
def test_one_sided_swap(start, expected):
    assert process_dict_updates(start, update(moved=[(0, 1, SWAP)]), bias_state) is True
    assert start == expected


def test_unidirectional_discards_destination():
    entries = {0: "a", 1: "b"}
    assert process_dict_updates(entries, update(moved=[(0, 1, UNI)]), bias_state) is True
    assert entries == {1: "a"}


def test_removed_and_moved_ignored_when_empty():
    entries: dict = {}
    assert process_dict_updates(entries, update(removed=[0], moved=[(1, 0, UNI)]), bias_state) is False


# ---------------------------------------------------------------- AdapterLogitsProcessor
class _Adapter(AdapterLogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory, factory):
        super().__init__(vllm_config, device, is_pin_memory)
        self.factory = factory

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        return self.factory(params)


def test_adapter_two_and_three_parameter_callables():
    seen = []

    def two(output_ids, row):
        seen.append(("two", list(output_ids)))
        row[0] = len(output_ids)
        return row

    def three(prompt_ids, output_ids, row):
        seen.append(("three", list(prompt_ids), list(output_ids)))
        return row + 100  # a new tensor: written back

    def factory(params):
        return {"two": two, "three": three}.get((params.extra_args or {}).get("kind"))

    proc = _Adapter(None, "cpu", False, factory)
    out0, out1 = [7], []
    proc.update_state(
        update(
            added=[
                (0, SamplingParams(extra_args={"kind": "two"}), [1], out0),
                (1, SamplingParams(extra_args={"kind": "three"}), [2, 3], out1),
                (2, SamplingParams(), [4], []),
            ],
            batch_size=3,
        )
    )
    logits = proc.apply(torch.zeros(3, 4))
    assert seen == [("two", [7]), ("three", [2, 3], [])]
    assert logits[0].tolist() == [1, 0, 0, 0] and logits[1].tolist() == [100] * 4
    assert logits[2].tolist() == [0] * 4
    out0.append(8)  # live list: visible without update_state
    logits = proc.apply(torch.zeros(3, 4))
    assert logits[0, 0] == 2


def test_adapter_three_parameter_callable_needs_prompt():
    proc = _Adapter(None, "cpu", False, lambda params: lambda p, o, row: row)
    with pytest.raises(ValueError, match="Prompt token ids are required"):
        proc.update_state(update(added=[(0, SamplingParams(), None, [])], batch_size=1))
