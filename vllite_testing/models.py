"""Tiny random-weight models for tests and benchmarks, built locally with transformers (no download).

A model folder made here looks like any Hugging Face checkpoint: ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files of vllite's demo model (a byte-level BPE trained on the Python
standard library, see ``docs/demo-model.md``), so the engine loads it exactly as it loads a real model::

    from vllite.testing import make_tiny_model, make_tiny_model_dir_cached

    path = make_tiny_model("qwen3", tmp_path / "qwen3", seed=1)
    path = make_tiny_model_dir_cached("llama")  # built once per process, shared by tests
    path = make_model(tmp_path / "m30", preset="30m")  # ~30M parameters, for benchmarks

The same arguments and seed give byte-identical weights. Only architectures whose eager attention goes through
transformers' attention interface (``ALL_ATTENTION_FUNCTIONS`` keyed by ``config._attn_implementation``) are
offered, because that is the hook through which vllite's paged attention enters the model.

Importing this module is cheap; torch and transformers load on first use.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllite.assets import DEMO_MODEL_DIR

__all__ = [
    "MODEL_PRESETS",
    "SUPPORTED_TINY_ARCHS",
    "TOKENIZER_FILES",
    "copy_demo_tokenizer",
    "make_model",
    "make_tiny_model",
    "make_tiny_model_dir_cached",
    "tiny_config",
]

#: The tokenizer files copied from the demo model into every model folder built here.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _llama_like(model_type: str, **fixed: Any) -> Callable[..., dict[str, Any]]:
    """Config kwargs for the Llama family (standard names, explicit ``head_dim``, GQA)."""

    def build(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, **_: Any) -> dict[str, Any]:
        return {
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": hidden_size // num_heads,
            **fixed,
        }

    return build


def _gpt2(*, hidden_size: int, num_layers: int, num_heads: int, **_: Any) -> dict[str, Any]:
    """Config kwargs for GPT-2 (learned absolute positions, no grouped-query attention)."""
    return {
        "n_embd": hidden_size,
        "n_inner": 4 * hidden_size,
        "n_layer": num_layers,
        "n_head": num_heads,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


#: Architecture name (the ``model_type``) -> builder of its config kwargs. Sliding windows are switched off so
#: that every model attends causally over the whole sequence; pass ``sliding_window=...`` to test one.
_ARCH_BUILDERS: dict[str, Callable[..., dict[str, Any]]] = {
    "llama": _llama_like("llama"),
    "qwen2": _llama_like("qwen2", use_sliding_window=False, sliding_window=None),
    "qwen3": _llama_like("qwen3", use_sliding_window=False, sliding_window=None),
    "mistral": _llama_like("mistral", sliding_window=None),
    "gemma": _llama_like("gemma"),
    "phi3": _llama_like("phi3", sliding_window=None),
    "gpt2": _gpt2,
}


def _available_archs() -> tuple[str, ...]:
    """The architectures of :data:`_ARCH_BUILDERS` that the installed transformers ships.

    Looks for ``transformers/models/<arch>/modeling_<arch>.py`` on disk instead of importing transformers, which
    would pull in torch and cost seconds at import time.
    """
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - a hard dependency
        return ()
    roots = [Path(loc) / "models" for loc in spec.submodule_search_locations]
    return tuple(
        arch for arch in _ARCH_BUILDERS if any((root / arch / f"modeling_{arch}.py").is_file() for root in roots)
    )


#: Architectures :func:`make_tiny_model` builds on the installed transformers version.
SUPPORTED_TINY_ARCHS: tuple[str, ...] = _available_archs()

#: Named sizes for :func:`make_model`. ``"30m"`` is a Llama of about 30M parameters and ``"100m"`` one of about
#: 100M (hidden 1024, 8 layers); ``"0.5b"`` is Qwen2.5-0.5B's body and ``"1b"`` Llama-3.2-1B's (all with the demo
#: tokenizer's 4,096-token vocabulary), used by the benchmarks.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "30m": {
        "hidden_size": 512,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 1536,
        "max_position_embeddings": 2048,
    },
    "100m": {
        "hidden_size": 1024,
        "num_layers": 8,
        "num_heads": 16,
        "num_kv_heads": 8,
        "intermediate_size": 2816,
        "max_position_embeddings": 2048,
    },
    # The bodies of models people run (their published shapes; the demo tokenizer's small vocabulary).
    "0.5b": {  # Qwen2.5-0.5B: Q/K/V biases, tied embeddings
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "1b": {  # Llama-3.2-1B
        "hidden_size": 2048,
        "num_layers": 16,
        "num_heads": 32,
        "num_kv_heads": 8,
        "intermediate_size": 8192,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}
#: The architecture of a preset that is not a Llama.
PRESET_ARCHS: dict[str, str] = {"0.5b": "qwen2"}


def copy_demo_tokenizer(dest: str | Path, source: str | Path | None = None) -> Path:
    """Copy the tokenizer files (:data:`TOKENIZER_FILES`) of ``source`` (default: the demo model) into ``dest``.

    Raises ``FileNotFoundError`` naming the training script when the source folder has no ``tokenizer.json``.
    """
    src = Path(source) if source is not None else DEMO_MODEL_DIR
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {src}; build the demo model with `python scripts/train_demo_model.py` "
            "(or `--tokenizer-only` for the tokenizer alone)"
        )
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    return dest


def _tokenizer_info(tokenizer_dir: Path) -> dict[str, Any]:
    """Vocabulary size and special-token ids, read from ``tokenizer.json`` without loading transformers."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}

    def token_id(key: str) -> int | None:
        token = cfg.get(key)
        if isinstance(token, dict):  # AddedToken serialised as a dict by older transformers
            token = token.get("content")
        return vocab.get(token) if token else None

    eos = token_id("eos_token")
    im_end = vocab.get("<|im_end|>")
    return {
        "vocab_size": max(vocab.values()) + 1,
        "bos_token_id": token_id("bos_token"),
        "eos_token_id": eos,
        "pad_token_id": token_id("pad_token"),
        "stop_token_ids": [t for t in (eos, im_end) if t is not None],
    }


