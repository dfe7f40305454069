"""A GGUF file's own quantized weights as integer codes and float group parameters (issue #41).

`dtype=int4` on a GGUF model serves the file's codes as they are instead of re-quantizing the fp32
weights its conversion (`bundled.convert_gguf`) de-quantized: no loss beyond the file's own. Per
transformers parameter name (`model.layers.3.self_attn.q_proj.weight`, `model.embed_tokens.weight`,
`lm_head.weight`), a tensor of one of these types becomes a form whose `dequantize()` equals, value for
value in fp32, what `gguf.quants.dequantize` makes of it (and so the converted model's weight):

- Q4_0, Q4_1, Q4_K: `Q4Form`, codes 0..15, `w = code * scale + min` per group of 32 inputs.
- Q8_0 (groups of 32), Q6_K (groups of 16), Q5_0 (groups of 32): `Q8Form`, int8 codes, `w = code * scale`.
- Q5_1, Q5_K: `Q8Form` with a `min` (codes 0..31, `w = code * scale + min`, groups of 32).

Other tensors (F32/F16/BF16 norms and weights, Q2_K, Q3_K, IQ*, ...) are left out: their parameters
keep the converted fp32 weights. Only architectures whose linears' names and layout are known here
are read: llama, qwen2, qwen3 and gemma3 (text), whose linears transformers' GGUF loader names alike
(its gemma3 processor only subtracts 1 from the norms, which are not read here). For llama, the rows
of attn_q/attn_k are un-permuted as that loader does (quantization groups run along the inputs, so
permuting output rows keeps every group whole); the others' rows are the file's.

The file is read by `gguf_file` (its header and tensor table, in milliseconds); a form is decoded from
the memory-mapped blocks when it is looked up (`QuantForms`), so a loader holds one at a time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from lmiserve.models.bundled import GGUF_SOURCE_FILE, gguf_cache_key
from lmiserve.models.errors import ModelLoadError
from lmiserve.models.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf

__all__ = ["Q4Form", "Q8Form", "QuantForms", "gguf_quant_forms", "read_quant_forms"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Q4Form:
    """`w[n, k] = codes[n, k] * scale[n, k // 32] + min[n, k // 32]` (fp32, in this order)."""

    codes: torch.Tensor  # uint8 [N, K], values 0..15, in the inputs' natural order (unpacked)
    scale: torch.Tensor  # float32 [N, K // 32]
    min: torch.Tensor  # float32 [N, K // 32]
    qtype: str  # the GGUF type the codes are: Q4_0, Q4_1 or Q4_K
    group_size: ClassVar[int] = 32

    def dequantize(self) -> torch.Tensor:
        return _expand(self.codes, self.scale, self.min)


@dataclass(frozen=True)
class Q8Form:
    """`w[n, k] = codes[n, k] * scale[n, k // G] (+ min[n, k // G] where `min` is given)`, G = `group_size`."""

    codes: torch.Tensor  # int8 [N, K]: -128..127 (Q8_0), -32..31 (Q6_K), -16..15 (Q5_0); 0..31 with a min
    scale: torch.Tensor  # float32 [N, K // G]
    min: torch.Tensor | None  # float32 [N, K // G] (Q5_1, Q5_K), else None
    qtype: str  # the GGUF type: Q8_0, Q6_K, Q5_0, Q5_1 or Q5_K

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        return _expand(self.codes, self.scale, self.min)


QuantForm = Q4Form | Q8Form


def _expand(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> torch.Tensor:
    rows, groups = scale.shape
    w = codes.to(torch.float32).reshape(rows, groups, -1) * scale.unsqueeze(-1)
    if minimum is not None:
        w = w + minimum.unsqueeze(-1)
    return w.reshape(codes.shape)


# ---- block decoders: blocks uint8 [N, blocks per row, bytes per block] -> codes [N, K], scale, min -------

_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]
_SHIFTS = np.array([0, 4], dtype=np.uint8).reshape(2, 1)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 [N, blocks]."""
    raw = np.ascontiguousarray(blocks[..., start : start + 2])
    return raw.view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Per chunk of `width` bytes: their low nibbles, then their high nibbles (ggml's order)."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, -1, 1, width) >> _SHIFTS
    return (q & np.uint8(0x0F)).reshape(*lead, -1)


def _rows(x: np.ndarray) -> np.ndarray:
    """[N, blocks, per block] -> [N, blocks * per block]."""
    return x.reshape(x.shape[0], -1)


def _q4_0(b: np.ndarray) -> _Decoded:  # fp16 d, 16 bytes: w = d * (q - 8)
    d = _f16(b, 0)
    return _rows(_nibbles(b[..., 2:], 16)), d, d * np.float32(-8)  # -8 * d is exact: code*d - 8d == d*(q-8)


def _q4_1(b: np.ndarray) -> _Decoded:  # fp16 d, fp16 m, 16 bytes: w = d * q + m
    return _rows(_nibbles(b[..., 4:], 16)), _f16(b, 0), _f16(b, 2)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: scale d * sc and min -(dmin * m) of the 8 sub-blocks, [N, blocks * 8]."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    shape = (*b.shape[:-1], 8)
    scale = _f16(b, 0)[..., None] * sc.reshape(shape).astype(np.float32)
    minimum = -(_f16(b, 2)[..., None] * m.reshape(shape).astype(np.float32))
    return _rows(scale), _rows(minimum)


def _q4_k(b: np.ndarray) -> _Decoded:  # fp16 d, fp16 dmin, 12 bytes scales, 128 bytes qs: w = d*sc*q - dmin*m
    scale, minimum = _k_scales(b)
    return _rows(_nibbles(b[..., 16:], 32)), scale, minimum


def _q8_0(b: np.ndarray) -> _Decoded:  # fp16 d, 32 int8: w = d * q
    return _rows(np.ascontiguousarray(b[..., 2:]).view(np.int8)), _f16(b, 0), None


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the little-endian uint32 is the fifth bit of value j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q5_0(b: np.ndarray) -> _Decoded:  # fp16 d, 4 bytes qh, 16 bytes qs: w = d * (q - 16)
    q = _nibbles(b[..., 6:], 16) | (_high_bits32(b[..., 2:6]) << np.uint8(4))
    return _rows(q.astype(np.int8) - np.int8(16)), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> _Decoded:  # fp16 d, fp16 m, 4 bytes qh, 16 bytes qs: w = d * q + m
    q = _nibbles(b[..., 8:], 16) | (_high_bits32(b[..., 4:8]) << np.uint8(4))
    return _rows(q.astype(np.int8)), _f16(b, 0), _f16(b, 2)


def _q5_k(b: np.ndarray) -> _Decoded:  # Q4_K's header, 32 bytes qh, 128 bytes qs: w = d*sc*q - dmin*m
    scale, minimum = _k_scales(b)
    bits = np.unpackbits(b[..., 16:48], axis=-1, bitorder="little")  # [.., 32 bytes * 8 bits]
    high = bits.reshape(*b.shape[:-1], 32, 8).swapaxes(-1, -2)  # value i*32 + j: bit i of byte j
    q = _nibbles(b[..., 48:], 32) | (high.reshape(*b.shape[:-1], 256) << np.uint8(4))
    return _rows(q.astype(np.int8)), scale, minimum


def _q6_k(b: np.ndarray) -> _Decoded:  # 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d: w = d*sc*(q - 32)
    lead = b.shape[:-1]
    low = _nibbles(b[..., :128], 64)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = low | ((qh & np.uint8(0x03)).reshape(*lead, 256) << np.uint8(4))
    scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return _rows(q.astype(np.int8) - np.int8(32)), _rows(_f16(b, 208)[..., None] * scales), None


_DECODERS: dict[str, tuple[Callable[[np.ndarray], _Decoded], bool]] = {  # type name -> (decoder, is a Q4Form)
    "Q4_0": (_q4_0, True),
    "Q4_1": (_q4_1, True),
    "Q4_K": (_q4_k, True),
    "Q8_0": (_q8_0, False),
    "Q6_K": (_q6_k, False),
    "Q5_0": (_q5_0, False),
    "Q5_1": (_q5_1, False),
    "Q5_K": (_q5_k, False),
}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def decode_blocks(data: np.ndarray, qtype: str) -> QuantForm | None:
    """The form of a 2-D tensor's raw blocks (uint8 [N, bytes per row], as `GGUFReader` gives them), or
    None for a type without one."""
    entry = _DECODERS.get(qtype)
    if entry is None or data.ndim != 2:
        return None
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    decoder, is_q4 = entry
    codes, scale, minimum = decoder(np.asarray(data, dtype=np.uint8).reshape(data.shape[0], -1, type_size))
    if is_q4:
        assert minimum is not None
        return Q4Form(torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(minimum), qtype)
    return Q8Form(
        torch.from_numpy(codes), torch.from_numpy(scale), None if minimum is None else torch.from_numpy(minimum), qtype
    )


# ---- names and layout ----------------------------------------------------------------------------------

# GGUF general.architecture values read (transformers: llama, mistral, qwen2, qwen3, gemma3_text): their
# linears' names are `_LAYER_NAMES`' and only llama's rows are permuted (`_rope_heads`)
_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """The transformers parameter of a llama/qwen2/qwen3/gemma3 GGUF weight (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); None for norms (qwen3's and gemma3's q/k norms
    included), biases and unknown tensors."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
        return None
    module = _LAYER_NAMES.get(parts[2])
    return None if module is None else f"model.layers.{parts[1]}.{module}.weight"


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row i of the transformers weight is row `index[i]` of the GGUF one: transformers'
    `LlamaTensorProcessor._reverse_permute_weights` (undoing llama.cpp's RoPE permutation) as an index."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)


def _permuted(form: QuantForm, index: np.ndarray) -> QuantForm:
    rows = torch.from_numpy(index)
    minimum = None if form.min is None else form.min[rows]
    if isinstance(form, Q4Form):
        assert minimum is not None
        return Q4Form(form.codes[rows], form.scale[rows], minimum, form.qtype)
    return Q8Form(form.codes[rows], form.scale[rows], minimum, form.qtype)


def _rope_heads(fields: dict[str, Any], arch: str, name: str) -> int | None:
    """The head count transformers un-permutes `name`'s rows by (llama's attn_q/attn_k), else None. As in
    transformers, a file without both head counts is loaded unpermuted."""
    if arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return None
    heads, kv_heads = fields.get("llama.attention.head_count"), fields.get("llama.attention.head_count_kv")
    if heads is None or kv_heads is None:
        return None
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise ValueError(f"per-layer head counts ({heads!r}, {kv_heads!r}) are not supported")
    return heads if ".attn_q." in name else kv_heads


class QuantForms(Mapping[str, QuantForm]):
    """A file's forms by transformers parameter name, each decoded from the file when looked up (not
    kept: a 7B Q4_K_M's codes unpacked to a byte each would be 7 GB at once)."""

    def __init__(self, file: GGUFFile, entries: dict[str, tuple[GGUFTensorInfo, int | None]]) -> None:
        self.file, self._entries = file, entries  # name -> (tensor, heads to un-permute its rows by)

    def gguf_name(self, name: str) -> str:
        """The file's tensor `name`'s form comes from (`token_embd.weight` for a tied `lm_head.weight`)."""
        return self._entries[name][0].name

    def __getitem__(self, name: str) -> QuantForm:
        tensor, heads = self._entries[name]
        form = decode_blocks(self.file.blocks(tensor), tensor.type_name)
        assert form is not None  # only decodable tensors are entries
        return form if heads is None else _permuted(form, unpermute_rows(form.codes.shape[0], heads))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def read_quant_forms(gguf_path: str | os.PathLike[str]) -> QuantForms | None:
    """The forms of `gguf_path`'s quantized weights by transformers parameter name, as transformers'
    GGUF loader lays them out; None (serve the converted floats) for an architecture not read here.
    A tied output (no `output.weight`) is `lm_head.weight` too, the form of the embeddings' tensor."""
    start = time.monotonic()
    file = read_gguf(gguf_path)
    arch = file.fields.get("general.architecture")
    if arch not in _ARCHITECTURES:
        logger.info("GGUF codes: architecture %r is not one of %s; int4 re-quantizes its weights", arch, _ARCHITECTURES)
        return None
    entries: dict[str, tuple[GGUFTensorInfo, int | None]] = {}
    used: Counter[str] = Counter()
    floats: Counter[str] = Counter()
    for tensor in file.tensors:
        name, qtype = hf_name(tensor.name), tensor.type_name
        if name is None:
            continue
        if qtype not in _DECODERS or len(tensor.dims) != 2:
            floats[qtype] += 1
            continue
        entries[name] = (tensor, _rope_heads(file.fields, arch, tensor.name))
        used[qtype] += 1
    if "output.weight" not in {t.name for t in file.tensors} and "model.embed_tokens.weight" in entries:
        entries["lm_head.weight"] = entries["model.embed_tokens.weight"]
    logger.info(
        "GGUF codes: indexed %s of %s in %.2f s%s",
        ", ".join(f"{n} {t}" for t, n in sorted(used.items())) or "no weights",
        Path(gguf_path).name,
        time.monotonic() - start,
        "; float (converted) weights for " + ", ".join(f"{n} {t}" for t, n in sorted(floats.items())) if floats else "",
    )
    return QuantForms(file, entries)


def gguf_quant_forms(model_dir: str | os.PathLike[str]) -> QuantForms | None:
    """The GGUF codes of a directory `convert_gguf` made (it records its source file in
    `lmiserve_gguf.json`); None for any other directory, or when the source file is gone or changed, or
    its architecture is not read here: then the converted fp32 weights are all there is."""
    record_path = Path(model_dir) / GGUF_SOURCE_FILE
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        source, key = Path(record["gguf_path"]), record["gguf_cache_key"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("GGUF codes: unreadable %s (%s); int4 re-quantizes the converted weights", record_path, exc)
        return None
    try:
        if gguf_cache_key(source) != key:
            logger.warning(
                "GGUF codes: %s changed since its conversion; int4 re-quantizes the converted weights", source
            )
            return None
        return read_quant_forms(source)
    except (OSError, ValueError, ModelLoadError) as exc:
        logger.warning("GGUF codes: cannot read %s (%s); int4 re-quantizes the converted weights", source, exc)
        return None
