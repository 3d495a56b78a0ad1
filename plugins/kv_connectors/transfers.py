"""What a block-copying connector's worker moves: a request's blocks, one step's loads and saves, and the
per-layer copies of a save."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from vllite.kv_connector.base import KVConnectorMetadata

if TYPE_CHECKING:
    import torch

_Metadata = TypeVar("_Metadata", bound="BlockTransferMetadata")


@dataclass
class BlockTransfer:
    """Blocks of one request to move: ``block_ids[i]`` of the paged cache <-> the store's block ``names[i]``."""

    req_id: str
    block_ids: list[int]
    names: list[str]


@dataclass
class BlockTransferMetadata(KVConnectorMetadata):
    """One step's work for a block-copying connector's worker: blocks to load from its store, blocks to save to it.
    Each connector subclasses it, so that its worker acts on its own metadata only."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    @classmethod
    def bound(cls: type[_Metadata], metadata: KVConnectorMetadata | None) -> _Metadata:
        """``metadata`` when it is one of ``cls``, else an empty ``cls`` (no step, or nothing for this connector)."""
        return metadata if isinstance(metadata, cls) else cls()


@dataclass
class PendingSave:
    """A save being gathered layer by layer during a forward pass."""

    transfer: BlockTransfer
    layers: list[torch.Tensor | None] = field(default_factory=list)  # per layer: [2, n, block_size, heads, dim]
