"""The KV connectors' errors: a stored block that cannot be read, a load that failed, a peer that could not send."""

from __future__ import annotations

from vllite.exceptions import VlliteError


class KVBlockFileError(VlliteError):
    """A stored KV block file is missing, truncated, corrupt (checksum mismatch) or of another KV layout: the
    connector treats it as a miss (or reports its blocks as failed loads), never loads it as KV."""


class KVLoadError(VlliteError):
    """A KV connector could not load a request's external KV (it reported the blocks as failed) and
    ``kv_load_failure_policy`` is ``fail``: the request ends with ``FinishReason.ERROR`` carrying this message."""


class P2PTransferError(VlliteError):
    """The ``p2p`` connector's fetch of a request's KV from its producer failed (unreachable, timed out,
    refused or malformed): the blocks are reported as failed loads, handled per ``kv_load_failure_policy``."""
