"""Model and tokenizer arguments to local folders: a folder as it is, a Hub id (``org/name``, not a local folder)
as its snapshot folder in ``huggingface_hub``'s cache, downloaded there unless it already is.

Only what the engine reads is downloaded: ``*.json`` (config, generation config, tokenizer config, weight index),
the weights as safetensors (PyTorch ``*.bin`` only when the repository has no safetensors; never ``*.pt``,
``*.gguf``, ONNX or ``original/``), and the tokenizer files (``*.model``, ``*.txt`` such as ``merges.txt``,
``*.tiktoken``, ``*.jinja`` chat templates); ``*.py`` too with ``trust_remote_code``. A tokenizer-only argument gets
the configs and tokenizer files, no weights.

Environment, read at each call: ``HF_HUB_OFFLINE`` (the cache only), ``HF_ENDPOINT``, ``HF_TOKEN`` (read by
``huggingface_hub``); the cache is ``download_dir`` (vLLM's ``--download-dir``), else ``HF_HUB_CACHE`` / ``HF_HOME``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vllite.plugins.hf_hub.errors import HubRequest, hub_error

logger = logging.getLogger(__name__)

#: What every snapshot holds: configs (incl. generation config and weight index) and the tokenizer files.
CONFIG_AND_TOKENIZER_PATTERNS = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja")
#: Weights in order of preference: the first kind the repository has is downloaded, no other.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
#: Never downloaded: Meta's original checkpoints beside the transformers ones (``original/params.json``, ...).
IGNORE_PATTERNS = ("original/*",)
_TRUE = ("1", "true", "yes", "on")


def resolve_model_paths(model: str, tokenizer: str | None, args: Any) -> tuple[str, str]:
    """``(model folder, tokenizer folder)`` for the ``EngineArgs`` ``args``: a local folder as given, a Hub id as
    its snapshot folder in the Hugging Face cache (downloaded once; ``args.revision``, ``args.download_dir``).

    The tokenizer is ``tokenizer`` (default: the model) at ``args.tokenizer_revision`` (default: ``revision``); the
    model's own folder when both are the model's. ``ModelLoadError`` names the argument that cannot be resolved.
    """
    revision = args.revision
    model_path = resolve_path(model, kind="model", revision=revision, args=args)
    tokenizer_name = tokenizer or model
    tokenizer_revision = args.tokenizer_revision or revision
    if tokenizer_name == model and tokenizer_revision == revision:
        return model_path, model_path
    return model_path, resolve_path(tokenizer_name, kind="tokenizer", revision=tokenizer_revision, args=args)


def resolve_path(name: str, *, kind: str, revision: str | None, args: Any) -> str:
    """The snapshot folder of ``name`` when it is a Hub id (``org/name``) and not a local folder, else ``name`` as
    it is (a folder; or a name that the engine parts report missing, or that a model-free executor ignores).
    ``ModelLoadError`` when the download fails."""
    if os.path.isdir(name) or not is_repo_id(name):
        return name
    return download_snapshot(
        name,
        kind=kind,
        revision=revision,
        download_dir=getattr(args, "download_dir", None),
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
    )


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id with its owner, ``org/name``. A bare ``name`` is taken
    for a folder (such as the ``sim`` of a simulated engine), never looked up: the Hub's few owner-less legacy ids
    have ``org/name`` aliases (``openai-community/gpt2``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1 or name.startswith((".", "~", "/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download_snapshot(
    repo_id: str, *, kind: str, revision: str | None, download_dir: str | None, trust_remote_code: bool
) -> str:
    """The local snapshot folder of ``repo_id`` at ``revision`` holding the files the engine reads (see the module
    docstring), downloaded into the cache unless already there; ``ModelLoadError`` when that fails."""
    from huggingface_hub import constants

    request = HubRequest(
        repo_id=repo_id,
        kind=kind,
        revision=revision,
        cache_dir=str(Path(download_dir or constants.HF_HUB_CACHE).expanduser()),
        endpoint=(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"),
        offline=hub_offline(),
    )
    try:
        return _download(request, trust_remote_code)
    except Exception as exc:
        error = hub_error(exc, request)
        if error is None:
            raise
        raise error from exc


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, or as ``huggingface_hub`` read it at import."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.strip().lower() in _TRUE for flag in flags) or bool(constants.HF_HUB_OFFLINE)


def _download(request: HubRequest, trust_remote_code: bool) -> str:
    """Resolves the revision to a commit once, then downloads the configs and tokenizer files with the first kind
    of weights the commit has (a tokenizer: no weights)."""
    from huggingface_hub import HfApi, snapshot_download

    api = HfApi(endpoint=request.endpoint)
    commit = api.resolve_revision(
        request.repo_id, revision=request.revision, cache_dir=request.cache_dir, local_files_only=request.offline
    )
    base = [*CONFIG_AND_TOKENIZER_PATTERNS, *(["*.py"] if trust_remote_code else [])]
    if request.offline:
        logger.info("Using %s from the Hugging Face cache %s (offline)", request.what, request.cache_dir)
    else:
        logger.info("Fetching %s (commit %s) from %s", request.what, commit.resolved, request.endpoint)
    folder = ""
    for weights in WEIGHT_PATTERNS if request.kind == "model" else ("",):
        folder = snapshot_download(
            request.repo_id,
            revision=commit,
            cache_dir=request.cache_dir,
            endpoint=request.endpoint,
            local_files_only=request.offline,
            allow_patterns=[*base, weights] if weights else base,
            ignore_patterns=list(IGNORE_PATTERNS),
        )
        if not weights or any(Path(folder).rglob(weights)):
            break
    return folder
