"""The persistent input batch: rows, condensing, and the BatchUpdates a logits processor follows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vllite.exceptions import BatchStateError
from vllite.logits_processor.interface import BatchUpdate, MoveDirectionality
from vllite.plugins.transformers_executor.input_batch import CachedRequestState, InputBatch
from vllite.sampling_params import SamplingParams


def _state(req_id: str, n_prompt: int = 3, temperature: float = 1.0, top_k: int = 0) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[int(req_id[1:]) * 10 + i for i in range(n_prompt)],
        sampling_params=SamplingParams(temperature=temperature, top_k=top_k),
        generator=None,
        block_ids=[int(req_id[1:]) + 1],
        num_computed_tokens=0,
        output_token_ids=[7],
    )


class Mirror:
    """A processor-side view rebuilt only from BatchUpdates (removed, added, moved; vLLM V1 order)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}

    def update(self, bu: BatchUpdate | None) -> None:
        if bu is None:
            return
        assert not set(bu.removed) & {a[0] for a in bu.added}
        for index in bu.removed:
            self.rows.pop(index, None)
        for index, _params, _prompt, output in bu.added:
            self.rows[index] = output
        for a, b, direction in bu.moved:
            if direction == MoveDirectionality.SWAP:
                self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
            else:
                self.rows[b] = self.rows.pop(a)
        assert sorted(self.rows) == list(range(bu.batch_size))


def test_add_remove_condense_moves_last_rows_into_holes() -> None:
    batch = InputBatch(8, 32, 8, 100)
    states = [_state(f"r{i}", temperature=0.5 + i) for i in range(5)]
    for s in states:
        batch.add_request(s)
    bu = batch.get_batch_update()
    assert bu is not None and [a[0] for a in bu.added] == [0, 1, 2, 3, 4] and bu.batch_size == 5
    assert batch.get_batch_update() is None

    batch.remove_request("r1")
    batch.remove_request("r3")
    batch.condense()
    assert batch.req_ids == ["r0", "r4", "r2"]
    bu = batch.get_batch_update()
    assert bu is not None and bu.batch_size == 3
    assert list(bu.moved) == [(4, 1, MoveDirectionality.UNIDIRECTIONAL)] and list(bu.removed) == [3]
    # The moved row carries its arrays along.
    assert batch.temperature[1] == pytest.approx(4.5)
    assert batch.token_ids[1, :4].tolist() == [40, 41, 42, 7]
    assert batch.block_table[1, 0] == 5 and batch.num_blocks[1] == 1


def test_new_requests_fill_the_lowest_holes_first() -> None:
    batch = InputBatch(8, 32, 8, 100)
    for i in range(4):
        batch.add_request(_state(f"r{i}"))
    batch.get_batch_update()
    batch.remove_request("r2")
    batch.remove_request("r0")
    batch.add_request(_state("r5"))
    batch.condense()
    bu = batch.get_batch_update()
    assert bu is not None
    assert [a[0] for a in bu.added] == [0]
    assert batch.req_ids == ["r5", "r1", "r3"]
    assert list(bu.moved) == [(3, 2, MoveDirectionality.UNIDIRECTIONAL)]


def test_random_churn_keeps_processor_view_consistent() -> None:
    rng = random.Random(0)
    batch = InputBatch(16, 32, 8, 100)
    mirror = Mirror()
    live: dict[str, CachedRequestState] = {}
    counter = 0
    for _ in range(200):
        for req_id in rng.sample(sorted(live), k=rng.randrange(0, len(live) + 1)):
            batch.remove_request(req_id)
            del live[req_id]
        for _ in range(rng.randrange(0, 16 - len(live) + 1)):
            s = _state(f"r{counter}")
            counter += 1
            live[s.req_id] = s
            batch.add_request(s)
        batch.condense()
        mirror.update(batch.get_batch_update())
        assert sorted(batch.req_ids) == sorted(live)
        for row, req_id in enumerate(batch.req_ids):
            assert batch.req_id_to_index[req_id] == row
            assert mirror.rows[row] is live[req_id].output_token_ids  # the live list, not a copy
            n = int(batch.num_tokens[row])
            assert batch.token_ids[row, :n].tolist() == [*live[req_id].prompt_token_ids, 7]


def test_sampling_arrays_and_block_updates() -> None:
    batch = InputBatch(4, 16, 4, 100)
    row = batch.add_request(_state("r0", temperature=0.0, top_k=-1))
    assert batch.temperature[row] == 0.0 and batch.top_k[row] == 0
    batch.append_block_ids(row, [9, 10])
    assert batch.block_table[row, :3].tolist() == [1, 9, 10] and batch.num_blocks[row] == 3
    batch.set_block_ids(row, [4])
    assert batch.num_blocks[row] == 1
    with pytest.raises(ValueError, match="per-request maximum"):
        batch.append_block_ids(row, [1, 2, 3, 4])
    batch.append_token(row, 55)
    assert batch.num_tokens[row] == 5 and batch.token_ids[row, 4] == 55
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(_state("r0"))
    assert isinstance(batch.num_computed_tokens, np.ndarray)


