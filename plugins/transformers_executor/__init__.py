"""The default executor plugin: transformers models over a paged KV cache, on the CPU or CUDA.

Modules: ``executor`` (``DefaultExecutor``), ``model_loader``, ``attention`` (the ``vllite_paged`` attention
function for transformers), ``input_batch`` (the persistent batch), ``sampler``, ``prompt_logprobs``,
``model_runner``, ``plugin`` (hook registration). Importing this package imports no torch.
"""
