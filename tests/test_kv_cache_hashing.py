"""Chained block hashes: full blocks only, prefix-sensitive, extra keys, incremental, both algorithms."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllite.kv_cache import NONE_HASH, get_hash_fn, get_request_block_hasher, hash_block_tokens
from vllite.lora import LoRARequest
from vllite.request import Request
from vllite.sampling_params import SamplingParams

ALGOS = ["sha256", "fast"]


def make_request(tokens: list[int], algo: str = "sha256", block_size: int = 4, **kw: object) -> Request:
    hasher = get_request_block_hasher(block_size, get_hash_fn(algo))
    return Request("r", tokens, SamplingParams(max_tokens=8), block_hasher=hasher, **kw)  # type: ignore[arg-type]


def letters(s: str) -> list[int]:
    return [ord(c) for c in s]


@pytest.mark.parametrize("algo", ALGOS)
def test_chain_matches_hash_block_tokens(algo: str) -> None:
    fn = get_hash_fn(algo)
    req = make_request(letters("ABCDEFGHIJKLM"), algo)
    h0 = hash_block_tokens(fn, None, letters("ABCD"))
    h1 = hash_block_tokens(fn, h0, letters("EFGH"))
    h2 = hash_block_tokens(fn, h1, letters("IJKL"))
    assert req.block_hashes == [h0, h1, h2]  # M is a partial block: no hash
    assert h0 == hash_block_tokens(fn, NONE_HASH, tuple(letters("ABCD")))
    assert len({h0, h1, h2}) == 3


@pytest.mark.parametrize("algo", ALGOS)
def test_partial_blocks_are_hashed_once_full(algo: str) -> None:
    req = make_request(list(range(47)), algo, block_size=16)
    assert len(req.block_hashes) == 2
    first = list(req.block_hashes)
    req.append_output_token_ids(47)
    assert len(req.block_hashes) == 3
    assert req.block_hashes[:2] == first
    full = make_request(list(range(48)), algo, block_size=16)
    assert full.block_hashes == req.block_hashes


def test_hashes_are_computed_incrementally_not_recomputed() -> None:
    calls: list[int] = []
    fn = get_hash_fn("sha256")

    def counting(obj: object) -> bytes:
        calls.append(1)
        return fn(obj)

    hasher = get_request_block_hasher(4, counting)
    req = Request("r", list(range(6)), SamplingParams(), block_hasher=hasher)
    assert len(calls) == 1
    for t in range(6, 14):
        req.append_output_token_ids(t)
    assert len(calls) == 3 == len(req.block_hashes)
    req.append_output_token_ids([14, 15, 16, 17, 18, 19, 20, 21])
    assert len(calls) == 5 == len(req.block_hashes)


@pytest.mark.parametrize("algo", ALGOS)
def test_changing_a_token_changes_that_block_and_all_later(algo: str) -> None:
    base = list(range(32))
    a = make_request(base, algo)
    changed = list(base)
    changed[13] = 999  # block 3 of 8
    b = make_request(changed, algo)
    assert a.block_hashes[:3] == b.block_hashes[:3]
    assert all(x != y for x, y in zip(a.block_hashes[3:], b.block_hashes[3:]))


@pytest.mark.parametrize("algo", ALGOS)
def test_same_block_under_a_different_prefix_hashes_differently(algo: str) -> None:
    a = make_request(letters("ABCDEFGH"), algo)
    b = make_request(letters("DCABEFGH"), algo)
    assert a.block_hashes[1] != b.block_hashes[1]


@pytest.mark.parametrize("algo", ALGOS)
def test_cache_salt_changes_every_hash_through_the_first_block(algo: str) -> None:
    toks = list(range(12))
    plain = make_request(toks, algo)
    salted = make_request(toks, algo, cache_salt="s1")
    other = make_request(toks, algo, cache_salt="s2")
    assert len({plain.block_hashes[0], salted.block_hashes[0], other.block_hashes[0]}) == 3
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes))
    # The salt enters the first block only; later blocks differ through the chain alone.
    fn = get_hash_fn(algo)
    assert salted.block_hashes[1] == hash_block_tokens(fn, salted.block_hashes[0], toks[4:8])


@pytest.mark.parametrize("algo", ALGOS)
def test_lora_name_changes_every_block_and_is_not_confused_with_salt(algo: str) -> None:
    toks = list(range(8))
    plain = make_request(toks, algo)
    lora = make_request(toks, algo, lora_request=LoRARequest("x", 1, "/adapters/x"))
    salt = make_request(toks, algo, cache_salt="x")
    assert all(x != y for x, y in zip(plain.block_hashes, lora.block_hashes))
    assert lora.block_hashes[0] != salt.block_hashes[0]
    fn = get_hash_fn(algo)
    assert lora.block_hashes[1] != hash_block_tokens(fn, lora.block_hashes[0], toks[4:8])


def test_algorithms_differ_and_sha256_is_32_bytes() -> None:
    sha = get_hash_fn("sha256")((NONE_HASH, [1, 2, 3], None))
    fast = get_hash_fn("fast")((NONE_HASH, [1, 2, 3], None))
    assert len(sha) == 32 and isinstance(fast, bytes) and sha != fast
    # Lists and tuples are the same tokens.
    assert sha == get_hash_fn("sha256")((NONE_HASH, (1, 2, 3), None))
    with pytest.raises(ValueError, match="sha256"):
        get_hash_fn("md5")
    with pytest.raises(ValueError):
        get_request_block_hasher(0, get_hash_fn("sha256"))


@pytest.mark.parametrize("algo", ALGOS)
def test_hashes_are_stable_across_processes(algo: str) -> None:
    """The engine core runs in its own process: hashes must not depend on PYTHONHASHSEED."""
    code = (
        "from vllite.kv_cache import get_hash_fn, hash_block_tokens as h;"
        f"fn = get_hash_fn({algo!r}); print(h(fn, None, [1, 2, 3, 4], (('salt', 'abc'),)).hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    assert len(outs) == 1
