"""The settings that spread or extend one model's work: tensor parallelism (over devices and nodes),
speculative decoding and LoRA adapters. What they do not combine with is checked with every other
setting in sight (settings_checks.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from lmiserve.config.lora import parse_lora_adapters, parse_lora_modules
from lmiserve.config.settings_types import FieldGroup
from lmiserve.config.speculative import SpeculativeConfig, parse_speculative_config
from lmiserve.config.spellings import LMI_SPECULATIVE_LENGTH


class TensorParallelFields(FieldGroup):
    """Devices and nodes one model is split over, and where their ranks meet."""

    tensor_parallel_degree: str | None = Field(
        None,
        description=(
            "Devices one model is split over (LMI's key; vLLM's `tensor_parallel_size`): a number of worker "
            "processes, one a device (GPUs with NCCL; CPU processes with gloo), each holding a shard of the "
            "weights and of the KV cache; `max`: every visible GPU (1 on a CPU). Over several nodes it counts "
            "the ranks of all of them. Llama-family models on the fast path (docs/tensor-parallel.md)."
        ),
        json_schema_extra={"allowed": "a positive whole number or max"},
    )
    nnodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes the tensor-parallel ranks run on (vLLM's `--nnodes`; torchrun's and LeaderWorkerSet's "
            "variables): node 0 serves HTTP, the others only compute. Every node runs the same command."
        ),
    )
    node_rank: int = Field(
        0, ge=0, description="This node's rank among `nnodes` (vLLM's `--node-rank`; 0: the leader, which serves HTTP)."
    )
    master_addr: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Where the tensor-parallel ranks meet: the leader node's address (torchrun's MASTER_ADDR).",
    )
    master_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "The rendezvous port on `master_addr` (torchrun's MASTER_PORT); unset: a free port on one node, "
            "29500 over several."
        ),
    )
    step_timeout: float = Field(
        300.0,
        gt=0,
        description=(
            "Seconds a tensor-parallel step may take: past it the workers are taken as hung, the model turns "
            "unhealthy and `lmiserve serve` exits (code 4) for the orchestrator to restart it."
        ),
    )

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _check_tensor_parallel(cls, value: Any) -> Any:
        if value is None:
            return None
        text = str(value).strip().lower()
        if text == "max":
            return text
        if not text.isdigit() or int(text) < 1:
            raise ValueError("expected a positive whole number or max")
        return str(int(text))


class SpeculativeFields(FieldGroup):
    """Speculative decoding: vLLM's `speculative_config`, or LMI's older keys."""

    speculative_config: SpeculativeConfig | None = Field(
        None,
        description=(
            "Speculative decoding, as vLLM's JSON object: `method` (`ngram`, `draft_model`, `self_draft`), "
            "`model`, `num_speculative_tokens`, `prompt_lookup_min`/`prompt_lookup_max`, the draft's `dtype`, "
            "`disable_by_batch_size`, `min_acceptance_rate`. Output is unchanged: greedy token for token, "
            "sampling from the model's own distribution. Not with batch_invariant. See docs/speculative-decoding.md."
        ),
        json_schema_extra={"allowed": 'a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}'},
    )
    speculative_draft_model: str | None = Field(
        None,
        description=(
            "LMI's older key: the draft model's directory (as `speculative_config` with `method` "
            "`draft_model`); not with `speculative_config`."
        ),
    )
    speculative_length: int | None = Field(
        None, ge=1, le=16, description="LMI's older key: drafts a step verifies (with `speculative_draft_model`)."
    )

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: Any) -> Any:
        return parse_speculative_config(value)

    def _fold_lmi_speculative(self) -> None:
        """LMI's `speculative_draft_model` / `speculative_length` as a `speculative_config`."""
        draft, length = self.speculative_draft_model, self.speculative_length
        if draft is None and length is None:
            return
        if self.speculative_config is not None:
            raise ValueError("give speculative_config or speculative_draft_model/speculative_length, not both")
        if draft is None:
            raise ValueError("speculative_length needs speculative_draft_model (or use speculative_config)")
        self.speculative_config = SpeculativeConfig(
            method="draft_model", model=draft, num_speculative_tokens=length or LMI_SPECULATIVE_LENGTH
        )


class LoraFields(FieldGroup):
    """LoRA adapters: whether they are served, how many, and those registered at start."""

    enable_lora: bool = Field(
        False,
        description=(
            "Serve LoRA adapters on the model: registered at start (`lora_modules`, `lora_adapters`, an "
            "`adapters/` folder next to the model) or at run time (the adapters API). Implied by "
            "`lora_modules` and `lora_adapters`. Not with batch_invariant. See docs/lora.md."
        ),
    )
    max_loras: int = Field(4, ge=1, le=256, description="Adapters that may run in one step (vLLM's `max_loras`).")
    max_lora_rank: int = Field(
        16, ge=1, le=1024, description="Highest LoRA rank an adapter may have; a higher one is refused when loaded."
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description=(
            "Adapters kept loaded in memory (the least recently used one that no request uses and that is "
            "not pinned is dropped, and loads again when asked for); unset = `max_loras`, never fewer."
        ),
    )
    lora_modules: str | None = Field(
        None,
        description=(
            "Adapters at start, as vLLM names them: `name=path` items separated by spaces or commas, or JSON objects "
            '`{"name": ..., "path": ...}`.'
        ),
    )
    lora_adapters: str | None = Field(
        None,
        description=(
            "TGI's adapters at start (`LORA_ADAPTERS`): comma-separated `name=path` or `path` (named after its folder)."
        ),
    )

    def start_adapters(self) -> list[tuple[str, str]]:
        """The adapters `lora_modules` and `lora_adapters` name, as (name, path) pairs."""
        pairs = parse_lora_modules(self.lora_modules or "") + parse_lora_adapters(self.lora_adapters or "")
        names = [name for name, _ in pairs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"adapter {twice[0]!r} is named by both lora_modules and lora_adapters")
        return pairs