def tiny_config(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    **overrides: Any,
) -> Any:
    """A transformers ``PretrainedConfig`` for a small ``arch`` model; ``overrides`` set any config field last."""
    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unknown or unavailable arch {arch!r}; supported: {', '.join(SUPPORTED_TINY_ARCHS)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must divide by num_heads ({num_heads}), "
            f"and num_heads by num_kv_heads ({num_kv_heads})"
        )
    from transformers import AutoConfig

    kwargs = _ARCH_BUILDERS[arch](
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    position_key = "n_positions" if arch == "gpt2" else "max_position_embeddings"
    kwargs[position_key] = max_position_embeddings
    kwargs.update(
        vocab_size=vocab_size,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def make_tiny_model(
    arch: str,
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
    **overrides: Any,
) -> Path:
    """Build a random-weight ``arch`` model with transformers and save it as a complete model folder at ``path``.

    ``vocab_size`` defaults to the tokenizer's (it may be larger, like padded vocabularies of real models, never
    smaller). ``dtype`` is the storage and ``config.json`` dtype (``float32``, ``bfloat16`` or ``float16``).
    ``tokenizer_dir`` defaults to the demo model. ``overrides`` set config fields, e.g. ``intermediate_size=96``,
    ``tie_word_embeddings=True`` or ``initializer_range=0.1``. The weights depend only on the arguments and
    ``seed``; the global RNG state of the caller is left as it was. Returns ``path``.
    """
    import torch

    path = Path(path)
    copy_demo_tokenizer(path, tokenizer_dir)
    info = _tokenizer_info(path)
    if vocab_size is None:
        vocab_size = info["vocab_size"]
    elif vocab_size < info["vocab_size"]:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {info['vocab_size']}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype name, got {dtype!r}")
    config = tiny_config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        bos_token_id=info["bos_token_id"],
        eos_token_id=info["eos_token_id"],
        pad_token_id=info["pad_token_id"],
        **overrides,
    )
    _save_random_model(config, path, seed, torch_dtype, info)
    _add_legacy_config_keys(path / "config.json", dtype)
    return path


def _save_random_model(config: Any, path: Path, seed: int, torch_dtype: Any, info: dict[str, Any]) -> None:
    """Random weights from ``seed`` (the caller's RNG state untouched), greedy generation config, saved at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch_dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=info["bos_token_id"],
        eos_token_id=info["stop_token_ids"] or info["eos_token_id"],
        pad_token_id=info["pad_token_id"],
        do_sample=False,
    )
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(path)


def _add_legacy_config_keys(config_path: Path, dtype: str) -> None:
    """Write the pre-5.0 spellings (``torch_dtype``, top-level ``rope_theta``) next to the current ones."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["torch_dtype"] = dtype
    config.setdefault("dtype", dtype)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_model(path: str | Path, *, preset: str = "30m", arch: str | None = None, seed: int = 0, **kwargs: Any) -> Path:
    """Build a model of a named size (:data:`MODEL_PRESETS`) at ``path``, of the preset's architecture
    (:data:`PRESET_ARCHS`, else a Llama) unless ``arch`` is given; ``kwargs`` override preset fields."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(MODEL_PRESETS)}")
    arch = arch or PRESET_ARCHS.get(preset, "llama")
    return make_tiny_model(arch, path, seed=seed, **{**MODEL_PRESETS[preset], **kwargs})


_cache_lock = threading.Lock()
_cache: dict[str, Path] = {}
_cache_root: Path | None = None


def _freeze(value: Any) -> str:
    """A stable text key for keyword arguments (sorted JSON; non-JSON values by ``repr``)."""
    return json.dumps(value, sort_keys=True, default=repr)


def make_tiny_model_dir_cached(arch: str, **kwargs: Any) -> Path:
    """:func:`make_tiny_model` under a per-process temporary folder, built once per distinct argument set.

    Tests share the folder, so they must not write into it. The folder is removed when the process exits.
    """
    global _cache_root
    key = _freeze({"arch": arch, **kwargs})
    with _cache_lock:
        if key in _cache and (_cache[key] / "config.json").is_file():
            return _cache[key]
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="vllite-tiny-models-"))
            atexit.register(shutil.rmtree, _cache_root, True)
        path = make_tiny_model(arch, _cache_root / f"{arch}-{len(_cache)}", **kwargs)
        _cache[key] = path
        return path
