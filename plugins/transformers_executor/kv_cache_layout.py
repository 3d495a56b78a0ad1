"""How a model's attention layers share the KV-cache tensors: one group per kind of layer (vLLM's hybrid allocator).

A model whose layers all attend the same way (full attention, or one sliding window everywhere) has one KV-cache
group: every layer has its own ``[num_blocks, block_size, kv_heads, head_dim]`` tensors and a request has one block
table. A model that mixes sliding-window and full-attention layers (Gemma 2/3, gpt-oss, Qwen2 with
``max_window_layers``) is split into **groups of equal size**: the layers of each kind are cut into runs of ``n``
layers, ``n`` the count of the rarest kind (Gemma 3's 5:1 gives one full group and five sliding groups of ``L / 6``
layers each). There are only ``n`` tensor slots: layer ``j`` of every group uses slot ``j``. One block pool serves all
groups, and a block id belongs to one group at a time, so a block's memory is ``n`` layers' worth, and a request holds
one block table per group (the scheduler sends them interleaved, position ``k`` of group ``g`` at ``k * G + g``).
The sliding groups release the blocks that leave their window, so a long sequence costs about the full layers'
share of the KV memory instead of all of it. ``--disable-hybrid-kv-cache-manager`` keeps one group (every block in
every layer), vLLM's switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KVCacheLayout", "kv_cache_layout"]


@dataclass(frozen=True)
class KVCacheLayout:
    """The KV-cache groups of a model: ``windows[g]`` is group ``g``'s sliding window (``None``: full attention);
    ``layer_group[i]`` and ``layer_slot[i]`` are layer ``i``'s group and tensor slot; ``num_slots`` tensors are
    allocated. One group (``windows == ()``) is the plain layout: slot ``i`` for layer ``i``."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        """Block tables per request (1 for the plain layout)."""
        return max(1, len(self.windows))

    @classmethod
    def plain(cls, num_layers: int) -> KVCacheLayout:
        """One group: every layer its own tensors."""
        return cls((), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_cache_layout(hf_config: Any, num_layers: int, *, hybrid: bool = True) -> KVCacheLayout:
    """The layout of the model ``hf_config`` describes (see the module docstring); the plain one unless its
    ``layer_types`` mix sliding-window and full-attention layers and ``hybrid`` is on."""
    cfg = getattr(hf_config, "text_config", None) or hf_config
    kinds = list(getattr(cfg, "layer_types", None) or ())
    window = getattr(cfg, "sliding_window", None)
    if not hybrid or len(kinds) != num_layers or not isinstance(window, int) or window <= 0:
        return KVCacheLayout.plain(num_layers)
    windows_of = {"full_attention": None, "attention": None, "sliding_attention": window}
    layers: dict[int | None, list[int]] = {}
    for index, kind in enumerate(kinds):
        if kind not in windows_of:
            return KVCacheLayout.plain(num_layers)  # state layers are refused before this (architecture_guard)
        layers.setdefault(windows_of[kind], []).append(index)
    if len(layers) < 2:
        return KVCacheLayout.plain(num_layers)
    size = min(len(group) for group in layers.values())
    windows: list[int | None] = []
    layer_group, layer_slot = [0] * num_layers, [0] * num_layers
    for kind_window in sorted(layers, key=lambda w: (w is not None, w or 0)):  # full attention first
        members = layers[kind_window]
        for start in range(0, len(members), size):
            for slot, layer in enumerate(members[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(kind_window)
    return KVCacheLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
