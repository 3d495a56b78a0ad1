"""Tokenizer loading (local folders only, never the network), chat templates, and a tiny tokenizer for tests.

transformers and tokenizers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllite.exceptions import ModelLoadError

# Any one of these marks a folder that holds a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)

AnyTokenizer = Any  # a transformers PreTrainedTokenizerBase (fast or slow)


def get_tokenizer(path: str | Path, *, trust_remote_code: bool = False, **kwargs: Any) -> AnyTokenizer:
    """Loads the Hugging Face tokenizer in the local folder ``path`` (``local_files_only=True``).

    Raises :class:`~vllite.exceptions.ModelLoadError` naming the folder when it does not exist, holds no
    tokenizer files, or transformers cannot load them.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"Tokenizer folder {str(folder)!r} does not exist, and it is not a Hugging Face Hub id ('org/name')."
        )
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not present:
        raise ModelLoadError(
            f"No tokenizer files in {str(folder)!r}: expected one of {', '.join(TOKENIZER_FILES)}. "
            "Pass --tokenizer to point at another folder, or --skip-tokenizer-init to work with token ids."
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code, **kwargs
        )
    except Exception as e:
        raise ModelLoadError(
            f"Could not load the tokenizer in {str(folder)!r} (files: {', '.join(present)}): {type(e).__name__}: {e}"
        ) from e


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` as vLLM takes it: a file holding a Jinja template, or the template itself. A value with
    none of ``{``, ``}`` or a newline looks like a path: one that cannot be read is a ``ValueError`` naming it."""
    if value is None:
        return None
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        if any(c in value for c in "{}\n"):
            return value
        reason = exc.strerror or exc
        raise ValueError(f"--chat-template {value!r} looks like a file path but cannot be read: {reason}.") from None


def apply_chat_template(
    tokenizer: AnyTokenizer,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Renders a conversation with the tokenizer's chat template and returns its token ids.

    Raises ``ValueError`` when there is no tokenizer or the tokenizer has no chat template.
    """
    if tokenizer is None:
        raise ValueError("apply_chat_template needs a tokenizer; this engine was started without one.")
    if kwargs.get("chat_template") is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no "
            "chat template; pass chat_template=... (--chat-template on the command line) or use a plain text prompt."
        )
    result = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if isinstance(result, dict) or hasattr(result, "input_ids"):
        result = result["input_ids"]
    return [int(t) for t in result]
