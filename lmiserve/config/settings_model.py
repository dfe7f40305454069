"""The settings of the model: what is served, where it comes from, how it is loaded, its kind and (for
TorchScript) its tensors. Tensor parallelism's settings, which sit between them in the reference, are
in settings_parallel.py."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import ByteSize, Field, field_validator

from lmiserve.config.settings_types import Dtype, FieldGroup, LoadFormat, ModelKind, Quantize

_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")


class ModelFields(FieldGroup):
    """What is served and how its weights are fetched and loaded."""

    model_id: str | None = Field(
        None,
        description=(
            "The model: a local directory or `.gguf` file; a Hugging Face Hub id (`org/name`; `org/repo:Q4_K_M` "
            "for one file of a GGUF repository), downloaded at start into the Hugging Face cache; or an "
            "`s3://bucket/prefix` or `gs://bucket/prefix` URL, downloaded into `download_dir`. Unset = Vertex AI's "
            "`AIP_STORAGE_URI` when set, else the bundled default model (SmolLM2-135M-Instruct). See docs/models.md."
        ),
    )
    model_name: str | None = Field(
        None, description="Model name reported by `/models` and `/ping`; unset = derived from `model_id`."
    )
    served_model_name: str | None = Field(
        None,
        description=(
            "Other names the OpenAI routes accept as `model`, comma-separated (as vLLM's "
            "`--served-model-name`); `*` accepts any name. Always accepted: the model's name, no `model` "
            "at all, `tgi` and `dummy` (what TGI's clients send), and for the bundled default model "
            "`SmolLM2`, `smollm`, `smollm2` and `HuggingFaceTB/SmolLM2-135M-Instruct`; any other `model` "
            "answers 404. See docs/protocols/openai.md."
        ),
    )
    revision: str | None = Field(None, description="Revision (branch, tag or commit) of a Hugging Face Hub model id.")
    gguf_file: str | None = Field(
        None,
        description=(
            "The `.gguf` file to fetch from a Hub repository of GGUF files (`model_id=org/repo`), instead of a "
            "`:QUANT` tag on the id; without either, a GGUF repository's Q4_K_M file (llama.cpp's default)."
        ),
    )
    download_dir: str | None = Field(
        None,
        description=(
            "Where `s3://` and `gs://` models are downloaded to (one directory a URL, kept between starts); unset = "
            "the user cache dir / `lmiserve/downloads`. Hub models go to the Hugging Face cache (`HF_HOME`, "
            "`HF_HUB_CACHE`)."
        ),
    )
    download_part_size: ByteSize = Field(
        ByteSize(16 << 20),
        ge=4096,
        description=(
            "Bytes one ranged GET of a model download reads (`16MiB`; `64KiB`, `1GB` ... accepted): eight parts "
            "download at a time, and a killed download resumes after the last part written."
        ),
    )
    download_retries: int = Field(
        4,
        ge=0,
        le=20,
        description=(
            "Attempts after the first when a model download meets a network error (no connection, a timeout, "
            "a 429 or 5xx), waiting 1, 2, 4, ... seconds (at most 30) between them."
        ),
    )
    dtype: Dtype = Field(
        "auto",
        description=(
            "Weights and compute dtype: `auto` (fp32 on CPU, bf16/fp16 on GPU), `fp32`, `fp16`, `bf16`, `int8` "
            "(CPU: weight-only int8 linear layers, bf16 activations and KV cache) or `int4` (CPU: linear "
            "layers in 4-bit groups of 32 as GGUF Q4_1, fp32 activations and KV cache; the fastest single "
            "stream). `float32`, `float16`, `half` and `bfloat16` are accepted too. See "
            "docs/performance/dtypes.md."
        ),
    )
    quantize: Quantize | None = Field(
        None,
        description=(
            "Quantized weights (LMI's and TGI's option; vLLM's `quantization`, whose `awq_marlin`, `gptq_marlin` and "
            "`fbgemm_fp8` are taken as `awq`, `gptq` and `fp8`): `fp8`, `awq`, `gptq`, `mxfp4`, `compressed-tensors` "
            "or `modelopt`. Unset = what the checkpoint's `config.json` says (`quantization_config`: "
            "compressed-tensors fp8, 4-bit (W4A16, `pack-quantized`: `awq`, `gptq` and `compressed-tensors` name it) "
            "or int8 (W8A8, W8A16: `compressed-tensors` names it), FBGEMM fp8, NVIDIA ModelOpt's fp8 (`FP8`, "
            "`FP8_PER_CHANNEL_PER_TOKEN`, `FP8_PB_WO`; also from its `hf_quant_config.json`: `fp8` and `modelopt` "
            "name it), AWQ 4-bit, GPTQ 4- or 8-bit, and block-wise fp8, read by lmiserve itself; gpt-oss's MXFP4 "
            "experts, kept MXFP4 on a grouped Triton kernel on a GPU where bf16 would not fit or "
            "`LMISERVE_USE_TRITON_MXFP4=1`, kept MXFP4 on a CPU in fp32 or bf16 (its f4 kernel), else dequantized at "
            "load to the model's dtype). Set, it must name the "
            "checkpoint's format, else the "
            "start stops with one line; `fp8` on a float checkpoint quantizes its linears (a vision-language model's "
            "decoder's, its vision tower kept as loaded) to fp8 at load: per tensor on "
            "CUDA GPUs of compute capability 8.9+ (vLLM's online fp8: one row's product then runs on cuBLAS's "
            "tensor-wise fp8 product with both scales applied there), per output channel elsewhere; "
            "`LMISERVE_FP8_PER_TENSOR=1` (or `0`) in the environment takes one scale a tensor (a channel) "
            "everywhere. A fused product's per-tensor parts (q, k and v; gate and up) are put on the largest of "
            "their scales at start, as vLLM does. fp8 products run on CUDA GPUs of compute capability 8.9+, with "
            "half the weights' memory: up to 16 rows (decode) through whichever of a weight-only Triton kernel and "
            "cuBLAS's fp8 product with the rows in fp8 times fastest at start, else `torch._scaled_mm` (together "
            "0.95x bf16's tokens/s at one stream on an H200, 8B, 2026-12-04). On CUDA GPUs without fp8 products "
            "(compute capability 8.0-8.8: A100, A10G) the fp8 weights stay fp8 where the model in bf16 would take "
            "more than half the GPU's free memory (or with `LMISERVE_USE_TRITON_FP8=1`; `0`: never), every product "
            "through that Triton kernel widening the bytes itself (not yet measured on such a GPU); on a CPU "
            "(fp32 or bf16) they stay fp8 on lmiserve's q8 kernel (each byte widened exactly; a quarter of fp32's "
            "memory; block-wise fp8 and `quantize=fp8` too); elsewhere the weights are de-quantized once at load. "
            "Block-wise fp8 (Qwen3's and DeepSeek's `-FP8` releases) follows "
            "the same rule on every CUDA GPU (compute capability 8.0+; Hopper too: its scales do not go to "
            "`torch._scaled_mm`): fp8 on that Triton kernel with each block's scale where bf16 would not fit or "
            "`LMISERVE_USE_TRITON_FP8=1`, else de-quantized at load (not yet measured on a GPU). AWQ and GPTQ are "
            "de-quantized to bf16 at load on CUDA where the model in bf16 takes at most half the GPU's free memory; "
            "where it would take more (or with `LMISERVE_USE_TRITON_INT4=1` in the environment; `0`: never), groups "
            "of 32n keep their 4-bit codes on lmiserve's Triton kernel (0.30x bf16's tokens/s on an H200, 8B); on "
            "CPU, with groups of 32n, they run on the int4 kernel. compressed-tensors' int8 codes (W8A8, W8A16) "
            "follow the same rule on CUDA (`LMISERVE_USE_TRITON_INT8`), kept int8 on the weight-only Triton kernel "
            "of fp8 weights where bf16 would not fit (W8A8's products there may take their rows in int8 for cuBLAS's "
            "int8 product, where that measures faster). A mixture of experts' fp8 experts (Qwen3-30B-A3B-FP8, "
            "Mixtral's and the Qwen MoEs' fp8 releases; `quantize=fp8` on a float one too) follow the rule of "
            "block-wise fp8 on every CUDA GPU: fp8 on a grouped Triton kernel where bf16 would not fit or "
            "`LMISERVE_USE_TRITON_FP8=1`, else bf16 (not yet measured on a GPU); its AWQ, GPTQ or W4A16 experts "
            "(groups of 32n) follow the rule of the 4-bit linears, their codes on a grouped Triton "
            "kernel where kept, and its GPTQ-Int8, W8A16 or W8A8 experts (symmetric codes) the rule of the "
            "8-bit linears, their codes on the fp8 experts' kernel; on a CPU (computing in fp32 or bf16) all of these "
            "experts stay quantized, on the CPU's q8 kernel (fp8, 8-bit codes), int4 kernel (4-bit codes) or f4 kernel "
            "(MXFP4). "
            "With tensor parallelism each rank "
            "reads and runs its part of "
            "the checkpoint in its format (docs/tensor-parallel.md). See docs/performance/dtypes.md."
        ),
    )
    load_format: LoadFormat = Field(
        "auto",
        description=(
            "`auto` (or `safetensors`, `pt`): the weights in the model directory; `dummy` (vLLM's name): "
            "random weights from the directory's `config.json` (and its tokenizer), so memory and speed of "
            "a 1B or 8B shape can be measured without its weights. The output of a `dummy` model is noise."
        ),
    )
    device: str = Field(
        "auto",
        description="Device: `auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:N`.",
        json_schema_extra={"allowed": "one of auto, cpu, cuda, cuda:N"},
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value in ("auto", "cpu") or _CUDA_DEVICE.fullmatch(value):
            return value
        raise ValueError("unknown device")


class ModelKindFields(FieldGroup):
    """The model's kind, where converted models are kept, and a TorchScript model's inputs and outputs."""

    trust_remote_code: bool = Field(False, description="Allow a model repository to run its own Python code.")
    model_cache_dir: str | None = Field(
        None,
        description="Where the bundled GGUF model is converted to; unset = the user cache dir / `lmiserve`.",
    )
    model_kind: ModelKind = Field(
        "auto",
        description=(
            "`auto` (detected from the model files), `llm`, `embedding`, `classifier` (`regression`: a "
            "classifier with one label) or `torchscript`."
        ),
    )
    input_names: str | None = Field(
        None,
        description=(
            "TorchScript inputs, comma-separated in the order `forward()` takes them; unset = one input `input__0`."
        ),
    )
    input_dtypes: str | None = Field(
        None, description="V2 datatypes of the TorchScript inputs, comma-separated; unset = `FP32` each."
    )
    input_shapes: str | None = Field(
        None,
        description=(
            "Shapes of the TorchScript inputs: `;` between inputs, `,` between dims, `-1` = any size "
            "(e.g. `-1,4;-1`); unset = `-1` each."
        ),
    )
    output_names: str | None = Field(
        None,
        description=(
            "Names of the TorchScript outputs, comma-separated in the order `forward()` returns them; "
            "unset = `output__0`, `output__1`, ..."
        ),
    )
    output_dtypes: str | None = Field(
        None, description="V2 datatypes of the TorchScript outputs, comma-separated; unset = `FP32` each."
    )
    output_shapes: str | None = Field(
        None, description="Shapes of the TorchScript outputs, like `input_shapes`; unset = `-1` each."
    )

    def resolved_model_cache_dir(self) -> Path:
        """``model_cache_dir``, or the platform's user cache dir / lmiserve."""
        if self.model_cache_dir:
            return Path(self.model_cache_dir).expanduser()
        import platformdirs

        return Path(platformdirs.user_cache_dir("lmiserve"))
