"""Reading a local model folder's own files: ``config.json`` and ``generation_config.json``.

Both are plain reads of immutable files, used by the frontend and the executor alike; nothing here imports
torch, and transformers only when ``config.json`` is actually read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllite.exceptions import ModelLoadError


def load_hf_config(path: str | None, *, trust_remote_code: bool = False) -> Any:
    """Reads ``config.json`` of a local model folder; ``ModelLoadError`` if the folder or config is missing."""
    if not path:
        raise ModelLoadError("No model given: pass a local model folder (config.json + safetensors weights).")
    if not os.path.isdir(path):
        raise ModelLoadError(f"Model folder {path!r} does not exist (vllite loads local folders only).")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"Model folder {path!r} has no config.json, so it is not a transformers model folder.")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:  # malformed config, unknown model_type, remote code refused ...
        raise ModelLoadError(f"Cannot read the model config in {path!r}: {exc}") from exc


def load_generation_config(path: str | Path | None) -> dict[str, Any]:
    """The fields of ``generation_config.json`` in the folder ``path``, or ``{}`` when there is none."""
    if path is None:
        return {}
    file = Path(path).expanduser() / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not read {str(file)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(file)!r} must hold a JSON object.")
    return data
