"""The model families the tool and reasoning parsers serve, as the end-to-end tests run them on the demo model: each
family's chat template (its documented format, cut to what a tool loop needs), its parsers, and two turns of output
in its exact format (forced by a logits processor) with what the API must return for them.

The templates follow the families' published chat templates: Qwen3 (ChatML, ``<tool_call>`` JSON,
``<tool_response>`` in a user turn, ``<think>`` sections), Qwen3-Coder (XML calls), DeepSeek-R1 (``<｜User｜>`` /
``<｜Assistant｜>``, the generation prompt opening ``<think>``, ``<｜tool▁calls▁begin｜>`` sections), Mistral (v3
``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]`` JSON lists, nine-character call ids, ``[TOOL_RESULTS]``; Magistral's
``[THINK]``), Llama 3.1 (JSON calls, ``ipython`` turns), Granite 3.2 (``<|tool_call|>`` lists, the thought-process /
response sections with ``thinking``) and gpt-oss (harmony channels). Rendered with Hugging Face's Jinja settings
(``trim_blocks``, ``lstrip_blocks``): a newline the output needs is written ``{{ '\\n' }}`` after a block tag.
"""

# ruff: noqa: RUF001, RUF002, E501  (DeepSeek's markers use fullwidth bars; templates are long lines)

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_RESULT = "22 C"

QWEN3 = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nFor each function call, "
    'return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}"
    "{%- if message.reasoning_content %}<think>{{ '\\n' }}{{ message.reasoning_content.strip('\\n') }}{{ '\\n' }}</think>{{ '\\n\\n' }}{% endif %}"
    "{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>{{ \'\\n\' }}{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}{{ \'\\n\' }}</tool_call>'
    "{%- endfor %}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' }}{{ message.content }}{{ '\\n' }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>{{ '\\n\\n' }}</think>{{ '\\n\\n' }}{% endif %}"
    "{%- endif %}"
)

QWEN3_CODER = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}<function>{{ '\\n' }}<name>{{ tool.function.name }}</name>{{ '\\n' }}</function>{% endfor %}"
    "{{ '\\n' }}</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{{ '\\n' }}<tool_call>{{ '\\n' }}<function={{ call.function.name }}>{{ '\\n' }}"
    "{%- for key, value in call.function.arguments.items() %}<parameter={{ key }}>{{ '\\n' }}{{ value }}{{ '\\n' }}</parameter>{{ '\\n' }}{% endfor %}"
    "</function>{{ '\\n' }}</tool_call>{%- endfor %}<|im_end|>{{ '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{{ '\\n' }}{% endif %}"
    "<tool_response>{{ '\\n' }}{{ message.content }}{{ '\\n' }}</tool_response>{{ '\\n' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

DEEPSEEK_R1 = (
    "<｜begin▁of▁sentence｜>{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{ message.content }}"
    "{%- elif message.role == 'user' %}<｜User｜>{{ message.content }}"
    "{%- elif message.role == 'assistant' %}<｜Assistant｜>{{ message.content or '' }}"
    "{%- if message.tool_calls %}<｜tool▁calls▁begin｜>{% for call in message.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ call.function.name }}{{ '\\n' }}```json{{ '\\n' }}"
    "{{ call.function.arguments | tojson }}{{ '\\n' }}```<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{%- elif message.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜><think>{{ '\\n' }}{% endif %}"
)

MISTRAL = (
    "<s>{%- set ns = namespace(last_user=-1) %}{% for message in messages %}{% if message.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{% if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' %}{{ message.content or '' }}"
    "{%- if message.tool_calls %}[TOOL_CALLS][{% for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}'
    "{%- if not loop.last %}, {% endif %}{% endfor %}]{% endif %}</s>"
    "{%- elif message.role == 'tool' %}"
    '[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- endif %}{%- endfor %}"
)

