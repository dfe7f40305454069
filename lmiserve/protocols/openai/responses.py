"""The OpenAI routes' answers as pydantic models, for the API document (`lmiserve.server.openapi`): the
encoders (`chat_encoders.py`, `completion_encoders.py`) write the bytes; these describe them, and the
schemathesis test checks that they agree."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the prefix cache supplied (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessage(BaseModel):
    role: str
    content: str | None  # null when the message is tool calls
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str  # stop, length (or tool_calls)
    stop_reason: str | int | None  # the stop string or stop token id that ended it (vLLM)


class PromptLogprob(BaseModel):
    """One token of vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None  # 1 + the number of tokens the model found likelier
    decoded_token: str


class ChatCompletion(BaseModel):
    object: str  # chat.completion
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, only when asked


class ChunkChoice(BaseModel):
    index: int
    delta: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None


class ChatCompletionChunk(BaseModel):
    """One event of a chat stream (the last, with `stream_options.include_usage`, has no choices)."""

    object: str  # chat.completion.chunk
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None  # null in a stream's events before the last of a prompt
    stop_reason: str | int | None
    # vLLM's, only with `prompt_logprobs`: null for the first prompt token, then token id -> its entry
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(BaseModel):
    """A completion, and each event of a completion stream (no `usage`, except the last event with
    `stream_options.include_usage`: empty `choices` and the usage)."""

    object: str  # text_completion
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_error, ...
    param: str | None  # the request field at fault, when known
    code: str | None  # model_not_found, invalid_api_key, ... (else null)


class OpenAIError(BaseModel):
    """OpenAI's error object: every error answer of these routes, and the last event of a stream that
    failed after it started (followed by [DONE])."""

    error: OpenAIErrorDetail


OpenAIStreamError = OpenAIError
