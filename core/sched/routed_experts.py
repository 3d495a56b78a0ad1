"""The expert ids a MoE model routed each position of a request to (``--enable-return-routed-experts``), kept by
the scheduler from step to step and sent with the request's finishing output.

Each step the model runner reports, per request, ``(start, rows)``: the ids of the positions from ``start`` on that
it computed (or, for a request scheduled anew on cached blocks, read from those blocks' slots), ``[positions,
moe_layers, top_k]``. A request that recomputes (preempted, or a session resumed on released blocks) reports from an
earlier ``start`` again, so what was kept from there on is dropped first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllite.request import Request


def record_routing(request: Request, start: int, rows: Any) -> None:
    """Keeps ``rows`` as the ids of ``request``'s positions ``start`` and on."""
    kept = request.routed_experts
    num_kept = sum(len(part) for part in kept)
    if start < num_kept:
        import numpy as np

        kept[:] = [np.concatenate(kept)[:start]] if start else []
    kept.append(rows)


def take_routing(request: Request) -> Any:
    """The ids of every position kept, ``[positions, moe_layers, top_k]`` (``None`` when none were reported)."""
    import numpy as np

    kept, request.routed_experts = request.routed_experts, []
    return np.concatenate(kept) if kept else None
