"""The lockstep data-parallel engines' all-reduce: "does any engine still have unfinished requests?".

A stateless gloo process group over TCP (a ``TCPStore`` served by rank 0 at the address the client chose), not
torch's default group, so nothing else in the process is affected. ``any_unfinished`` sums one flag per engine.
If a peer dies, the collective fails (at the latest after ``timeout_s``) and so does this engine: in lockstep the
engines stand or fall together, as MoE expert-parallel ranks do.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

#: ``plugin_config["engine_proc"]`` key the client sets: ``host:port`` of the group's store.
GROUP_ADDRESS_KEY = "dp_group_address"
DEFAULT_TIMEOUT_S = 60.0


def free_group_address(host: str = "127.0.0.1") -> str:
    """``host:port`` with a port free right now, for rank 0's store."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return f"{host}:{probe.getsockname()[1]}"


class DPGroup:
    """One engine's membership of the lockstep group (rank ``rank`` of ``size``)."""

    def __init__(self, address: str, rank: int, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size = rank, size
        self._store = dist.TCPStore(host, int(port), size, rank == 0, timeout=timeout)
        self._group: Any = dist.ProcessGroupGloo(self._store, rank, size, timeout)
        self.num_all_reduces = 0

    def any_unfinished(self, local_unfinished: bool) -> bool:
        """True when any engine of the group has unfinished (schedulable) requests; every rank must call it."""
        import torch

        flags = torch.tensor([1 if local_unfinished else 0], dtype=torch.int64)
        self._group.allreduce([flags]).wait()
        self.num_all_reduces += 1
        return bool(flags.item())
