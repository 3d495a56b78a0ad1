"""Building a transformers model whose quantized linear layers stay packed, straight from the safetensors.

transformers' own ``from_pretrained`` would hand a ``quantization_config`` to its quantizers (which need extra
packages and dequantize or use GPU kernels), so the model is built here instead:

1. the model class is instantiated from the config with the ``quantization_config`` removed, its parameters on the
   ``meta`` device (no memory, no random init) and its buffers real (rotary tables are computed as usual);
2. each ``nn.Linear`` whose weight the checkpoint holds quantized is replaced by a packed layer built from the
   quantized tensors (:mod:`.formats`, :mod:`.linear`);
3. every other parameter and persistent buffer is read from the safetensors in the model dtype; tied output
   embeddings are tied again; anything still on ``meta`` is a ``ModelLoadError`` naming it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllite.exceptions import ModelLoadError
from vllite.plugins.transformers_executor.quantization.config import QuantSpec
from vllite.plugins.transformers_executor.quantization.formats import read_compressed_tensors, read_gptq
from vllite.plugins.transformers_executor.quantization.linear import packed_linear

logger = logging.getLogger(__name__)

#: The tensor that marks a layer as quantized in the checkpoint, per method.
_MARKERS = {"compressed-tensors": ("weight_packed", "weight_scale"), "gptq": ("qweight",)}


class SafetensorsFolder:
    """Lazy access to every tensor of a folder's ``*.safetensors`` files by name."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"Cannot load the model weights from {path!r}: no *.safetensors file")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where = {key: handle for handle in self._handles for key in handle.keys()}  # noqa: SIM118 (a safetensors handle)

    def keys(self) -> set[str]:
        """Every tensor name."""
        return set(self._where)

    def get(self, key: str) -> torch.Tensor | None:
        """The tensor ``key``, ``None`` when no file has it."""
        handle = self._where.get(key)
        return None if handle is None else handle.get_tensor(key)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the ``meta`` device; buffers stay where they are made."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = module._parameters[name].to("meta")  # type: ignore[union-attr]
            module._parameters[name] = type(param)(meta, requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def strip_quantization_config(hf_config: Any) -> Any:
    """A copy of ``hf_config`` without ``quantization_config`` (so transformers does not act on it)."""
    config = copy.deepcopy(hf_config)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and "quantization_config" in cfg.__dict__:
            delattr(cfg, "quantization_config")
    return config


def load_quantized_model(
    path: str,
    hf_config: Any,
    spec: QuantSpec,
    model_cls: type[Any],
    dtype: torch.dtype,
    device: torch.device,
    init_kwargs: dict[str, Any],
) -> nn.Module:
    """The model of ``path`` with its quantized layers packed (on the CPU, in ``dtype``); see the module docstring."""
    if device.type != "cpu":
        raise ModelLoadError(
            f"quantized checkpoints ({spec.method}) run on the CPU only; this engine runs on {device}: use --device cpu"
        )
    config = strip_quantization_config(hf_config)
    with parameters_on_meta():
        model = model_cls._from_config(config, **init_kwargs)
    folder = SafetensorsFolder(path)
    used = swap_quantized_linears(model, folder, spec, dtype)
    _load_remaining(model, folder, dtype)
    unused = folder.keys() - used - set(model.state_dict())
    if unused:
        logger.warning("%d checkpoint tensors were not used, e.g. %s", len(unused), sorted(unused)[:3])
    return model


def swap_quantized_linears(
    model: nn.Module, folder: SafetensorsFolder, spec: QuantSpec, dtype: torch.dtype
) -> set[str]:
    """Replaces each ``nn.Linear`` the checkpoint holds quantized by a packed layer; returns the tensor names used."""
    keys = folder.keys()
    marker = _MARKERS[spec.method]
    used: set[str] = set()
    swapped = 0
    for name, module in list(model.named_modules()):
        prefix = _checkpoint_prefix(name, keys, marker, model)
        if prefix is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ModelLoadError(
                f"{name} is quantized in the checkpoint but is a {type(module).__name__}, not nn.Linear: vllite "
                "runs quantized nn.Linear layers only"
            )
        scheme = spec.scheme_for(name, "Linear")
        if scheme is None:
            raise ModelLoadError(
                f"{name} is quantized in the checkpoint but quantization_config's targets/ignore do not cover it"
            )

        def get(local: str, _prefix: str = prefix) -> torch.Tensor | None:
            used.add(f"{_prefix}.{local}")
            return folder.get(f"{_prefix}.{local}")

        if spec.method == "gptq":
            qw = read_gptq(name, get, scheme, spec.desc_act)
        else:
            qw = read_compressed_tensors(name, get, scheme)
        if qw.shape != (module.out_features, module.in_features):
            raise ModelLoadError(
                f"{name}: the quantized weight is {qw.shape} but the model expects "
                f"{(module.out_features, module.in_features)}"
            )
        bias = get("bias") if module.bias is not None else None
        _set_submodule(model, name, packed_linear(qw, bias, dtype))
        swapped += 1
    if swapped == 0:
        raise ModelLoadError(f"quantization_config says {spec.method} but the checkpoint has no quantized layer")
    logger.info("Packed %d quantized linear layers (%s)", swapped, spec.method)
    return used


def _checkpoint_prefix(name: str, keys: set[str], marker: tuple[str, ...], model: nn.Module) -> str | None:
    """The checkpoint's name for module ``name`` when it holds a quantized weight (with or without the base-model
    prefix), else ``None``."""
    if not name:
        return None
    base = getattr(model, "base_model_prefix", "")
    for candidate in (name, name.removeprefix(base + ".") if base else name):
        if any(f"{candidate}.{m}" in keys for m in marker):
            return candidate
    return None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _load_remaining(model: nn.Module, folder: SafetensorsFolder, dtype: torch.dtype) -> None:
    """Reads every parameter and persistent buffer still on ``meta`` from the checkpoint (floats in ``dtype``)."""
    base = getattr(model, "base_model_prefix", "")
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if value.device.type != "meta":
            continue
        tensor = folder.get(key)
        if tensor is None and base:
            tensor = folder.get(key.removeprefix(base + "."))
        if tensor is not None:
            state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    model.load_state_dict(state, strict=False, assign=True)
    _retie_output_embeddings(model)
    missing = [key for key, value in model.state_dict(keep_vars=True).items() if value.device.type == "meta"]
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")


def _retie_output_embeddings(model: nn.Module) -> None:
    """Ties the output embeddings to the input ones when the config ties them and the checkpoint left them out."""
    config = getattr(model, "config", None)
    cfg = getattr(config, "text_config", None) or config
    if not getattr(cfg, "tie_word_embeddings", False):
        return
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    out = get_out() if get_out else None
    inp = get_in() if get_in else None
    if isinstance(out, nn.Linear) and inp is not None and out.weight.device.type == "meta":
        out.weight = inp.weight