def test_full_batch_and_overlong_request_are_errors() -> None:
    batch = InputBatch(2, 8, 4, 100)
    batch.add_request(_state("r0"))
    batch.add_request(_state("r1"))
    with pytest.raises(BatchStateError, match="full"):
        batch.add_request(_state("r2"))
    batch = InputBatch(2, 3, 4, 100)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request(_state("r0", n_prompt=3))


# ---------------------------------------------------------------------------- in-place step inputs
def _naive_inputs(batch: InputBatch, num_scheduled: list[int], block_size: int) -> tuple[list[int], ...]:
    ids, positions, slots = [], [], []
    for row, n in enumerate(num_scheduled):
        start = int(batch.num_computed_tokens[row])
        for pos in range(start, start + n):
            ids.append(int(batch.token_ids[row, pos]))
            positions.append(pos)
            slots.append(int(batch.block_table[row, pos // block_size]) * block_size + pos % block_size)
    return ids, positions, slots


@pytest.mark.parametrize("decode", [True, False])
def test_prepare_inputs_writes_the_naive_inputs_into_persistent_buffers(decode: bool) -> None:
    import torch

    from vllite.plugins.transformers_executor.step_buffers import StepBuffers, prepare_inputs

    block_size = 4
    batch = InputBatch(8, 32, 8, 1000)
    rng = random.Random(3)
    for i in range(5):
        state = _state(f"r{i}", n_prompt=rng.randint(3, 12))
        state.block_ids = rng.sample(range(50), 8)
        state.num_computed_tokens = state.num_tokens - 1 if decode else rng.randint(0, state.num_tokens - 1)
        batch.add_request(state)
    num_scheduled = [
        1 if decode else int(batch.num_tokens[r] - batch.num_computed_tokens[r]) for r in range(batch.num_reqs)
    ]
    buffers = StepBuffers(8, max_num_tokens=4)  # too small: grows
    for _ in range(2):  # the second step reuses the same memory
        input_ids, positions, md = prepare_inputs(
            batch, np.array(num_scheduled), block_size, buffers, torch.device("cpu")
        )
        ids, pos, slots = _naive_inputs(batch, num_scheduled, block_size)
        assert input_ids[0].tolist() == ids and positions[0].tolist() == pos
        assert md.slot_mapping.tolist() == slots
        assert md.seq_lens.tolist() == [int(batch.num_computed_tokens[r]) + n for r, n in enumerate(num_scheduled)]
        assert md.query_start_loc.tolist() == [0, *np.cumsum(num_scheduled).tolist()]
        assert md.max_query_len == max(num_scheduled)
        assert input_ids.data_ptr() == buffers.input_ids.data_ptr()
    stable = prepare_inputs(
        batch, np.array(num_scheduled), block_size, buffers, torch.device("cpu"), stable_metadata=True
    )
    assert stable[2].slot_mapping.data_ptr() != buffers.slot_mapping.data_ptr()
    batch.num_computed_tokens[0] = batch.num_tokens[0]  # scheduled past its known tokens
    with pytest.raises(ValueError, match="past its known tokens"):
        prepare_inputs(batch, np.array(num_scheduled), block_size, buffers, torch.device("cpu"))


def test_version_and_reused_sampling_metadata() -> None:
    import torch

    from vllite.plugins.transformers_executor.sampling_inputs import SamplingInputs

    batch = InputBatch(8, 32, 8, 100)
    for i in range(3):
        batch.add_request(_state(f"r{i}", temperature=0.5 + i))
    batch.condense()
    inputs = SamplingInputs(batch, 100, torch.device("cpu"), torch.Generator(), None)
    all_rows = np.ones(3, dtype=bool)
    md = inputs.get(all_rows)
    ids = batch.req_ids
    assert inputs.get(all_rows) is md and batch.req_ids is ids  # unchanged composition: reused
    assert inputs.get(np.array([True, False, True])) is not md  # a row that samples nothing: fresh
    md = inputs.get(all_rows)
    version = batch.version
    batch.remove_request("r1")
    batch.condense()
    assert batch.version > version and batch.req_ids == ["r0", "r2"]
    fresh = inputs.get(np.ones(2, dtype=bool))
    assert fresh is not md and fresh.temperature.tolist() == pytest.approx([0.5, 2.5])
    batch.append_tokens(np.array([0, 1]), np.array([41, 42]))
    assert batch.token_ids[0, 4] == 41 and batch.token_ids[1, 4] == 42 and batch.num_tokens[:2].tolist() == [5, 5]
