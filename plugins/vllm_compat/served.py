"""What the vLLM compatibility layer serves: each ``vllm.*`` module name and, per name in it, the vllite object.

A value is ``"vllite.module:attribute"``; the object is imported when a plugin first reads the name, so importing
a served module stays as light as vllite's own module. Every served module is a package (its submodules, when
it has any, are served too), and every parent of a served module is served.
"""

from __future__ import annotations

#: The vLLM release whose plugin-facing names and signatures the layer follows (``vllm.__version__`` reports it).
VLLM_API_VERSION = "0.33.0"

_V1_INTERFACE = {
    "LogitsProcessor": "vllite.logits_processor.interface:LogitsProcessor",
    "BatchUpdate": "vllite.logits_processor.interface:BatchUpdate",
    "MoveDirectionality": "vllite.logits_processor.interface:MoveDirectionality",
    "AddedRequest": "vllite.logits_processor.interface:AddedRequest",
    "MovedRequest": "vllite.logits_processor.interface:MovedRequest",
    "RemovedRequest": "vllite.logits_processor.interface:RemovedRequest",
}
_V1_STATE = {
    "BatchUpdateBuilder": "vllite.logits_processor.builder:BatchUpdateBuilder",
    "LogitsProcessors": "vllite.logits_processor.container:LogitsProcessors",
}
_V1_BUILTIN = {
    "MinPLogitsProcessor": "vllite.builtin_logitsprocs:MinPLogitsProcessor",
    "LogitBiasLogitsProcessor": "vllite.builtin_logitsprocs:LogitBiasLogitsProcessor",
    "MinTokensLogitsProcessor": "vllite.builtin_logitsprocs:MinTokensLogitsProcessor",
    "process_dict_updates": "vllite.logits_processor.state:process_dict_updates",
}
_SLOT_INTERFACE = {
    "LogitsProcessor": "vllite.plugins.vllm_compat.slot_interface:SlotLogitsProcessor",
    "LogitsContext": "vllite.plugins.vllm_compat.slot_interface:LogitsContext",
    "LogitsProcRequestState": "vllite.plugins.vllm_compat.slot_interface:LogitsProcRequestState",
}
_TP = "vllite.plugins.openai_server.vllm_tool_parsers"
_TOOL_PARSERS = {"ToolParser": f"{_TP}:ToolParser", "ToolParserManager": f"{_TP}:ToolParserManager"}
_PROTOCOL = {
    name: f"{_TP}:{name}"
    for name in (
        "ChatCompletionRequest",
        "DeltaFunctionCall",
        "DeltaMessage",
        "DeltaToolCall",
        "ExtractedToolCallInformation",
        "FunctionCall",
        "ToolCall",
    )
}
_ASYNC_H2D = {"async_tensor_h2d": "vllite.plugins.vllm_compat.torch_utils:async_tensor_h2d"}

#: ``vllm.*`` module name -> {name in that module: ``"vllite.module:attribute"``}.
SERVED_MODULES: dict[str, dict[str, str]] = {
    "vllm": {
        "LLM": "vllite.engine.llm:LLM",
        "EngineArgs": "vllite.engine_args:EngineArgs",
        "SamplingParams": "vllite.sampling_params:SamplingParams",
        "RequestOutput": "vllite.outputs:RequestOutput",
        "CompletionOutput": "vllite.outputs:CompletionOutput",
    },
    "vllm.config": {
        "VllmConfig": "vllite.config:VllmConfig",
        "ModelConfig": "vllite.config:ModelConfig",
        "CacheConfig": "vllite.config:CacheConfig",
        "SchedulerConfig": "vllite.config:SchedulerConfig",
        "DeviceConfig": "vllite.config:DeviceConfig",
        "ParallelConfig": "vllite.config:ParallelConfig",
        "ObservabilityConfig": "vllite.config:ObservabilityConfig",
        "SpeculativeConfig": "vllite.config:SpeculativeConfig",
        "StructuredOutputsConfig": "vllite.structured_output.params:StructuredOutputsConfig",
    },
    "vllm.lora": {},
    "vllm.lora.request": {"LoRARequest": "vllite.lora.request:LoRARequest"},
    "vllm.sampling_params": {
        "SamplingParams": "vllite.sampling_params:SamplingParams",
        "RequestOutputKind": "vllite.sampling_params:RequestOutputKind",
        "SamplingType": "vllite.sampling_params:SamplingType",
        "StructuredOutputsParams": "vllite.structured_output.params:StructuredOutputsParams",
    },
    "vllm.logger": {"init_logger": "vllite.plugins.vllm_compat.logger:init_logger"},
    "vllm.exceptions": {"VLLMValidationError": "vllite.exceptions:VLLMValidationError"},
    "vllm.logits_process": {"LogitsProcessor": "vllite.logits_processor.adapter:RequestLogitsProcessor"},
    "vllm.tokenizers": {
        "cached_tokenizer_from_config": "vllite.plugins.vllm_compat.tokenizers:cached_tokenizer_from_config",
    },
    # tool-parser plugins (--tool-parser-plugin): vLLM's older and newer module paths
    "vllm.entrypoints": {},
    "vllm.entrypoints.openai": {},
    "vllm.entrypoints.openai.protocol": dict(_PROTOCOL),
    "vllm.entrypoints.openai.tool_parsers": dict(_TOOL_PARSERS),
    "vllm.entrypoints.openai.tool_parsers.abstract_tool_parser": dict(_TOOL_PARSERS),
    "vllm.tool_parsers": dict(_TOOL_PARSERS),
    "vllm.tool_parsers.abstract_tool_parser": dict(_TOOL_PARSERS),
    "vllm.utils": dict(_ASYNC_H2D),  # where vLLM releases before the torch_utils split kept it
    "vllm.utils.torch_utils": dict(_ASYNC_H2D),
    "vllm.v1": {},
    "vllm.v1.sample": {},
    "vllm.v1.sample.logits_processor": {
        **_V1_INTERFACE,
        **_V1_STATE,
        **_V1_BUILTIN,
        "AdapterLogitsProcessor": "vllite.logits_processor.adapter:AdapterLogitsProcessor",
        "RequestLogitsProcessor": "vllite.logits_processor.adapter:RequestLogitsProcessor",
        "LOGITSPROCS_GROUP": "vllite.logits_processor:LOGITSPROCS_GROUP",
    },
    "vllm.v1.sample.logits_processor.interface": dict(_V1_INTERFACE),
    "vllm.v1.sample.logits_processor.state": dict(_V1_STATE),
    "vllm.v1.sample.logits_processor.builtin": dict(_V1_BUILTIN),
    "vllm.v1.worker": {},
    "vllm.v1.worker.gpu": {},
    "vllm.v1.worker.gpu.buffer_utils": {
        "UvaBackedTensor": "vllite.plugins.vllm_compat.buffers:UvaBackedTensor",
        "StagedWriteTensor": "vllite.plugins.vllm_compat.buffers:StagedWriteTensor",
    },
    "vllm.v1.worker.gpu.sample": {},
    "vllm.v1.worker.gpu.sample.logits_processor": dict(_SLOT_INTERFACE),
    "vllm.v1.worker.gpu.sample.logits_processor.interface": dict(_SLOT_INTERFACE),
}


def submodules(name: str) -> list[str]:
    """The served modules directly below ``name``."""
    return sorted(child for child in SERVED_MODULES if child.rpartition(".")[0] == name)
