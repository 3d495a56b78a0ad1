"""Chained block hashes for prefix caching.

The hash of full block ``i`` covers the hash of block ``i - 1``, the block's token ids and its extra keys, so
equal hashes mean equal *prefixes*, not just equal blocks, and a lookup can stop at the first miss. The first
block chains from the fixed ``NONE_HASH``. Partial blocks are never hashed. With several KV-cache groups, each
group caches under its own keys (``group_block_hashes``).

Two algorithms (``--prefix-caching-hash-algo``):

- ``sha256``: SHA-256 over a canonical msgpack encoding of ``(parent_hash, token_ids, extra_keys)``; collision
  resistant and stable across processes, machines and Python versions.
- ``fast``: xxHash-128 over the same encoding when the ``xxhash`` package is installed; otherwise CPython's
  64-bit tuple hash over integers only (so it does not depend on ``PYTHONHASHSEED``). Neither is
  collision resistant; use it when every block hash counts and requests are trusted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import msgspec

if TYPE_CHECKING:
    from vllite.request import Request

HashFn = Callable[[Any], bytes]

#: The parent hash of every request's first block: a fixed seed, identical in every process.
NONE_HASH: bytes = hashlib.sha256(b"vllite.kv_cache.NONE_HASH").digest()

_encode = msgspec.msgpack.Encoder().encode


def sha256_hash(obj: Any) -> bytes:
    """SHA-256 of the canonical msgpack encoding of ``obj`` (tuples and lists encode alike)."""
    return hashlib.sha256(_encode(obj)).digest()


try:  # pragma: no cover - depends on the environment
    import xxhash

    def fast_hash(obj: Any) -> bytes:
        """xxHash-128 of the canonical msgpack encoding of ``obj``; fast, not collision resistant."""
        return xxhash.xxh3_128_digest(_encode(obj))

except ImportError:

    def fast_hash(obj: Any) -> bytes:
        """CPython's 64-bit tuple hash of ``(parent, token_ids, extra_keys)``; fast, not collision resistant.

        Only integers go into the builtin hash (bytes and strings are turned into integers first), because
        the builtin hash of ``str``/``bytes`` changes with ``PYTHONHASHSEED`` while that of ints and tuples of
        ints does not.
        """
        parent, token_ids, extra_keys = obj
        extra = 0 if extra_keys is None else int.from_bytes(sha256_hash(extra_keys)[:16], "little")
        value = hash((int.from_bytes(parent, "little"), tuple(token_ids), extra))
        return value.to_bytes(8, "little", signed=True)


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256_hash, "fast": fast_hash}


def get_hash_fn(name: str) -> HashFn:
    """The hash function for ``--prefix-caching-hash-algo`` ``name`` (``"sha256"`` or ``"fast"``)."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(
            f"Unknown prefix-caching hash algorithm {name!r}; choose one of {sorted(_HASH_FNS)}."
        ) from None


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """The hash of one full block, chained from its parent's hash (``NONE_HASH`` for the first block)."""
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    if not isinstance(curr_block_token_ids, (list, tuple)):
        curr_block_token_ids = tuple(curr_block_token_ids)
    return hash_fn((parent_block_hash, curr_block_token_ids, extra_keys))


def generate_block_hash_extra_keys(request: Request, start_token_idx: int) -> tuple[Any, ...] | None:
    """What besides the tokens decides a block's KV: the LoRA adapter, and the cache salt (first block only).

    Keys are tagged so that a salt can never be mistaken for an adapter name. Salting the first block is
    enough: every later hash chains from it.
    """
    keys: list[tuple[str, str]] = []
    lora_name = getattr(request, "lora_name", None)
    if lora_name:
        keys.append(("lora", lora_name))
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt and start_token_idx == 0:
        keys.append(("salt", cache_salt))
    return tuple(keys) if keys else None


def prompt_embeds_key(embeds: Any, start: int, end: int) -> tuple[str, bytes]:
    """The extra key of the prompt-embeds rows ``[start, end)`` of a block: a SHA-256 of their dtype and bytes
    (vLLM hashes the embeddings too: placeholder token ids alone would share blocks between different prompts).
    Something that is not a tensor gets a key no other block has (``check_request`` rejects its request)."""
    import torch

    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 2 or embeds.layout != torch.strided:
        return ("embeds", hashlib.sha256(repr(id(embeds)).encode()).digest())
    rows = embeds[start:end].detach().contiguous()
    digest = hashlib.sha256(str(rows.dtype).encode())
    digest.update(rows.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return ("embeds", digest.digest())


def get_request_block_hasher(block_size: int, hash_fn: HashFn) -> Callable[[Request], list[bytes]]:
    """A ``Request`` block hasher: called after tokens are appended, it returns the hashes of the blocks that
    became full since the last call (``request.block_hashes`` holds the earlier ones), so every full block is
    hashed exactly once and partial blocks never are.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def request_block_hasher(request: Request) -> list[bytes]:
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        token_ids = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        # The extra keys only depend on whether the block is the first one.
        later_keys = generate_block_hash_extra_keys(request, block_size)
        new_hashes: list[bytes] = []
        embeds = getattr(request, "prompt_embeds", None)
        while start + block_size <= num_tokens:
            end = start + block_size
            extra = later_keys if start else generate_block_hash_extra_keys(request, 0)
            if embeds is not None and start < request.num_prompt_tokens:
                extra = (*(extra or ()), prompt_embeds_key(embeds, start, min(end, request.num_prompt_tokens)))
            parent = hash_block_tokens(hash_fn, parent, token_ids[start:end], extra)
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher


class GroupBlockHashes(Sequence[bytes]):
    """KV-cache group ``group``'s keys for a request's block hashes: each hash followed by the group's 4-byte
    suffix. The same tokens cached by two groups are two blocks (different layers' KV), so they need two keys; a
    suffixed key is longer than any plain hash of the same algorithm, and the suffixes of two groups differ, so
    keys never collide across groups. A view, not a copy: making one is O(1), each read one concatenation, and
    it follows the request's hash list as it grows.
    """

    __slots__ = ("_hashes", "_suffix")

    def __init__(self, hashes: Sequence[bytes], group: int) -> None:
        self._hashes = hashes
        self._suffix = group.to_bytes(4, "little")

    def __len__(self) -> int:
        return len(self._hashes)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return [block_hash + self._suffix for block_hash in self._hashes[index]]
        return self._hashes[index] + self._suffix


def group_block_hashes(hashes: Sequence[bytes], group: int) -> Sequence[bytes]:
    """The prefix-cache keys of KV-cache group ``group``: the hashes themselves for group 0 (so a model with one
    group caches exactly as before), a :class:`GroupBlockHashes` view for any other group."""
    return hashes if group == 0 else GroupBlockHashes(hashes, group)
