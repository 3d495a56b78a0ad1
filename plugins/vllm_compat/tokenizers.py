"""``cached_tokenizer_from_config``: the model's tokenizer, loaded once per process, as vLLM plugins ask for it."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _cached_tokenizer(path: str, trust_remote_code: bool) -> Any:
    from vllite.engine.tokenizer import get_tokenizer

    return get_tokenizer(path, trust_remote_code=trust_remote_code)


def cached_tokenizer_from_config(model_config: Any, **kwargs: Any) -> Any:
    """The tokenizer of ``model_config`` (``vllm_config.model_config``), or ``None`` with ``skip_tokenizer_init``.

    Loaded from the local tokenizer folder (``model_config.tokenizer``, else the model folder) once per process
    and shared; with extra keyword arguments (passed to transformers' ``AutoTokenizer``) a new one is loaded.
    """
    if getattr(model_config, "skip_tokenizer_init", False):
        return None
    path = getattr(model_config, "tokenizer", None) or model_config.model
    trust_remote_code = bool(getattr(model_config, "trust_remote_code", False))
    if kwargs:
        from vllite.engine.tokenizer import get_tokenizer

        return get_tokenizer(path, trust_remote_code=trust_remote_code, **kwargs)
    return _cached_tokenizer(str(path), trust_remote_code)
