"""The completions API's ``prompt_embeds`` field (``--enable-prompt-embeds``), as vLLM reads it.

Each value is a base64 string of a ``torch.save``d tensor ``[num_tokens, hidden_size]`` (a leading batch dimension of
one is dropped). It is loaded with ``torch.load(..., weights_only=True)`` (tensors and plain containers only: no
code from the request runs) under torch's sparse-tensor invariant checks, made dense, and checked against the
model (2-D, floating point, the model's hidden size, not empty, within the context). Every problem is an HTTP 400
naming ``prompt_embeds``. The embeds prompts come first in the batch, then the ``prompt`` prompts (none when
``prompt`` is missing or ``""``), as vLLM orders them.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from vllite.engine.request_checks import check_prompt_embeds
from vllite.plugins.openai_server.http_errors import BadRequestError
from vllite.protocol import EngineInfo

__all__ = ["load_prompt_embeds"]


def load_prompt_embeds(
    data: str | list[str], info: EngineInfo, truncate_prompt_tokens: int | None = None
) -> list[dict[str, Any]]:
    """One ``{"prompt_embeds": tensor}`` engine prompt per base64 value of ``data``, in order; ``BadRequestError``
    (``param="prompt_embeds"``) naming what is wrong."""
    if not info.enable_prompt_embeds:
        raise BadRequestError("You must set `--enable-prompt-embeds` to input `prompt_embeds`.", param="prompt_embeds")
    values = [data] if isinstance(data, str) else list(data)
    if not values:
        raise BadRequestError("prompt_embeds must not be an empty list.", param="prompt_embeds")
    prompts = []
    for value in values:
        embeds = _load_one(value)
        if truncate_prompt_tokens is not None and embeds.ndim == 2:
            embeds = embeds[-(info.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens) :]
        try:
            check_prompt_embeds("Invalid prompt_embeds:", embeds, info)
        except ValueError as exc:
            raise BadRequestError(str(exc), param="prompt_embeds") from None
        prompts.append({"prompt_embeds": embeds.contiguous()})
    return prompts


def _load_one(value: str) -> Any:
    """The tensor of one base64 value, dense and at most 2-D when it had a leading dimension of one."""
    import torch

    try:
        payload = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequestError(f"prompt_embeds is not valid base64: {exc}.", param="prompt_embeds") from None
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(payload), weights_only=True, map_location=torch.device("cpu"))
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to_dense()
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        reason = (str(exc).strip() or type(exc).__name__)[:200]
        raise BadRequestError(
            f"prompt_embeds could not be loaded as a torch.save'd tensor: {reason}", param="prompt_embeds"
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise BadRequestError(
            f"prompt_embeds must hold a torch.Tensor, got {type(tensor).__name__}.", param="prompt_embeds"
        )
    if tensor.ndim > 2 and tensor.shape[0] == 1:
        tensor = tensor.squeeze(0)
    return tensor