LLAMA3 = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "You have access to the following functions. To call a function, respond with JSON for a function call in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.<|eot_id|>'
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}<|start_header_id|>{{ message.role }}<|end_header_id|>{{ '\\n\\n' }}"
    "{%- if tools and message.role == 'user' and loop.first %}{% for tool in tools %}{{ tool | tojson }}{{ '\\n\\n' }}{% endfor %}{% endif %}"
    "{{ message.content }}<|eot_id|>"
    "{%- elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}{% if not loop.first %}; {% endif %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>'
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>{{ '\\n\\n' }}{{ message.content | tojson }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)

GRANITE = (
    "<|start_of_role|>system<|end_of_role|>You are Granite, developed by IBM."
    "{% if thinking is defined and thinking %} Respond to every user query in a comprehensive and detailed way. You can write "
    "down your thoughts and reasoning process before responding. In the thought process, engage in a comprehensive cycle of "
    "analysis. Write your thoughts after 'Here is my thought process:' and write your response after 'Here is my response:'"
    "{% endif %}<|end_of_text|>{{ '\\n' }}"
    "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>{{ '\\n' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|start_of_role|>assistant<|end_of_role|>{{ message.content or '' }}"
    "{%- if message.tool_calls %}<|tool_call|>[{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}'
    "{%- endfor %}]{% endif %}<|end_of_text|>{{ '\\n' }}"
    "{%- elif message.role == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ message.content }}<|end_of_text|>{{ '\\n' }}"
    "{%- else %}<|start_of_role|>{{ message.role }}<|end_of_role|>{{ message.content }}<|end_of_text|>{{ '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)

GPT_OSS = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {{ '{' }}"
    "{% for tool in tools %}{{ '\\n\\n' }}type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;{% endfor %}"
    "{{ '\\n\\n} // namespace functions' }}<|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' %}"
    "{%- if message.reasoning_content %}<|start|>assistant<|channel|>analysis<|message|>{{ message.reasoning_content }}<|end|>{% endif %}"
    "{%- for call in message.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} "
    "<|constrain|>json<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}"
    "{%- if message.content %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>{% endif %}"
    "{%- elif message.role == 'tool' %}<|start|>functions.{{ messages[loop.index0 - 1].tool_calls[0].function.name }} to=assistant"
    "<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@dataclass(frozen=True)
class Turn:
    """Forced output (pieces, each tokenized on its own so a marker keeps its standalone token ids) and the
    ``(reasoning, content, calls)`` the API must return for it."""

    pieces: tuple[str, ...]
    reasoning: str | None
    content: str | None
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True)
class Family:
    """One family as a server runs it."""

    template: str
    tool_parser: str
    reasoning_parser: str | None
    first: Turn
    second: Turn
    rendered: tuple[str, ...]  # what the second turn's prompt must hold: the call and the result, in the family's form
    template_kwargs: dict[str, Any] = field(default_factory=dict)


_PARIS = (("get_weather", {"city": "Paris"}),)

FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        QWEN3,
        "hermes",
        "qwen3",
        Turn(
            (
                "<think>\nThe user wants the weather.\n</think>\n\n",
                "I'll check.\n",
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            ),
            "The user wants the weather.",
            "I'll check.",
            _PARIS,
        ),
        Turn(("<think>\nGot it.\n</think>\n\n", "It is 22 C in Paris."), "Got it.", "It is 22 C in Paris."),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "<tool_response>\n22 C\n</tool_response>",
        ),
    ),
    "qwen3_coder": Family(
        QWEN3_CODER,
        "qwen3_coder",
        None,
        Turn(
            (
                "I'll check.\n",
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
            ),
            None,
            "I'll check.",
            (("get_weather", {"city": "Paris", "days": 2}),),
        ),
        Turn(("It is 22 C in Paris.",), None, "It is 22 C in Paris."),
        ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>", "<tool_response>\n22 C\n</tool_response>"),
    ),
    "deepseek_r1": Family(
        DEEPSEEK_R1,
        "deepseek_v3",
        "deepseek_r1",
        Turn(
            (
                "The user wants the weather.\n",
                "</think>",
                "\n\nLet me check.",
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            ),
            "The user wants the weather.",
            "Let me check.",
            _PARIS,
        ),
        Turn(("Done.\n", "</think>", "\n\n22 C in Paris."), "Done.", "22 C in Paris."),
        (
            '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>',
            "<｜tool▁output▁begin｜>22 C<｜tool▁output▁end｜>",
        ),
    ),
    "mistral": Family(
        MISTRAL,
        "mistral",
        "mistral",
        Turn(
            (
                "[THINK]",
                "Weather lookup needed.",
                "[/THINK]",
                "Checking.",
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            ),
            "Weather lookup needed.",
            "Checking.",
            _PARIS,
        ),
        Turn(("[THINK]", "Got it.", "[/THINK]", "22 C in Paris."), "Got it.", "22 C in Paris."),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "',
            '[TOOL_RESULTS]{"content": "22 C"',
        ),
    ),
    "llama3_json": Family(
        LLAMA3,
        "llama3_json",
        None,
        Turn(
            (
                '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            ),
            None,
            None,
            (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})),
        ),
        Turn(("22 C in Paris, 5 C in Oslo.",), None, "22 C in Paris, 5 C in Oslo."),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name"',
            '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C"',
        ),
    ),
    "granite": Family(
        GRANITE,
        "granite",
        "granite",
        Turn(
            (
                "Here is my thought process:",
                "\nNeed the weather.\n",
                "Here is my response:",
                "\n",
                '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            ),
            "Need the weather.",
            None,
            _PARIS,
        ),
        Turn(
            ("Here is my thought process:", "\nEasy.\n", "Here is my response:", "\n22 C in Paris."),
            "Easy.",
            "22 C in Paris.",
        ),
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "<|start_of_role|>tool_response<|end_of_role|>22 C",
        ),
        {"thinking": True},
    ),
    "gpt_oss": Family(
        GPT_OSS,
        "openai",
        "openai_gptoss",
        Turn(
            (
                "<|channel|>analysis<|message|>",
                "Need the weather.",
                "<|end|>",
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                '{"city": "Paris"}',
                "<|call|>",
            ),
            "Need the weather.",
            None,
            _PARIS,
        ),
        Turn(
            (
                "<|channel|>analysis<|message|>",
                "Report it.",
                "<|end|><|start|>assistant<|channel|>final<|message|>",
                "22 C in Paris.",
            ),
            "Report it.",
            "22 C in Paris.",
        ),
        (
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C"<|end|>',
        ),
    ),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def start_family_servers(model: str, *, auth: tuple[str, str] | None = None, metrics: bool = False) -> Any:
    """One engine on the demo model with the forcing logits processor, and one in-process app per family (its chat
    template and parsers, served as ``model``); with ``auth=(family, key)`` also an ``"auth"`` app of that family
    behind ``--api-key key``. Returns the ``InProcessServers`` harness (close it when done)."""
    from inprocess_servers import InProcessServers

    from vllite.assets import default_model_path
    from vllite.engine_args import EngineArgs
    from vllite.plugins.openai_server.cli import demo_model_defaults
    from vllite.plugins.openai_server.context import ServerSettings
    from vllite.plugins.openai_server.testing import FORCED_SEQUENCE

    engine_args = EngineArgs(
        model=str(default_model_path()), max_model_len=1024, seed=0, logits_processors=[FORCED_SEQUENCE]
    )
    demo_model_defaults(engine_args)

    def settings(family: Family, **extra: Any) -> ServerSettings:
        return ServerSettings(
            served_model_names=(model,),
            chat_template=family.template,
            tool_call_parser=family.tool_parser,
            enable_auto_tool_choice=True,
            reasoning_parser=family.reasoning_parser,
            **extra,
        )

    apps = {name: settings(family) for name, family in FAMILIES.items()}
    if auth is not None:
        apps["auth"] = settings(FAMILIES[auth[0]], api_key=auth[1])
    return InProcessServers(engine_args, apps, metrics=metrics)


def forced(tokenizer: Any, pieces: tuple[str, ...]) -> list[int]:
    """Token ids that spell ``pieces`` (each tokenized alone, so a marker keeps its own ids), then EOS."""
    ids = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
    return [*ids, tokenizer.eos_token_id]
