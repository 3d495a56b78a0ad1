"""KVCacheBlock and the intrusive FreeKVCacheBlockQueue."""

from __future__ import annotations

import pytest

from vllite.exceptions import KVCacheStateError
from vllite.kv_cache import FreeKVCacheBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def test_new_queue_holds_blocks_in_order() -> None:
    blocks, q = make_queue(5)
    assert q.num_free_blocks == len(q) == 5
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.fake_free_list_head.block_id == q.fake_free_list_tail.block_id == -1
    assert blocks[0].prev_free_block is q.fake_free_list_head
    assert blocks[-1].next_free_block is q.fake_free_list_tail


def test_empty_queue_links_sentinels() -> None:
    _, q = make_queue(0)
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    with pytest.raises(ValueError):
        q.popleft()
    assert q.popleft_n(0) == []


def test_popleft_takes_head_and_clears_links() -> None:
    blocks, q = make_queue(3)
    b = q.popleft()
    assert b is blocks[0]
    assert b.prev_free_block is None and b.next_free_block is None
    assert ids(q) == [1, 2] and q.num_free_blocks == 2


def test_popleft_n_returns_first_n_and_rewires_head() -> None:
    blocks, q = make_queue(6)
    assert q.popleft_n(0) == []
    out = q.popleft_n(4)
    assert [b.block_id for b in out] == [0, 1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in out)
    assert q.fake_free_list_head.next_free_block is blocks[4]
    assert blocks[4].prev_free_block is q.fake_free_list_head
    assert q.num_free_blocks == 2
    with pytest.raises(AssertionError):
        q.popleft_n(3)
    assert [b.block_id for b in q.popleft_n(2)] == [4, 5]
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail


def test_remove_from_middle_links_neighbours() -> None:
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert ids(q) == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3]


def test_remove_of_block_not_in_queue_raises() -> None:
    blocks, q = make_queue(3)
    q.popleft()
    with pytest.raises(KVCacheStateError, match="invalid block"):
        q.remove(blocks[0])
    assert q.num_free_blocks == 2


def test_append_and_append_n_go_to_tail_in_order() -> None:
    blocks, q = make_queue(5)
    taken = q.popleft_n(5)
    q.append(taken[3])
    q.append_n([taken[1], taken[4], taken[0]])
    assert ids(q) == [3, 1, 4, 0]
    assert q.num_free_blocks == 4
    q.append_n([])
    assert q.num_free_blocks == 4
    assert q.popleft() is blocks[3]


def test_appendleft_n_goes_to_head_in_order() -> None:
    blocks, q = make_queue(5)
    taken = q.popleft_n(3)
    q.appendleft_n([taken[2], taken[0]])
    assert ids(q) == [2, 0, 3, 4]
    q.appendleft_n([])
    assert q.num_free_blocks == 4
    q.popleft_n(4)
    q.appendleft_n([taken[1]])  # into an empty queue
    assert ids(q) == [1] and q.popleft() is blocks[1]


def test_sentinels_are_never_returned() -> None:
    _, q = make_queue(2)
    out = q.popleft_n(2)
    assert all(b.block_id >= 0 for b in out)
    with pytest.raises(ValueError):
        q.popleft()


def test_block_repr_does_not_walk_the_queue_and_reset_hash() -> None:
    _, q = make_queue(3)
    b = q.popleft()
    b.block_hash = b"\x01" * 8
    assert "id=0" in repr(b) and "0101" in repr(b)
    b.reset_hash()
    assert b.block_hash is None
    # Identity semantics: two blocks with equal fields are still different blocks.
    assert KVCacheBlock(7) != KVCacheBlock(7)
