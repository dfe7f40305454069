"""The protocols' settings: the LMI routes' output, the TGI and OpenAI routes' limits, reasoning and
tool calls, and the SageMaker and Vertex AI routes."""

from __future__ import annotations

from pydantic import Field, field_validator

from lmiserve.config.settings_types import (
    FieldGroup,
    OutputFormatter,
    ReasoningParser,
    ToolCallParser,
    parse_effort_budgets,
)


class OutputFields(FieldGroup):
    """The LMI routes' answer shapes."""

    output_formatter: OutputFormatter | None = Field(
        None,
        description=(
            "Default output format of LMI requests: `json`, `jsonlines`, `sse` or `tgi_compat`; "
            "unset = `json`, or `jsonlines` (`sse` with `tgi_compat`) when streaming."
        ),
    )
    tgi_compat: bool = Field(
        False,
        description="Answer LMI requests in Text Generation Inference shapes (list wrapper, details, SSE streaming).",
    )


class RouteFields(FieldGroup):
    """The TGI and OpenAI routes (docs/protocols/tgi.md, "Settings (TGI and OpenAI routes)"), SageMaker and
    Vertex AI (docs/protocols/sagemaker.md and docs/protocols/vertex.md, "Reference")."""

    max_concurrent_requests: int = Field(
        128,
        ge=1,
        description=(
            "TGI/OpenAI requests in flight at once; beyond it they get 429 `overloaded` at once (the "
            "`MAX_CONCURRENT_REQUESTS` environment variable sets LMI's `job_queue_size`, not this)."
        ),
    )
    max_best_of: int = Field(2, ge=1, description="Largest TGI `best_of`.")
    max_stop_sequences: int = Field(4, ge=0, description="Most stop sequences of a TGI/OpenAI request.")
    max_top_n_tokens: int = Field(5, ge=0, description="Largest TGI `top_n_tokens`.")
    max_logprobs: int = Field(
        20,
        ge=0,
        description=(
            "Largest OpenAI `logprobs` (completions), `top_logprobs` (chat) and vLLM's `prompt_logprobs` "
            "(vLLM's `--max-logprobs`); above it the request gets 400."
        ),
    )
    max_input_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "TGI/OpenAI longest prompt in tokens (at most `max_input_len` and below `max_total_tokens`); "
            "unset = `max_input_len` if set, else `max_total_tokens` - 1."
        ),
    )
    max_total_tokens: int | None = Field(
        None,
        ge=2,
        description=(
            "TGI/OpenAI limit on prompt + new tokens (TGI's `max_total_tokens`, vLLM's `max_model_len`); "
            "unset or larger = the model's context length. LMI routes always check against the model's context."
        ),
    )
    max_client_batch_size: int = Field(
        4,
        ge=1,
        description=(
            "TGI's `max_client_batch_size`, reported by TGI's `/info`; OpenAI's `/v1/completions` takes up to "
            "`max_rolling_batch_size` (vLLM's `max_num_seqs`) prompts instead."
        ),
    )
    payload_limit: int = Field(
        2_000_000, ge=1, description="Largest TGI/OpenAI request body in bytes; a larger one gets 413."
    )
    sse_keepalive_interval: float = Field(
        15.0, gt=0, description="Seconds without an event before a TGI/OpenAI stream sends a `:` keep-alive comment."
    )
    strict_openai_fields: bool = Field(
        False,
        description=(
            "OpenAI chat and completions: refuse (400) a request with fields the server would accept and ignore "
            "(unknown keys, `user`, ...); off = answer it and name them in the `warnings` response header. "
            'See docs/protocols/openai.md, "Ignored fields".'
        ),
    )
    reasoning_parser: ReasoningParser | None = Field(
        None,
        description=(
            "Chat: split a reasoning model's thinking from its answer (OpenAI's `reasoning_content`, Anthropic's "
            "`thinking` blocks) in its family's format, by vLLM's `--reasoning-parser` names: `deepseek_r1`, "
            "`qwen3`, `glm45`, ... (`<think>`/`</think>`), `seed_oss`, `mistral` (`[THINK]`), `granite` "
            "(`Here is my thought process:`), `openai_gptoss` (harmony's analysis channel); unset = off unless "
            '`reasoning_end` is set. See docs/protocols/openai.md, "Reasoning models".'
        ),
    )
    reasoning_start: str | None = Field(
        None, description="Start marker of the reasoning block (overrides the `reasoning_parser` preset's)."
    )
    reasoning_end: str | None = Field(
        None,
        description=(
            "End marker of the reasoning block (overrides the preset's); without a preset it turns the reasoning "
            "parser on (with no start marker the output always starts in the reasoning)."
        ),
    )
    reasoning_effort_budgets: str = Field(
        "minimal:256,low:1024,medium:none,high:none",
        description=(
            "OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) as thinking budgets, for chat "
            "templates that do not read `reasoning_effort` themselves: `effort:tokens` items (`none`: no bound); "
            "the engine closes the reasoning block after that many tokens. Effort `none` always turns thinking "
            'off (budget 0). See docs/protocols/openai.md, "Reasoning models".'
        ),
        json_schema_extra={
            "allowed": "comma-separated effort:tokens items (effort minimal, low, medium or high; tokens a "
            "whole number or none)"
        },
    )
    tool_call_parser: ToolCallParser = Field(
        "auto",
        description=(
            "How the model writes tool calls (vLLM's `--tool-call-parser` names): `hermes`, `qwen3_coder`, "
            "`llama3_json`, `llama4_pythonic`, `pythonic`, `mistral`, `deepseek_v3`, `granite`, `openai` (gpt-oss "
            "harmony), or `json` (lmiserve's own format, for templates with none); `auto` picks one from the chat "
            "template's tool-call markers and logs the pick (`/info` names it). See docs/structured-output.md."
        ),
    )
    enable_auto_tool_choice: bool = Field(
        True,
        description=(
            'Whether `tool_choice: "auto"` (the default with tools) lets the model call tools; false refuses it '
            "with a 400, as vLLM does without its `--enable-auto-tool-choice`."
        ),
    )
    chat_template: str | None = Field(
        None,
        description=(
            "The chat template to use instead of the tokenizer's: a Jinja file's path or the template text "
            "(vLLM's `--chat-template`)."
        ),
    )
    responses_store_size: int = Field(
        1000,
        ge=0,
        description=(
            "OpenAI Responses API: most responses kept in memory for `previous_response_id` and "
            "`GET /v1/responses/{id}` (least recently used dropped first); 0 stores none."
        ),
    )
    # --- SageMaker and Vertex AI (docs/protocols/sagemaker.md and docs/protocols/vertex.md, "Reference") ---
    default_invocations_accept: str | None = Field(
        None,
        description=(
            "Response type of `/invocations` when a request's `Accept` is missing or `*/*` (`application/json`, "
            "`application/jsonlines` or `text/csv`); unset = the request's own Content-Type."
        ),
    )
    vertex_predict_route: str | None = Field(
        None,
        description=("Extra Vertex AI predict route; `/v1/endpoints/*/deployedModels/*:predict` always works."),
    )
    vertex_health_route: str | None = Field(
        None, description="Extra Vertex AI health route (200 `{}` once every model is ready)."
    )
    vertex_deployed_model_id: str | None = Field(
        None, description='`deployedModelId` in Vertex AI predict answers; unset = `""`.'
    )

    @field_validator("reasoning_effort_budgets")
    @classmethod
    def _check_effort_budgets(cls, value: str) -> str:
        parse_effort_budgets(value)
        return value
