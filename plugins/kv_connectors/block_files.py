"""One KV block per safetensors file: the on-disk format of the ``shared-storage`` connector.

A file holds tensor ``kv`` of shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (every layer's keys
and values of one block) and, in the safetensors metadata, the format tag, the tensor's shape and dtype and the
SHA-256 of its bytes. Files are named by the hash chain of the block-aligned prompt prefix that ends with the
block, so a prefix of ``k`` blocks is stored when the files of its ``k`` chain hashes all exist.

Writes are atomic (a temporary file in the same folder, then ``os.replace``), so a reader never sees a
half-written file under its final name. Reading checks everything it can: :func:`is_complete` (cheap, for the
scheduler: the header parses and the file is exactly as long as the header says) and :func:`read_block`
(the worker: shape, dtype and checksum); a file that fails is a ``KVBlockFileError``, never KV.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import torch

from vllite.plugins.kv_connectors.errors import KVBlockFileError

FORMAT = "vllite-kv-block/1"
TENSOR = "kv"
SUFFIX = ".safetensors"


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes (any dtype)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.data).hexdigest()


def write_block(path: Path, kv: torch.Tensor, extra: dict[str, str] | None = None) -> None:
    """Writes ``kv`` (on any device) to ``path`` atomically, with its checksum, shape and dtype in the metadata."""
    from safetensors.torch import save

    kv = kv.detach().to("cpu").contiguous()
    metadata = {
        "format": FORMAT,
        "sha256": tensor_digest(kv),
        "shape": json.dumps(list(kv.shape)),
        "dtype": str(kv.dtype),
        **(extra or {}),
    }
    data = save({TENSOR: kv}, metadata=metadata)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _parse_header(raw: bytes, file_size: int, path: Path) -> dict[str, Any]:
    """The safetensors header of a file of ``file_size`` bytes whose first bytes are ``raw``; checks that the
    file holds exactly the one tensor, complete."""
    if len(raw) < 8:
        raise KVBlockFileError(f"{path}: truncated ({file_size} bytes, no safetensors header).")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > 1 << 20 or len(raw) < 8 + header_len:
        raise KVBlockFileError(f"{path}: truncated or not a safetensors file (header of {header_len} bytes).")
    try:
        header = json.loads(raw[8 : 8 + header_len])
        entry = header[TENSOR]
        begin, end = entry["data_offsets"]
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KVBlockFileError(f"{path}: unreadable header ({type(exc).__name__}: {exc}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise KVBlockFileError(f"{path}: not a {FORMAT} file.")
    if begin != 0 or 8 + header_len + end != file_size:
        raise KVBlockFileError(f"{path}: {file_size} bytes, but the header describes {8 + header_len + end}.")
    return header


def is_complete(path: Path) -> bool:
    """Whether ``path`` exists and is a whole block file (header and length; the checksum is the reader's)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) == 8:
                head += f.read(min(struct.unpack("<Q", head)[0], 1 << 20))
        _parse_header(head, size, path)
    except (OSError, KVBlockFileError):
        return False
    return True


def read_block(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``kv`` tensor of ``path`` (on the CPU), after checking its length, shape, dtype and checksum.

    Raises ``KVBlockFileError`` (naming the file and what is wrong) for a missing, truncated or corrupt file, or
    one written by a model with another KV layout.
    """
    from safetensors.torch import load

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KVBlockFileError(f"{path}: cannot be read ({exc}).") from None
    header = _parse_header(raw, len(raw), path)
    meta = header["__metadata__"]
    if meta.get("shape") != json.dumps(list(shape)) or meta.get("dtype") != str(dtype):
        raise KVBlockFileError(
            f"{path}: holds {meta.get('dtype')} KV of shape {meta.get('shape')}; "
            f"this engine needs {dtype} {list(shape)}."
        )
    try:
        kv = load(raw)[TENSOR]
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise KVBlockFileError(f"{path}: unreadable ({type(exc).__name__}: {exc}).") from None
    if tuple(kv.shape) != tuple(shape) or kv.dtype != dtype:
        raise KVBlockFileError(f"{path}: tensor is {kv.dtype} {list(kv.shape)}, its metadata says otherwise.")
    if tensor_digest(kv) != meta.get("sha256"):
        raise KVBlockFileError(f"{path}: checksum mismatch (the file is corrupt).")
    return kv
