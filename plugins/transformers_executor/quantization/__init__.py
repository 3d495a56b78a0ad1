"""Weight-only quantized checkpoints on the CPU: compressed-tensors W4A16/W8A16 and GPTQ 4-bit, kept packed.

- :mod:`.config`: reading and checking ``quantization_config`` (and ``--quantization``);
- :mod:`.formats`: one quantized layer's tensors, per on-disk format, into one canonical form;
- :mod:`.linear`: the packed linear layers over torch's fused int8/int4 weight-only CPU kernels;
- :mod:`.loader`: building the transformers model with those layers from the safetensors.

docs/cpu.md ("Quantized checkpoints") lists what is supported.
"""

from vllite.plugins.transformers_executor.quantization.config import (
    SUPPORTED_METHODS,
    QuantSpec,
    WeightScheme,
    resolve_quantization,
)
from vllite.plugins.transformers_executor.quantization.linear import Int4WeightLinear, Int8WeightLinear
from vllite.plugins.transformers_executor.quantization.loader import load_quantized_model

__all__ = [
    "SUPPORTED_METHODS",
    "Int4WeightLinear",
    "Int8WeightLinear",
    "QuantSpec",
    "WeightScheme",
    "load_quantized_model",
    "resolve_quantization",
]
