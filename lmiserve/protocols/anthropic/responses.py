"""The Anthropic routes' answers as pydantic models, for the API document (`lmiserve.server.openapi`): the
encoders (`encoders.py`) write the bytes; these describe them, and the schemathesis test checks that
they agree."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str  # toolu_<24 hex>
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """The reasoning block of a reasoning model (with a `reasoning_parser`); `signature` is empty."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class Usage(BaseModel):
    input_tokens: int  # prompt tokens computed (the prefix cache's are cache_read_input_tokens)
    cache_creation_input_tokens: int
    cache_read_input_tokens: int  # prompt tokens whose KV the prefix cache supplied
    output_tokens: int


class Message(BaseModel):
    id: str  # msg_<24 hex>
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None  # null in message_start
    stop_sequence: str | None
    usage: Usage


class MessageStart(BaseModel):
    type: Literal["message_start"]
    message: Message


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"]
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock  # empty: text "", input {}, thinking ""


class Ping(BaseModel):
    type: Literal["ping"]


class TextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"]
    partial_json: str  # the pieces concatenate to the call's `input` as JSON text


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"]
    thinking: str


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"]
    index: int


class StopDelta(BaseModel):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class MessageDelta(BaseModel):
    type: Literal["message_delta"]
    delta: StopDelta
    usage: Usage  # cumulative: the whole answer's


class MessageStop(BaseModel):
    type: Literal["message_stop"]


class ErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, request_too_large, ...
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error object: every error answer of these routes, and the `error` event that ends a
    stream that failed after it started."""

    type: Literal["error"]
    error: ErrorDetail


class TokenCount(BaseModel):
    input_tokens: int  # the rendered prompt's tokens, as the engine counts them


STREAM_EVENTS = (
    MessageStart,
    ContentBlockStart,
    Ping,
    ContentBlockDelta,
    ContentBlockStop,
    MessageDelta,
    MessageStop,
    ErrorResponse,
)
