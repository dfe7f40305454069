"""What the paged KV cache stores (`kv_cache_dtype`, vLLM's option), where that is not the model's dtype. An fp8
pool keeps keys and values in one byte an element, so the same memory holds twice the blocks of a bf16 pool (four
times those of an fp32 one); a bf16 pool under an fp32 model (a CPU's default) holds twice its blocks.

- ``auto`` (default): the model's dtype, as before.
- ``bfloat16``: ``torch.bfloat16``; under an fp32 model writes round to it and reads widen exactly, with fp32
  arithmetic (no scales). The same as ``auto`` for a bf16 model; refused for an fp16 one.
- ``fp8`` = ``fp8_e4m3``: ``torch.float8_e4m3fn`` (3 mantissa bits, saturates at +-448).
- ``fp8_e5m2``: ``torch.float8_e5m2`` (2 mantissa bits, range to +-57344).

Each layer has a scale for its keys and one for its values (vLLM's ``k_scale``/``v_scale``): a write stores
``clamp(x / scale)`` cast to the fp8 type (saturating at the type's largest finite value, never inf), a read
casts back to the compute dtype and multiplies by the scale. As in vLLM the scales are 1.0 unless the
checkpoint carries them (`checkpoint_scales`: ``...layers.N.self_attn.k_scale``/``v_scale``, an older
``kv_scale`` for both, or ``k_proj.output_scale``/``v_proj.output_scale``).

Where the reads happen: attention/paged.py (torch gather path, prefill context) and the Triton kernel
(attention/triton_kernel.py: loads, casts and scales in the kernel) read any pool whose type is not the compute
dtype's, as does the compiled CPU kernel (attention/cpu_kernel.py: a bf16 value's or an fp8 byte's bits widened
exactly; the key scale folded into the scores' scale, the value scale applied to the output).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "KV_CACHE_DTYPES",
    "UNIT",
    "KvFormat",
    "checkpoint_scales",
    "dequantize",
    "index_store",
    "is_fp8",
    "quantize",
    "storage_dtype",
    "store",
]

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
UNIT: tuple[float, float] = (1.0, 1.0)  # a layer's (key scale, value scale) when none is given


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `kv_cache_dtype` `name` (``auto``: the model's). ``bfloat16`` under an fp16
    model is refused: the same bytes with 3 fewer mantissa bits."""
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        if model_dtype == torch.float16:
            raise ValueError("kv_cache_dtype=bfloat16 would round an fp16 model's keys and values in the same memory")
        return torch.bfloat16
    if name not in _FP8:
        raise ValueError(f"kv_cache_dtype={name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return _FP8[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as stored in a pool of `dtype`: for fp8, ``x / scale`` (in fp32) clamped to the type's finite
    range and cast (round to nearest); any other dtype, a plain cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored values `x` back in the compute `dtype` (times `scale` for an fp8 pool)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    out = x.to(dtype)
    return out if scale == 1.0 else out * scale


def index_store(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``target.index_copy_(0, index, rows)``; an fp8 `target` through byte views (torch has no fp8
    ``index_copy_`` on CPU)."""
    if is_fp8(target.dtype):
        target.view(torch.uint8).index_copy_(0, index, rows.to(target.dtype).view(torch.uint8))
    else:
        target.index_copy_(0, index, rows)


def store(target: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, scale: float = 1.0) -> None:
    """`rows` quantized for `target` (`quantize`) and stored at rows `index` of it (`index_store`)."""
    index_store(target, index, quantize(rows, target.dtype, scale))


@dataclass(frozen=True)
class KvFormat:
    """How a paged pool stores its keys and values: `name` (a `KV_CACHE_DTYPES` word) and per layer the
    (key, value) scales (empty: 1.0 for every layer)."""

    name: str = "auto"
    scales: tuple[tuple[float, float], ...] = ()

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return storage_dtype(self.name, model_dtype)

    def layer_scales(self, layers: int) -> list[tuple[float, float]]:
        if not self.scales:
            return [UNIT] * layers
        if len(self.scales) != layers:
            raise ValueError(f"{len(self.scales)} KV scales for {layers} layers")
        return list(self.scales)

    @classmethod
    def of(cls, name: str, checkpoint: str | Path | None, layers: int) -> KvFormat:
        """The format `kv_cache_dtype` `name` asks for, with the scales of the checkpoint in `checkpoint`
        where it has them (fp8 only; else 1.0)."""
        storage_dtype(name, torch.float32)  # an unknown name raises here
        if name not in _FP8 or checkpoint is None:
            return cls(name)
        return cls(name, checkpoint_scales(str(checkpoint), layers))


_SCALE = re.compile(r"layers\.(\d+)\..*?(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return sorted({folder / name for name in weight_map.values()})
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


@functools.cache
def checkpoint_scales(path: str, layers: int) -> tuple[tuple[float, float], ...]:
    """Each layer's (key, value) scale from the safetensors checkpoint in `path`; () when it carries none
    (or not one for every layer, or one that is not a finite positive number: logged, 1.0 is used)."""
    found: dict[int, dict[str, float]] = {}
    try:
        from safetensors import safe_open

        for file in _safetensors_files(Path(path)):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open's handle is not a mapping
                    match = _SCALE.search(name)
                    if match is None:
                        continue
                    value = float(handle.get_tensor(name).float().max())
                    kind = match.group(2).split(".")[0].replace("_proj", "_scale")
                    found.setdefault(int(match.group(1)), {})[kind] = value
    except Exception:  # noqa: BLE001 - unreadable scales cost accuracy at the edges, not the start
        log.exception("reading the KV cache scales of %s failed; using 1.0", path)
        return ()
    if not found:
        return ()
    scales = []
    for layer in range(layers):
        entry = found.get(layer, {})
        k = entry.get("k_scale", entry.get("kv_scale"))
        v = entry.get("v_scale", entry.get("kv_scale"))
        if k is None or v is None or not all(math.isfinite(s) and s > 0 for s in (k, v)):
            log.warning("the checkpoint in %s has no usable KV scales for layer %d; using 1.0 everywhere", path, layer)
            return ()
        scales.append((k, v))
    log.info(
        "KV cache scales from the checkpoint: keys %s, values %s",
        _span(s[0] for s in scales),
        _span(s[1] for s in scales),
    )
    return tuple(scales)


def _span(values: Iterable[float]) -> str:
    items = list(values)
    return f"{min(items):.4g}..{max(items):.4g}"
