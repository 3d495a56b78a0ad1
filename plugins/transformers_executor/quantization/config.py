"""Reading and checking a checkpoint's ``quantization_config``: which weight-only formats vllite runs on the CPU.

Supported (``--quantization`` takes vLLM's names; ``None`` detects the method from the checkpoint):

- ``compressed-tensors`` (what ``llm-compressor`` writes): integer weights of 4 or 8 bits, symmetric, with one
  scale per output channel, per group of input columns or per tensor, in the ``pack-quantized``, ``int-quantized``
  or ``naive-quantized`` format; activations unquantized (W4A16, W8A16).
- ``gptq`` (AutoGPTQ / GPTQModel): 4-bit ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, symmetric or not, with
  or without ``desc_act``; ``checkpoint_format`` ``gptq`` (zeros stored minus one) or ``gptq_v2``.

Anything else (AWQ, FP8, activation quantization, sparsity, other bit widths ...) is a ``ModelLoadError`` at start-up
that names the field and its value. The format references are compressed-tensors' ``QuantizationConfig`` /
``QuantizationArgs`` and AutoGPTQ's ``BaseQuantizeConfig``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllite.exceptions import ModelLoadError

#: The ``--quantization`` names vllite accepts (vLLM's spellings).
SUPPORTED_METHODS = ("compressed-tensors", "gptq")
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_CT_STRATEGIES = ("channel", "group", "tensor")


@dataclass(frozen=True)
class WeightScheme:
    """How one group of layers is quantized: bit width, group size (``None``: one scale per output channel or per
    tensor), symmetry, and the on-disk format."""

    bits: int
    group_size: int | None
    symmetric: bool
    fmt: str  # "pack-quantized" | "int-quantized" | "naive-quantized" | "gptq" | "gptq_v2"
    strategy: str = "group"  # compressed-tensors' strategy ("channel", "group", "tensor"); "group" for GPTQ


@dataclass(frozen=True)
class QuantSpec:
    """A checked ``quantization_config``: the method and which layers take which scheme."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme) in config order
    ignore: tuple[str, ...] = ()
    desc_act: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def scheme_for(self, name: str, class_name: str) -> WeightScheme | None:
        """The scheme of the layer ``name`` (a module of class ``class_name``), ``None`` when it is not quantized."""
        if any(_matches(target, name, class_name) for target in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(target, name, class_name) for target in targets):
                return scheme
        return None


def _matches(target: str, name: str, class_name: str) -> bool:
    """compressed-tensors' target rule: ``re:PATTERN`` matches the module name, else a class name or a name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (class_name, name) or name.endswith("." + target)


def read_quantization_config(path: str, hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization config: ``config.json``'s ``quantization_config``, else AutoGPTQ's
    ``quantize_config.json`` beside it; ``None`` for an unquantized checkpoint."""
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is None:
        text_cfg = getattr(hf_config, "text_config", None)
        cfg = getattr(text_cfg, "quantization_config", None) if text_cfg is not None else None
    if cfg is not None:
        return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    legacy = Path(path) / "quantize_config.json"
    if legacy.is_file():
        data = json.loads(legacy.read_text(encoding="utf-8"))
        data.setdefault("quant_method", "gptq")
        return dict(data)
    return None


def resolve_quantization(path: str, hf_config: Any, requested: str | None) -> QuantSpec | None:
    """Checks ``--quantization`` (``requested``) against the checkpoint and parses its config.

    ``None`` means an unquantized model. Raises ``ModelLoadError`` for an unsupported method or format, a corrupt
    config, or a ``--quantization`` that contradicts the checkpoint (naming both).
    """
    if requested is not None and requested not in SUPPORTED_METHODS:
        raise ModelLoadError(
            f"quantization={requested!r} is not supported on this executor; supported: {', '.join(SUPPORTED_METHODS)}"
            " (weight-only int4/int8 checkpoints)."
        )
    cfg = read_quantization_config(path, hf_config)
    if cfg is None:
        if requested is not None:
            raise ModelLoadError(
                f"quantization={requested!r} was requested but the checkpoint at {path!r} has no quantization_config"
                " (it is not quantized)."
            )
        return None
    method = cfg.get("quant_method")
    if requested is not None and method != requested:
        raise ModelLoadError(
            f"quantization={requested!r} contradicts the checkpoint's quantization_config.quant_method={method!r}."
        )
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == "gptq":
        return _parse_gptq(cfg)
    raise ModelLoadError(
        f"quantization_config.quant_method={method!r} is not supported; supported: {', '.join(SUPPORTED_METHODS)}."
    )


