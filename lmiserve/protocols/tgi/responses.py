"""TGI's answers as pydantic models, for the API document (`lmiserve.server.openapi`): the encoders
(`encoders.py`) write the bytes; these describe them, and the schemathesis test checks that they agree."""

from __future__ import annotations

from pydantic import BaseModel


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class BestOfSequence(BaseModel):
    generated_text: str
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(BaseModel):
    """Present with ``parameters.details: true``."""

    finish_reason: str  # length, eos_token or stop_sequence
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    best_of_sequences: list[BestOfSequence] | None = None
    top_tokens: list[list[Token]] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(BaseModel):
    """One event of /generate_stream: a token; the last one also the text and (with details) its details."""

    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None
    details: StreamDetails | None


class TgiStreamError(BaseModel):
    """The last event of a stream that failed after it started."""

    error: str
    error_type: str


class TokenizedToken(BaseModel):
    id: int
    text: str
    start: int  # byte offsets into the UTF-8 text
    stop: int


class ChatTokenizeResponse(BaseModel):
    tokenize_response: list[TokenizedToken]
    templated_text: str


class Info(BaseModel):
    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
    model_dtype: str
    model_device_type: str
    max_input_length: int
    waiting_served_ratio: float
    max_batch_total_tokens: int | None
    max_waiting_tokens: int
    max_batch_size: int | None
    prefix_caching: bool  # lmiserve: prompts reuse the KV of cached prefixes
    prefix_cache_size: int  # lmiserve: bytes the prefix cache's blocks take at most (0: off)
    prefix_cache_tokens: int  # lmiserve: tokens the prefix cache holds at most (0: off)
