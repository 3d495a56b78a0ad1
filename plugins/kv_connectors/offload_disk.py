"""The ``offload`` tier's optional second layer: KV blocks the host-memory LRU evicts, kept as files in a folder.

``{"offload_dir": PATH, "offload_disk_size_gib": N}`` in ``kv_connector_extra_config`` turn it on. Each engine
writes into a private folder it creates under ``PATH`` (removed at shutdown), one block per file in the
checksummed format of :mod:`.block_files`, so a truncated or corrupt file is a miss, never KV.

Bookkeeping (which names are on disk, the LRU order, the byte bound) happens on the caller's thread, at once; the
file I/O runs in order on one background thread, so a block is read only after its write has landed, and a file is
unlinked only after the reads queued before the unlink.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from vllite.plugins.kv_connectors.block_files import SUFFIX, read_block, write_block
from vllite.plugins.kv_connectors.errors import KVBlockFileError

logger = logging.getLogger(__name__)


class DiskTier:
    """A byte-bounded LRU of KV block files; promises that the files it holds never exceed ``capacity_bytes`` (of
    tensor data), that a file failing its checks is reported bad and never returned, and that :meth:`close` leaves
    no file behind."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix="vllite-offload-", dir=root))
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[str, int] = OrderedDict()  # name -> tensor bytes, least recently used first
        self.bytes_used = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllite-kv-offload-disk")
        self._lock = threading.Lock()
        self._bad: set[str] = set()  # names whose file failed a check or a write (the I/O thread adds them)
        self.num_blocks_written = 0
        self.num_blocks_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str) -> Path:
        return self.path / f"{name}{SUFFIX}"

    def put(self, name: str, block: torch.Tensor) -> list[str]:
        """Writes ``block`` (in the background) as the most recently used; returns the names evicted to stay within
        the bound (``name`` itself when the block is larger than the whole layer)."""
        size = block.numel() * block.element_size()
        if size > self.capacity_bytes:
            return [name]
        if name in self.files:
            self.files.move_to_end(name)
            return []
        self.files[name] = size
        self.bytes_used += size
        self._io.submit(self._write, name, block)
        evicted = []
        while self.bytes_used > self.capacity_bytes:
            old, old_size = self.files.popitem(last=False)
            self.bytes_used -= old_size
            self._io.submit(self._file(old).unlink, missing_ok=True)
            evicted.append(old)
        return evicted

    def _write(self, name: str, block: torch.Tensor) -> None:
        try:
            write_block(self._file(name), block)
            self.num_blocks_written += 1
        except OSError as exc:
            logger.warning("offload: cannot write block %s to %s: %s", name, self.path, exc)
            with self._lock:
                self._bad.add(name)

    def touch(self, name: str) -> None:
        """Marks ``name`` as the most recently used (a load is about to read it)."""
        self.files.move_to_end(name)

    def read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Future[torch.Tensor | None]:
        """The block, read after every write queued before; ``None`` (and the name reported bad) for a file that
        is missing, truncated or corrupt."""
        return self._io.submit(self._read, name, shape, dtype)

    def _read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        try:
            block = read_block(self._file(name), shape, dtype)
        except KVBlockFileError as exc:
            logger.warning("offload: %s; treated as a miss", exc)
            with self._lock:
                self._bad.add(name)
            return None
        self.num_blocks_read += 1
        return block

    def take_bad(self) -> list[str]:
        """Drops the names whose files failed since the previous call and returns them (they are gone)."""
        with self._lock:
            bad, self._bad = self._bad, set()
        gone = []
        for name in bad:
            size = self.files.pop(name, None)
            if size is not None:
                self.bytes_used -= size
                self._io.submit(self._file(name).unlink, missing_ok=True)
                gone.append(name)
        return gone

    def close(self) -> None:
        """Waits for the queued I/O, then removes the folder and everything in it."""
        self._io.shutdown(wait=True)
        shutil.rmtree(self.path, ignore_errors=True)
        self.files.clear()
        self.bytes_used = 0
