"""Reasoning in chat completions (``vllite serve --reasoning-parser NAME``), resolved once per request.

The reply is split by the server's reasoning parser first: the reasoning goes out as ``reasoning_content`` (and
vLLM's newer ``reasoning`` alias), in the message and in stream deltas, and only the content after it reaches tool
calling (:mod:`~vllite.plugins.openai_server.tool_choice`), so tool calls are parsed from the answer, never from
the thinking. ``include_reasoning: false`` drops the reasoning from the response (it is still kept out of the
content). The request's ``chat_template_kwargs`` (``enable_thinking`` / ``thinking``) and the rendered prompt (a
template that opens the section itself) tell the parser where the reply starts.

Two engine-side features take the parser's markers, as token ids in ``SamplingParams.extra_args``:

- a constrained reply (``response_format``, ``structured_outputs``, forced tool calls) is constrained only after the
  reasoning ends (``reasoning_end_token_ids``: vLLM's reasoning-aware structured outputs);
- a thinking budget (``thinking_token_budget``) forces the parser's end marker once spent, and so does repetition
  detection scoped to the reasoning (``repetition_detection_scope: "reasoning"``) on a loop
  (``think_start_token_ids`` / ``think_end_token_ids``, unless the request gives its own).
"""

from __future__ import annotations

from typing import Any

from vllite.plugins.openai_server.context import ServerContext
from vllite.plugins.openai_server.protocol import ChatCompletionRequest
from vllite.plugins.openai_server.responses import DeltaMessage, DeltaToolCall

#: Prompt tokens decoded to see whether the template opened the reasoning section.
PROMPT_TAIL_TOKENS = 64
BUDGET_KEY = "thinking_token_budget"
START_KEY, END_KEY = "think_start_token_ids", "think_end_token_ids"
GATE_KEY = "reasoning_end_token_ids"  # vllite.structured_output.manager.REASONING_END_KEY
SCOPE_KEY = "repetition_detection_scope"  # vllite.repetition.SCOPE_KEY


class ReasoningMode:
    """One request's reasoning handling; without a parser, the reply is all content."""

    def __init__(self, parser: Any = None, *, include: bool = True) -> None:
        self.parser = parser
        self.include = include

    @property
    def skip_special_tokens(self) -> bool | None:
        """``False`` when the parser's markers are special tokens the reply must be detokenized with."""
        return getattr(self.parser, "skip_special_tokens", None) if self.parser is not None else None

    @property
    def active(self) -> bool:
        """Whether a reasoning parser splits the reply."""
        return self.parser is not None

    @classmethod
    def for_request(cls, ctx: ServerContext, request: ChatCompletionRequest, prompt_ids: list[int]) -> ReasoningMode:
        """The mode the server's ``--reasoning-parser`` gives ``request`` (whose prompt is ``prompt_ids``)."""
        parser_class = ctx.reasoning_parser_class
        if parser_class is None:
            return cls()
        thinking = parser_class.thinking_requested(request.chat_template_kwargs)
        tail = ctx.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        parser = parser_class(thinking=thinking, prompt_open=parser_class.prompt_opens_section(tail))
        return cls(parser, include=request.include_reasoning)

    def may_reason(self) -> bool:
        """Whether the reply may hold a reasoning section before its content."""
        parser = self.parser
        return parser is not None and bool(parser.thinking or parser.prompt_open)

    def split(self, text: str) -> tuple[str | None, str]:
        """A finished reply's reasoning (None when there is none or it is not returned) and its content text."""
        if self.parser is None:
            return None, text
        reasoning, content = self.parser.extract_reasoning(text)
        return (reasoning if self.include else None), content or ""

    def wrap(self, extractor: Any) -> Any:
        """The per-choice stream: the reasoning split first, its content through ``extractor`` (the tool mode's)."""
        return extractor if self.parser is None else _SplitStream(self.parser.stream(), extractor, self.include)

    def apply(self, ctx: ServerContext, params: Any, budget: int | None, constrained: bool) -> None:
        """Adds to ``params.extra_args`` what the engine needs (see the module docstring): the request's thinking
        ``budget`` with the parser's markers, and for a ``constrained`` reply the marker its grammar waits for."""
        extra = dict(params.extra_args or {})
        if budget is not None:
            extra.setdefault(BUDGET_KEY, budget)
        parser = self.parser
        if parser is not None and ctx.tokenizer is not None:

            def ids(marker: str) -> list[int]:
                return list(ctx.tokenizer.encode(marker, add_special_tokens=False)) if marker else []

            if extra.get(BUDGET_KEY) is not None or extra.get(SCOPE_KEY) == "reasoning":
                for key, marker in ((START_KEY, parser.start_marker), (END_KEY, parser.end_marker)):
                    if key not in extra and ids(marker):
                        extra[key] = ids(marker)
            if constrained and self.may_reason() and ids(parser.end_marker):
                extra[GATE_KEY] = ids(parser.end_marker)
        params.extra_args = extra or None


def reasoning_delta(text: str) -> DeltaMessage:
    """A stream delta carrying reasoning, under both of vLLM's names."""
    return DeltaMessage(reasoning_content=text, reasoning=text)


class _SplitStream:
    """Splits each delta into reasoning (sent as reasoning deltas) and content (fed to the tool mode's stream)."""

    def __init__(self, splitter: Any, extractor: Any, include: bool) -> None:
        self.splitter = splitter
        self.extractor = extractor
        self.include = include

    def feed(self, text: str) -> list[DeltaMessage]:
        if not text:
            return []
        reasoning, content = self.splitter.feed(text)
        return self._deltas(reasoning, content)

    def finish(self) -> tuple[list[DeltaMessage], list[DeltaToolCall]]:
        reasoning, content = self.splitter.finish()
        deltas = self._deltas(reasoning, content)
        more, calls = self.extractor.finish()
        return deltas + more, calls

    def _deltas(self, reasoning: str, content: str) -> list[DeltaMessage]:
        deltas = [reasoning_delta(reasoning)] if reasoning and self.include else []
        if content:
            deltas.extend(self.extractor.feed(content))
        return deltas
