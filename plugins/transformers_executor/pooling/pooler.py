"""The pooler: from one step's hidden states to each finished prompt's pooled output.

A prompt may run in several chunks (chunked prefill on a decoder): the pooler keeps what each pooling type needs
between them — the first token (CLS), a running sum (MEAN), every row (ALL, STEP) — and pools when the prompt's
last chunk has run. Vector tasks (``embed``, ``classify``, ``score``) pool with the model's pooling type; token
tasks (``token_embed``, ``token_classify``) keep every position (STEP keeps the ``step_tag_id`` positions).

Then per request: an embedding keeps its first ``dimensions`` and is L2-normalized; a classification model's head
turns pooled states into logits, and ``use_activation`` applies softmax (sigmoid for a single label).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllite.plugins.transformers_executor.pooling.setup import PoolingSetup
from vllite.pooling_params import PoolingParams

_VECTOR_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingRow:
    """One request's part of the step: its rows ``start : start + length`` of the hidden states, the prompt
    positions they hold (from ``num_computed``), and the request's prompt and parameters."""

    req_id: str
    start: int
    length: int
    num_computed: int
    prompt_token_ids: list[int]
    params: PoolingParams

    @property
    def completes_prompt(self) -> bool:
        return self.num_computed + self.length >= len(self.prompt_token_ids)


class ClassificationHead:
    """A ``*ForSequenceClassification`` model's head on pooled hidden states ``[N, hidden]`` → logits
    ``[N, num_labels]``: a decoder's ``score`` layer; a BERT-style ``classifier`` after the encoder's pooler
    (dense + tanh), or a RoBERTa-style head that takes the sequence (its first position)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.score = getattr(model, "score", None)
        self.classifier = getattr(model, "classifier", None)
        self.bert_pooler = getattr(getattr(model, "base_model", None), "pooler", None)
        if self.score is None and self.classifier is None:
            raise ValueError(f"{type(model).__name__} has neither a `score` nor a `classifier` head to classify with.")

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        if self.score is not None:
            return self.score(states)
        assert self.classifier is not None
        if isinstance(self.classifier, torch.nn.Linear):
            if self.bert_pooler is not None:
                states = self.bert_pooler(states.unsqueeze(1))
            return self.classifier(states)
        return self.classifier(states.unsqueeze(1))


class Pooler:
    """Pools the requests of each step (see the module docstring); keeps per-request partial state between a
    prompt's chunks."""

    def __init__(self, setup: PoolingSetup, pooling_type: str, head: ClassificationHead | None, hidden_size: int,
                 matryoshka: tuple[int, ...] | None) -> None:  # fmt: skip
        self.setup = setup
        self.pooling_type = pooling_type
        self.head = head
        self.hidden_size = hidden_size
        self.matryoshka = matryoshka
        self._partial: dict[str, Any] = {}

    def forget(self, req_id: str) -> None:
        """Drops a request's partial state (it finished, was aborted or will recompute)."""
        self._partial.pop(req_id, None)

    def step(self, hidden: torch.Tensor, rows: list[PoolingRow]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Pools every row whose prompt completes this step; returns ``(pooled, failed)`` by request id."""
        pooled: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        for row in rows:
            task = row.params.task or self.setup.supported_tasks[0]
            states = self._collect(hidden, row, token_task=task.startswith("token_"))
            if states is None:
                continue
            try:
                pooled[row.req_id] = self._finish(states, row, task).float().cpu()
            except (ValueError, IndexError) as exc:
                failed[row.req_id] = f"pooling failed: {exc}"
        return pooled, failed

    # ------------------------------------------------------------------ gathering the states
    def _collect(self, hidden: torch.Tensor, row: PoolingRow, token_task: bool) -> torch.Tensor | None:
        """This row's contribution; the pooled states ``[hidden]`` / ``[tokens, hidden]`` once its prompt is
        complete, else ``None``."""
        kind = ("STEP" if self.pooling_type == "STEP" else "ALL") if token_task else self.pooling_type
        chunk = hidden[row.start : row.start + row.length].float()
        if row.num_computed == 0:
            self._partial.pop(row.req_id, None)  # a fresh start (or a recompute after preemption)
        done = row.completes_prompt
        if kind == "LAST":
            return chunk[-1] if done else None
        if kind == "CLS":
            if row.num_computed == 0:
                self._partial[row.req_id] = chunk[0]
            return self._partial.pop(row.req_id) if done else None
        if kind == "MEAN":
            total = chunk.sum(dim=0) + self._partial.get(row.req_id, 0)
            if not done:
                self._partial[row.req_id] = total
                return None
            self._partial.pop(row.req_id, None)
            return total / len(row.prompt_token_ids)
        parts = self._partial.setdefault(row.req_id, [])
        parts.append(chunk)
        if not done:
            return None
        del self._partial[row.req_id]
        return torch.cat(parts)

    # ------------------------------------------------------------------ per-request post-processing
    def _finish(self, states: torch.Tensor, row: PoolingRow, task: str) -> torch.Tensor:
        params = row.params
        use_activation = self.setup.use_activation if params.use_activation is None else params.use_activation
        if self.setup.kind == "classify":
            assert self.head is not None
            logits = self.head(states.to(self._head_dtype())).float()
            if task == "token_classify":
                return self._step_select(_activate(logits, use_activation), row)
            return _activate(logits, use_activation)
        out = self._step_select(states, row) if task == "token_embed" else states
        dims = params.dimensions if params.dimensions is not None else self.setup.dimensions
        if dims is not None:
            self.check_dimensions(dims)
            out = out[..., :dims]
        normalize = self.setup.normalize if params.normalize is None else params.normalize
        return F.normalize(out, dim=-1) if normalize else out

    def check_dimensions(self, dims: int) -> None:
        """Raises ``ValueError`` unless the model can return embeddings of ``dims`` dimensions."""
        if self.matryoshka is None:
            if dims != self.hidden_size:
                raise ValueError(f"this model does not support `dimensions` (Matryoshka embeddings); got {dims}.")
        elif dims not in self.matryoshka:
            raise ValueError(f"`dimensions` {dims} is not one of the model's {list(self.matryoshka)}.")

    def _step_select(self, per_token: torch.Tensor, row: PoolingRow) -> torch.Tensor:
        """STEP pooling: the rows at the ``step_tag_id`` positions and the ``returned_token_ids`` columns."""
        if self.pooling_type != "STEP":
            return per_token
        params = row.params
        tag = params.step_tag_id if params.step_tag_id is not None else self.setup.step_tag_id
        returned = params.returned_token_ids or self.setup.returned_token_ids
        if returned:
            per_token = per_token[:, list(returned)]
        if tag is not None:
            positions = [i for i, token in enumerate(row.prompt_token_ids) if token == tag]
            per_token = per_token[positions]
        return per_token

    def _head_dtype(self) -> torch.dtype:
        assert self.head is not None
        layer = self.head.score if self.head.score is not None else self.head.classifier
        return next(layer.parameters()).dtype  # type: ignore[union-attr]


def _activate(logits: torch.Tensor, use_activation: bool) -> torch.Tensor:
    if not use_activation:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
