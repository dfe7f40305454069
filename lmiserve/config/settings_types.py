"""The value types of the settings: the words a setting takes (``Literal`` choices), the reasoning
presets and thinking budgets, and ``FieldGroup``, the base of the settings' field groups
(settings_model.py, settings_engine.py, ...) that ``Settings`` (settings.py) is composed from."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class FieldGroup(BaseModel):
    """A group of settings fields: one concern's keys with their defaults, meanings and own checks.

    The descriptions are the documentation: `lmiserve options`, `lmiserve serve --help` and
    docs/configuration.md (scripts/gen_config_reference.py) print them. Write `code` in backticks."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


Dtype = Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"]
# LMI's and TGI's `quantize` (and vLLM's `compressed-tensors`); others are refused
Quantize = Literal["fp8", "awq", "gptq", "mxfp4", "compressed-tensors", "modelopt"]
LoadFormat = Literal["auto", "safetensors", "pt", "dummy"]
OtlpProtocol = Literal["grpc", "http/protobuf"]
KvCacheLayout = Literal["paged"]  # `slots` is refused with its own line (settings_engine.py)
KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]  # vLLM's names (engine/attention/kv_quant.py)
ModelKind = Literal["auto", "llm", "embedding", "classifier", "regression", "torchscript"]
RollingBatch = Literal["auto", "lmi", "disable"]
# `reasoning_parser` presets (vLLM's `--reasoning-parser` names): start and end markers of the reasoning
# block ("" start: the output always starts in it); the other spellings a family writes and the text a
# thinking budget forces to close the block: lmiserve.protocols.textgen.reasoning
REASONING_PRESETS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "deepseek_v3": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "glm47": ("<think>", "</think>"),
    "ernie45": ("<think>", "</think>"),
    "hunyuan_a13b": ("<think>", "</think>"),
    "minimax_m2": ("<think>", "</think>"),
    "mimo": ("<think>", "</think>"),
    "holo2": ("<think>", "</think>"),
    "olmo3": ("<think>", "</think>"),
    "step3": ("", "</think>"),
    "step3p5": ("<think>", "</think>"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "mistral": ("[THINK]", "[/THINK]"),
    "granite": ("Here is my thought process:", "Here is my response:"),
    "openai_gptoss": ("<|channel|>analysis<|message|>", "<|end|>"),
}
ReasoningParser = Literal[
    "deepseek_r1",
    "deepseek_v3",
    "qwen3",
    "glm45",
    "glm47",
    "ernie45",
    "hunyuan_a13b",
    "minimax_m2",
    "mimo",
    "holo2",
    "olmo3",
    "step3",
    "step3p5",
    "seed_oss",
    "mistral",
    "granite",
    "openai_gptoss",
]
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's `reasoning_effort` values
_UNBOUNDED = frozenset({"none", "unlimited", "unbounded", "-1"})


def parse_effort_budgets(value: str) -> dict[str, int | None]:
    """`reasoning_effort_budgets` ("low:1024,medium:none,...") as {effort: thinking tokens, None: no bound};
    `none` is always 0. ValueError for a malformed list."""
    budgets: dict[str, int | None] = {"none": 0}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        effort, sep, tokens = (s.strip().lower() for s in item.partition(":"))
        if not sep or effort not in REASONING_EFFORTS[1:]:
            raise ValueError(f"`{item}`: each item is effort:tokens, effort one of {', '.join(REASONING_EFFORTS[1:])}")
        if tokens in _UNBOUNDED:
            budgets[effort] = None
        elif tokens.isdigit():
            budgets[effort] = int(tokens)
        else:
            raise ValueError(f"`{item}`: tokens is a whole number >= 0 or `none` (no bound)")
    return budgets


# `tool_call_parser` values (vLLM's `--tool-call-parser` names; lmiserve.protocols.textgen.tools.parsers)
ToolCallParser = Literal[
    "auto",
    "json",
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "llama4_pythonic",
    "pythonic",
    "mistral",
    "deepseek_v3",
    "granite",
    "openai",
]
OutputFormatter = Literal["json", "jsonlines", "sse", "tgi_compat"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
