"""The experts a MoE model routes each token to (``--enable-return-routed-experts``, vLLM's flag): the top-k expert
ids of every MoE layer, returned with a finished request as ``CompletionOutput.routed_experts``.

transformers' MoE families route through a top-k router module (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``,
``GptOssTopKRouter``, ``DeepseekV3TopkRouter``, ...) whose output is ``(router_logits, weights, expert_ids)``; a
forward hook on each keeps ``expert_ids`` (``[tokens, top_k]``) of the step. Like vLLM, the ids are also kept per KV
slot (``[slots, moe_layers, top_k]``, int16), so a request that starts on cached blocks (a prefix-cache hit, a
resumed session or preempted request) gets the routing of the positions it did not compute from the request that
did. Each step hands the scheduler, per request, the rows of the positions it covers and where they start
(``(start, rows)``); the scheduler keeps them (``vllite.sched.routed_experts``) and attaches the whole
``[positions, moe_layers, top_k]`` array to the request's finishing output. Positions are every computed one: the
prompt and all generated tokens but the last (which is sampled, never run through the model). A slot whose block a
sliding window released reads as ``-1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllite.exceptions import ModelLoadError

__all__ = ["RoutedExpertsRecorder", "find_routers"]


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k router modules, in the order its layers run them."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


class RoutedExpertsRecorder:
    """Keeps the expert ids the model's routers pick in each step and per KV slot (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, architecture: str) -> None:
        routers = find_routers(model)
        if not routers:
            raise ModelLoadError(
                f"--enable-return-routed-experts needs a MoE model with top-k routers; {architecture} has none."
            )
        self.num_layers = len(routers)
        self.top_k = int(getattr(routers[0], "top_k", 0) or 0)
        self._step: list[torch.Tensor] = []
        self._active = False
        self._slots = np.full((0, self.num_layers, max(self.top_k, 1)), -1, dtype=np.int16)
        self._forward: tuple[np.ndarray, list[str], np.ndarray, np.ndarray] | None = None
        for router in routers:
            router.register_forward_hook(self._capture)

    def _capture(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active and isinstance(output, tuple) and len(output) == 3:
            self._step.append(output[2])

    def allocate(self, num_slots: int) -> None:
        """A slot table for a KV cache of ``num_slots`` token slots (all ``-1``); never smaller than it was, so
        the small temporary caches of start-up's dummy forwards leave it alone."""
        if num_slots > len(self._slots):
            self._slots = np.full((num_slots, self.num_layers, max(self.top_k, 1)), -1, dtype=np.int16)

    def begin_step(self) -> None:
        """Starts capturing one engine step's forward (dummy forwards are never captured)."""
        self._step, self._active, self._forward = [], True, None

    def end_forward(self, slot_mapping: torch.Tensor, req_ids: list[str], computed: np.ndarray, qsl: Any) -> None:
        """Stores the step's ids at their KV slots (``slot_mapping``, group 0's), and what ``collect`` needs: the
        rows' requests, their computed tokens before the step and their query offsets."""
        self._active = False
        if len(self._step) != self.num_layers:
            return  # a forward that skipped the model (none do for a MoE model): nothing to report
        ids = torch.stack(self._step, dim=1).to(torch.int16).cpu().numpy()  # [tokens, layers, top_k]
        slots = slot_mapping.cpu().numpy()
        valid = slots >= 0
        self._slots[slots[valid]] = ids[valid]
        self._forward = (ids, list(req_ids), computed.copy(), np.asarray(qsl))

    def collect(self, new_req_ids: set[str], table: np.ndarray, block_size: int, num_groups: int) -> dict[str, Any]:
        """``req_id -> (start, rows)`` for the step: the rows of the positions computed, and for a request scheduled
        anew on cached positions, those first (read from their slots through ``table``, the rows' interleaved block
        tables, group 0 at every ``num_groups``-th column)."""
        if self._forward is None:
            return {}
        ids, req_ids, computed, qsl = self._forward
        result: dict[str, Any] = {}
        for row, req_id in enumerate(req_ids):
            rows, start = ids[qsl[row] : qsl[row + 1]], int(computed[row])
            if start and req_id in new_req_ids:
                positions = np.arange(start)
                blocks = table[row, (positions // block_size) * num_groups].astype(np.int64)
                kept = self._slots[blocks * block_size + positions % block_size]
                cached = np.where((blocks > 0)[:, None, None], kept, -1).astype(np.int16)
                rows, start = np.concatenate([cached, rows]), 0
            result[req_id] = (start, rows)
        return result
