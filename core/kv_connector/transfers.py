"""What a block-copying connector's worker moves: a request's blocks, and the per-layer copies of a save."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BlockTransfer:
    """Blocks of one request to move: ``block_ids[i]`` of the paged cache <-> the store's block ``names[i]``."""

    req_id: str
    block_ids: list[int]
    names: list[str]


@dataclass
class PendingSave:
    """A save being gathered layer by layer during a forward pass."""

    transfer: BlockTransfer
    layers: list[torch.Tensor | None] = field(default_factory=list)  # per layer: [2, n, block_size, heads, dim]