def _unsupported(field_name: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config.{field_name}={value!r} is not supported: {why}.")


def _parse_compressed_tensors(cfg: dict[str, Any]) -> QuantSpec:
    """compressed-tensors: every config group must be integer, symmetric, weight-only, 4 or 8 bits."""
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if cfg.get(key):
            raise _unsupported(key, cfg[key], "only weight quantization is supported")
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise _unsupported("quantization_status", status, "vllite loads compressed checkpoints only")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("quantization_config.config_groups is missing or empty: the checkpoint is corrupt.")
    parsed = []
    for group_name, group in groups.items():
        where = f"config_groups.{group_name}"
        if not isinstance(group, dict):
            raise ModelLoadError(f"quantization_config.{where} must be an object, got {group!r}.")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise _unsupported(f"{where}.{key}", group[key], "activation quantization (e.g. W8A8) is not run")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            raise ModelLoadError(f"quantization_config.{where}.targets is missing or empty.")
        fmt = group.get("format") or cfg.get("format")
        if fmt not in _CT_FORMATS:
            raise _unsupported(f"{where}.format" if group.get("format") else "format", fmt, _one_of(_CT_FORMATS))
        parsed.append((tuple(targets), _ct_weight_scheme(group.get("weights"), f"{where}.weights", fmt)))
    ignore = cfg.get("ignore") or []
    return QuantSpec("compressed-tensors", tuple(parsed), ignore=tuple(ignore), raw=cfg)


def _ct_weight_scheme(weights: Any, where: str, fmt: str) -> WeightScheme:
    """One group's ``weights`` (compressed-tensors' ``QuantizationArgs``) checked."""
    if not isinstance(weights, dict):
        raise ModelLoadError(f"quantization_config.{where} is missing: the checkpoint is corrupt.")
    bits = _required_int(weights, "num_bits", where)
    if bits not in (4, 8):
        raise _unsupported(f"{where}.num_bits", bits, "only 4- and 8-bit weights are supported")
    if weights.get("type", "int") != "int":
        raise _unsupported(f"{where}.type", weights.get("type"), "only integer weights are supported (no fp8/fp4)")
    if not weights.get("symmetric", True):
        raise _unsupported(f"{where}.symmetric", False, "compressed-tensors weights must be symmetric")
    if weights.get("dynamic"):
        raise _unsupported(f"{where}.dynamic", weights["dynamic"], "weights must be statically quantized")
    strategy = weights.get("strategy") or "tensor"
    if strategy not in _CT_STRATEGIES:
        raise _unsupported(f"{where}.strategy", strategy, _one_of(_CT_STRATEGIES))
    group_size = None
    if strategy == "group":
        group_size = _required_int(weights, "group_size", where)
        if group_size <= 0:
            raise ModelLoadError(f"quantization_config.{where}.group_size must be > 0, got {group_size}.")
    if fmt != "pack-quantized" and weights.get("actorder") == "group":
        raise _unsupported(f"{where}.actorder", "group", "activation order needs the pack-quantized format")
    return WeightScheme(bits=bits, group_size=group_size, symmetric=True, fmt=fmt, strategy=strategy)


def _parse_gptq(cfg: dict[str, Any]) -> QuantSpec:
    """GPTQ (AutoGPTQ / GPTQModel): 4 bits, group size -1 or > 0, ``gptq`` or ``gptq_v2`` checkpoint format."""
    bits = _required_int(cfg, "bits", "")
    if bits != 4:
        raise _unsupported("bits", bits, "GPTQ checkpoints must be 4-bit")
    group_size = _required_int(cfg, "group_size", "")
    if group_size != -1 and group_size <= 0:
        raise ModelLoadError(f"quantization_config.group_size must be -1 or > 0, got {group_size}.")
    fmt = cfg.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported("checkpoint_format", fmt, "supported: gptq, gptq_v2")
    for key in ("is_marlin_format",):
        if cfg.get(key):
            raise _unsupported(key, cfg[key], "only the plain GPTQ layout is read")
    scheme = WeightScheme(
        bits=4, group_size=None if group_size == -1 else group_size, symmetric=bool(cfg.get("sym", True)), fmt=fmt
    )
    return QuantSpec("gptq", ((("Linear",), scheme),), desc_act=bool(cfg.get("desc_act", False)), raw=cfg)


def _required_int(cfg: dict[str, Any], key: str, where: str) -> int:
    name = f"{where}.{key}" if where else key
    value = cfg.get(key)
    if value is None:
        raise ModelLoadError(f"quantization_config.{name} is missing: the checkpoint's config is corrupt.")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"quantization_config.{name} must be an integer, got {value!r}.")
    return value


def _one_of(values: tuple[str, ...]) -> str:
    return "supported: " + ", ".join(values)
