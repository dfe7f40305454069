"""Anthropic Messages request bodies (POST /v1/messages, POST /v1/messages/count_tokens), as Anthropic's
API reads them: unknown fields are refused (400, ``<field>: Extra inputs are not permitted``), never
ignored; content blocks are told apart by their ``type``.

Blocks a text-only model cannot take (``image``, ``document``) are read here and refused by `parse`
with a message that says why; ``cache_control`` is accepted wherever Anthropic allows it and has no
effect of its own (the prefix cache reuses any shared prompt prefix without being asked).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from lmiserve.protocols.textgen.parameters import UINT32

# Anthropic's rule for tool names is 1 to 128 characters; the tool-call grammar's (textgen.tools) is 64
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["ephemeral"]


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Strict):
    """An image (a vision model's input; `parse.image_sources` reads its `source`)."""

    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(_Strict):
    """Read so that it can be refused with a clear message."""

    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    """A call the assistant made (earlier in the conversation)."""

    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """The result of a call, in a user message: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """The assistant's reasoning from an earlier turn: accepted and left out of the prompt (chat templates
    drop earlier reasoning)."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr = ""


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: StrictStr


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class Tool(_Strict):
    """A client tool: its arguments are generated under `input_schema` (an object schema)."""

    name: StrictStr = Field(pattern=TOOL_NAME)
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: StrictBool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: StrictBool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: StrictBool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: StrictInt = Field(ge=1, le=UINT32)  # must be below max_tokens (parse)
    display: Literal["summarized"] | None = None  # the thinking is returned ("omitted" is not offered)


class ThinkingAdaptive(_Strict):
    """The model decides whether to think: as ``enabled`` here (a thinking model's template decides)."""

    type: Literal["adaptive"]
    display: Literal["summarized"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class Metadata(_Strict):
    user_id: StrictStr | None = Field(None, max_length=256)  # an end-user id: accepted, not used


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what the prompt is rendered from."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}]}]},
    )

    model: StrictStr
    messages: list[MessageParam] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello!"}]}]
        },
    )

    max_tokens: StrictInt = Field(ge=1, le=UINT32)
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # 0: greedy; unset: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0, le=UINT32)  # 0: off
    metadata: Metadata | None = None
    stream: StrictBool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: accepted, no effect
    cache_control: CacheControl | None = None  # accepted, no effect: the prefix cache needs no marks
