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


def check_model_folder(path: str | None) -> str:
    """``path``; ``ModelLoadError`` unless it is a local folder holding a ``config.json``."""
    if not path:
        raise ModelLoadError("No model given: pass a local model folder (config.json + safetensors weights).")
    if not os.path.isdir(path):
        raise ModelLoadError(
            f"Model folder {path!r} does not exist, and it is not a Hugging Face Hub id ('org/name', downloaded "
            "to a local folder when EngineArgs creates the engine config)."
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"There is no config.json in {path!r}: it is not a model folder (config.json + weights).")
    return path


def load_hf_config(path: str | None, *, trust_remote_code: bool = False) -> Any:
    """Reads ``config.json`` of a local model folder; ``ModelLoadError`` if the folder or config is missing."""
    path = check_model_folder(path)
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
