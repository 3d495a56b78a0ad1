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
