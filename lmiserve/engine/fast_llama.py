"""A lean forward pass for Llama-family decoders over the paged KV cache, on ragged batches.

One call runs a whole engine step: the decode rows (one token each) and any number of prefill
chunks (several tokens of one sequence each), each reading and writing its KV through its block
table (engine/paged_attention.py), flattened into one ``[T, hidden]``
batch. Every matrix multiply sees all T tokens at once (one weight read per step), in the shapes
CPU BLAS runs fastest (`cpu_gemm.CpuGemm`: orientation, row blocks, rows padded to a multiple of 8),
or for a few rows (a request's last token and its drafts) a compiled kernel that reads W once.
Only attention is split: on CUDA one Triton kernel a layer for every token (engine/triton_attention.py);
elsewhere one call for all decode rows (a compiled kernel on CPU fp32; torch ops over the gathered
blocks otherwise) and one per prefill chunk (causal over its positions); on CPU fp32 the step's leading
short chunks (drafts being verified, short prompt chunks) join the decode rows' call, one row a token.

It reuses the loaded transformers model's weights (`llama_layout.fused_layers`: q/k/v and gate/up
fused, the original modules pointed at their rows), so memory does not grow and the generic path
keeps working. RoPE comes from a table built with the model's own rotary module. The math mirrors
transformers' Llama modules op for op (RMSNorm in fp32, rotate-half RoPE, softmax attention), so
the result differs from the generic path only where a kernel's summation order changes rounding.

Models outside the Llama family: `unsupported_reason` says why and the engine uses the generic
transformers path. Device-agnostic; tested on CPU only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from lmiserve.engine import attention_window, paged_attention, skinny_gemm, triton_attention
from lmiserve.engine.cpu_gemm import PAD_ROWS_FROM, VOCAB_PAD_ROWS_FROM, CpuGemm
from lmiserve.engine.kv_cache import AttentionShape
from lmiserve.engine.llama_layout import (
    SUPPORTED_TYPES,
    as_llama,
    fused_layers,
    unsupported_reason,
)
from lmiserve.engine.lora import LoraBatch, LoraGroup
from lmiserve.engine.quantize import Int4Linear, Int8Linear
from lmiserve.engine.tensor_parallel import shard_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PAD_ROWS_FROM", "SUPPORTED_TYPES", "FastLlama", "unsupported_reason"]

log = logging.getLogger(__name__)


def _rms(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    weight, eps = norm
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with the sign folded into the table
    (``(-a) * b == a * (-b)`` exactly, so the values are bit-identical, one op fewer)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class DecodeReplay(Protocol):
    """What the forward asks of the decode steps captured as CUDA graphs (engine/cuda_graphs.py's
    `DecodeGraphs`, which builds on this module: this one never imports it)."""

    def covers(self, rows: int) -> bool:
        """A step of `rows` decode rows replays a captured graph."""
        ...

    def run(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab]`` of a step of decode rows."""
        ...


class _Chunk(NamedTuple):
    """A prefill chunk of one step: its block table (a tensor), positions ``start..end-1``, first row in
    the batch and causal mask over ``[0, end)`` (and that of the model's sliding-window layers,
    engine/attention_window.py)."""

    table: torch.Tensor
    start: int
    end: int
    offset: int
    mask: torch.Tensor
    window_mask: torch.Tensor | None = None


class _PagedDecode(NamedTuple):
    """The decode rows of a step: their block tables (``[rows, blocks]``, padded with
    block 0 past each row's own), spans (position + 1) and what every layer shares, built once a step:
    for the compiled kernel its host arguments (`kernel`), else the torch attention's indexes. With the
    compiled kernel the step's leading short prefill chunks join as rows, one a token (`rows` counts
    them too); `write`, then, is where every row's key and value go in a ``[-1, head_dim]`` view of a
    layer's cache (written before the kernel runs, so that no token reads a position of its chunk
    before it is written)."""

    rows: int
    tables: torch.Tensor
    spans: npt.NDArray[np.int64]
    shared: paged_attention.DecodeIndex | None
    kernel: paged_attention.KernelRows | None = None
    write: torch.Tensor | None = None


class FastLlama:
    def __init__(
        self,
        model: PreTrainedModel,
        cache: paged_attention.PagedKVCache,
        max_context: int,
        gemm: CpuGemm | None = None,
        compiled_attention_ok: bool = True,
    ) -> None:
        """`gemm`: the product shapes (default `CpuGemm.for_model`); `compiled_attention_ok`: False keeps
        the torch decode attention where the compiled kernel would apply (`autotune` decides both)."""
        llama = as_llama(model)
        inner = llama.model
        self.cache = cache
        self.windows = attention_window.layer_windows(model.config)  # each layer's (None: the whole context)
        self.device = model.device
        self.dtype = model.dtype
        shape = AttentionShape.of(model.config)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.groups = self.heads // self.kv_heads
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight
        self.layers = fused_layers(model)  # shared by every engine on this model
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        head = llama.lm_head
        self.lm_head = head.weight
        # an output projection quantized for a speculative draft (quantize.quantize_output_int8)
        self.lm_head_s = head.scales if isinstance(head, (Int8Linear, Int4Linear)) else None
        self._rotary = inner.rotary_emb
        self._max_context = max_context
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self._gemm = gemm if gemm is not None else CpuGemm.for_model(self.device, self.dtype)
        # a paged cache on CUDA: every token's attention in one Triton kernel a layer (engine/triton_attention.py)
        self.triton = triton_attention.chosen(self.device) and self._kernel_works()
        # decode steps replayed as CUDA graphs (engine/cuda_graphs.py; set by the paged runner)
        self.graphs: DecodeReplay | None = None
        # a tensor-parallel rank's shard (engine/tensor_parallel.py): its collectives; None: the whole model
        self.tp = shard_of(model)
        self._compiled = compiled_attention_ok and paged_attention.available(self.dtype, self.device)
        self._warm_gemm()
        if self._compiled:
            try:  # compiles (or loads from numba's cache) at load, not on a request
                paged_attention.warm_up()
            except Exception:  # noqa: BLE001 - a numba/llvmlite problem costs speed, not the model
                log.exception("compiled decode attention unavailable; using the torch path")
                self._compiled = False

    def _kernel_works(self) -> bool:
        """The Triton attention kernel run once for this model's attention shape on its device
        (`triton_attention.self_check`); if it fails or disagrees, the torch attention, with a warning."""
        why = triton_attention.self_check(
            self.kv_heads, self.groups, self.head_dim, self.cache.block_size, self.dtype, str(self.device)
        )
        if why is not None:
            log.warning("the Triton paged attention kernel is not used (%s); gathering blocks instead", why)
        return why is None

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def gemm(self) -> CpuGemm:
        return self._gemm

    @property
    def compiled_attention(self) -> bool:
        return self._compiled

    def use_kernels(self, gemm: CpuGemm, compiled: bool) -> None:
        """Run the next steps with these product shapes and (where it applies) the compiled attention."""
        self._gemm = gemm
        self._warm_gemm()
        self._compiled = compiled and paged_attention.available(self.dtype, self.device)
        if self._compiled:
            paged_attention.warm_up()

    def _warm_gemm(self) -> None:
        """Compile the few-row product kernel at load (or on a kernel change), not on a request; if it
        cannot be compiled, products of few rows go through BLAS instead."""
        if self._gemm.few_rows > 1 and skinny_gemm.available(self.dtype, self.device):
            try:
                skinny_gemm.warm_up()
            except Exception:  # noqa: BLE001 - a numba/llvmlite problem costs speed, not the model
                log.exception("compiled few-row products unavailable; using BLAS")
                self._gemm = self._gemm.with_(few_rows=0)

    # ---- RoPE table ------------------------------------------------------------------------------
    def _rope(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        have = self._cos.shape[0]
        if upto > have:
            new = max(upto, min(max(2 * have, 256), max(self._max_context, upto)))
            positions = torch.arange(have, new, device=self.device)[None]
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self._rotary(probe, positions)
            half = self.head_dim // 2
            signed = torch.cat((-sin[0][:, :half], sin[0][:, half:]), dim=-1)
            self._cos = torch.cat([self._cos, cos[0]])
            self._sin = torch.cat([self._sin, signed])
        return self._cos, self._sin

    # ---- one step ----------------------------------------------------------------------------------
    def forward(
        self,
        decode_ids: list[int],
        decode_positions: list[int],
        prefills: list[tuple[list[int], int, list[int]]],
        keep: list[int],
        decode_tables: list[list[int]] | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Logits (float32, ``[len(keep), vocab]``) of the flattened tokens listed in `keep`; `lora`: the
        adapters of the tokens (engine/lora.py, groups named by `lora_groups`).

        Tokens are ordered: decode rows (row i: one token at `decode_positions[i]`, its block table
        `decode_tables[i]`), then each prefill chunk ``(block table, start, ids)`` in turn.
        A step of decode rows alone, every row kept, replays a captured CUDA graph where `graphs` covers it.
        """
        dev = self.device
        rows = len(decode_ids)
        graphs = self.graphs
        if (
            graphs is not None
            and decode_tables
            and not prefills
            and lora is None
            and graphs.covers(rows)
            and keep == list(range(rows))  # every row's logits kept
        ):
            return graphs.run(decode_ids, decode_positions, decode_tables)
        ids = decode_ids + [t for _, _, chunk in prefills for t in chunk]
        positions = list(decode_positions)
        for _, start, chunk in prefills:
            positions.extend(range(start, start + len(chunk)))
        pad = self._row_padding(len(ids), PAD_ROWS_FROM)  # token 0 at position 0, attends nothing, dropped
        ids += [0] * pad
        positions += [0] * pad
        span = max(positions) + 1
        cos_table, sin_table = self._rope(span)
        pos = torch.tensor(positions, device=dev)
        cos, sin = cos_table[pos][:, None], sin_table[pos][:, None]  # [T, 1, D]
        tp = self.tp
        token_ids = torch.tensor(ids, device=dev)
        x = F.embedding(token_ids, self.embed) if tp is None else tp.embed(token_ids, self.embed)
        dec: _PagedDecode | triton_attention.StepTiles | None = None
        short = 0  # prefill chunks computed as decode rows (compiled attention) or in the Triton plan
        tables = [t for t in decode_tables or [] if t] + [key for key, _, _ in prefills]
        self.cache.ensure_zeroed(1 + max((max(t) for t in tables if t), default=-1))
        if rows and (decode_tables is None or len(decode_tables) != rows):
            raise ValueError("every decode row needs its block table")
        if self.triton:  # every token (decode rows and chunks) in one kernel launch a layer
            sequences = [(table, p, 1) for table, p in zip(decode_tables or [], decode_positions, strict=True)]
            sequences += [(key, start, len(chunk)) for key, start, chunk in prefills]
            dec = triton_attention.step_tiles(sequences, self.groups, self.kv_heads, self.cache.block_size, dev)
            short = len(prefills)  # every chunk is in the plan
        else:
            compiled = self._compiled
            kernel_positions, kernel_tables = list(decode_positions), list(decode_tables or [])
            if compiled and CHUNKS_AS_DECODE_ROWS:  # the leading short chunks: rows of the decode kernel
                for key, start, chunk in prefills:
                    if len(chunk) > KERNEL_CHUNK_TOKENS:
                        break
                    kernel_positions.extend(range(start, start + len(chunk)))
                    kernel_tables.extend([key] * len(chunk))
                    short += 1
            if kernel_positions:
                dec = _paged_decode(
                    kernel_positions, kernel_tables, self.cache.block_size, dev, compiled, self.kv_heads, rows
                )
        pre = []
        offset = len(dec.spans) if isinstance(dec, _PagedDecode) else rows
        for key, start, chunk in prefills[short:]:
            end = start + len(chunk)
            chunk_pos = pos[offset : offset + len(chunk)]
            masks = attention_window.chunk_masks(chunk_pos, end, self.windows)
            where = torch.tensor(key, dtype=torch.long, device=dev)
            pre.append(_Chunk(where, start, end, offset, *masks))
            offset += len(chunk)
        x = self._layers(x, cos, sin, dec, pre, pad, lora)
        count = len(keep)
        keep = keep + keep[:1] * self._row_padding(count, VOCAB_PAD_ROWS_FROM)
        if keep != list(range(x.shape[0])):
            x = x[torch.tensor(keep, dtype=torch.long, device=dev)]
        logits = self._logits(x)[:count].float().contiguous()
        return logits if tp is None else tp.gather_logits(logits)

    def decode_body(self, ids: torch.Tensor, positions: torch.Tensor, plan: triton_attention.StepTiles) -> torch.Tensor:
        """A step of decode rows as tensor ops alone (no host values, no host syncs: what a CUDA graph
        captures): token `ids` at `positions` (device tensors, one a row; the RoPE table must already cover
        them), attention through `plan`; float32 logits of every row. The whole model (not a
        tensor-parallel shard)."""
        x = F.embedding(ids, self.embed)
        x = self._layers(x, self._cos[positions][:, None], self._sin[positions][:, None], plan, [], 0, None)
        return self._logits(x).float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the output projection of hidden states ``x`` (the model's dtype)."""
        return self._gemm.linear(_rms(x, self.norm), self.lm_head, None, self.lm_head_s)

    def rope_upto(self, positions: int) -> None:
        """Build the RoPE table for positions ``0..positions-1`` now (a captured graph reads it in place)."""
        self._rope(positions)

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dec: _PagedDecode | triton_attention.StepTiles | None,
        pre: list[_Chunk],
        pad: int,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        """The decoder layers over the step's hidden states ``x`` (``[T, hidden]``; RoPE rows `cos`/`sin`)."""
        tp, gemm = self.tp, self._gemm
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            h = _rms(x, layer.in_norm)
            qkv = gemm.linear(h, layer.qkv_w, layer.qkv_b, layer.qkv_s).contiguous()
            if lora is not None:
                lora.apply(f"{index}.qkv", h, qkv)
            qk = _rotate(qkv[:, : q_size + kv_size].view(-1, self.heads + self.kv_heads, self.head_dim), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, q_size + kv_size :].view(-1, self.kv_heads, self.head_dim)
            attn = self._attention(index, q, k, v, dec, pre, pad)
            o = gemm.linear(attn, layer.o_w, layer.o_b, layer.o_s)
            if lora is not None:
                lora.apply(f"{index}.o", attn, o)
            if tp is not None:
                o = tp.all_reduce(o)
            x = x + o
            h = _rms(x, layer.post_norm)
            gate_up = gemm.linear(h, layer.gate_up_w, layer.gate_up_b, layer.gate_up_s)
            if lora is not None:
                lora.apply(f"{index}.gate_up", h, gate_up)
            inter = layer.intermediate
            h = layer.act(gate_up[:, :inter]) * gate_up[:, inter:]
            down = gemm.linear(h, layer.down_w, layer.down_b, layer.down_s)
            if lora is not None:
                lora.apply(f"{index}.down", h, down)
            if tp is not None:
                down = tp.all_reduce(down)
            x = x + down
        return x

    def lora_groups(self) -> list[LoraGroup]:
        """The groups `forward` applies adapters to: each layer's fused q/k/v, o, fused gate/up and down
        (``{layer}.qkv``, ...), their modules named as in the transformers model."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        groups = []
        for index, layer in enumerate(self.layers):
            at = f"model.layers.{index}"
            attn, mlp, inter = f"{at}.self_attn", f"{at}.mlp", layer.intermediate
            groups += [
                LoraGroup(
                    f"{index}.qkv",
                    ((f"{attn}.q_proj", 0, q), (f"{attn}.k_proj", q, q + kv), (f"{attn}.v_proj", q + kv, q + 2 * kv)),
                ),
                LoraGroup(f"{index}.o", ((f"{attn}.o_proj", 0, layer.o_w.shape[0]),)),
                LoraGroup(f"{index}.gate_up", ((f"{mlp}.gate_proj", 0, inter), (f"{mlp}.up_proj", inter, 2 * inter))),
                LoraGroup(f"{index}.down", ((f"{mlp}.down_proj", 0, layer.down_w.shape[0]),)),
            ]
        return groups

    def _row_padding(self, rows: int, pad_from: int) -> int:
        """Rows to add (on CPU, from `pad_from` rows) up to a multiple of 8 (`CpuGemm.row_padding`)."""
        return self._gemm.row_padding(rows, pad_from)

    def _attention(
        self,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dec: _PagedDecode | triton_attention.StepTiles | None,
        pre: list[_Chunk],
        pad: int,
    ) -> torch.Tensor:
        keys, values = self.cache.keys[index], self.cache.values[index]
        if isinstance(dec, triton_attention.StepTiles):  # pad rows: in no tile, left zero
            n = dec.tokens
            triton_attention.write_step(keys, values, k[:n], v[:n], dec)
            out = triton_attention.paged_attention(q, keys, values, dec, self.scale, window=self.windows[index])
            return out.reshape(len(q), -1)
        return self._paged_attention(keys, values, q, k, v, dec, pre, pad, self.windows[index])

    def _paged_attention(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dec: _PagedDecode | None,
        pre: list[_Chunk],
        pad: int,
        window: int | None,
    ) -> torch.Tensor:
        """`_attention` through the block tables (engine/paged_attention.py): the decode rows in one call that
        writes and attends through their block tables (the compiled kernel on CPU fp32), each prefill
        chunk written into its blocks and attending over its positions: a short chunk (at most
        `KERNEL_CHUNK_TOKENS` tokens, CPU fp32) through the same compiled kernel, each of its tokens a row
        that reads the blocks in place up to its own position; a longer one over its positions gathered
        from the blocks, with SDPA; a sliding-window layer's `window` in each."""
        outputs = []
        if dec is not None:
            n = dec.rows
            query = q[:n].reshape(n, self.kv_heads, self.groups, self.head_dim)
            if dec.kernel is not None:
                if dec.write is not None:  # chunks' tokens among the rows: every key and value written first
                    dim = self.head_dim
                    keys.view(-1, dim).index_copy_(0, dec.write, k[:n].reshape(-1, dim))
                    values.view(-1, dim).index_copy_(0, dec.write, v[:n].reshape(-1, dim))
                out = paged_attention.kernel_decode_attention(
                    query, keys, values, k[:n], v[:n], dec.kernel, self.scale, window
                )
            else:
                out = paged_attention.paged_decode_attention(
                    query, keys, values, k[:n], v[:n], dec.tables, dec.spans, self.scale, dec.shared, window
                )
            outputs.append(out.reshape(n, -1))
        compiled = self._compiled
        for table, start, end, offset, mask, window_mask in pre:
            length = end - start
            paged_attention.write_chunk(
                keys, values, k[offset : offset + length], v[offset : offset + length], table, start
            )
            if compiled and length <= KERNEL_CHUNK_TOKENS:
                # the chunk is written: each token attends over positions up to its own (it writes its
                # own key and value again, the same numbers, so no row reads a position not yet written)
                query = q[offset : offset + length].reshape(length, self.kv_heads, self.groups, self.head_dim)
                out = paged_attention.compiled_decode_attention(
                    query,
                    keys,
                    values,
                    k[offset : offset + length],
                    v[offset : offset + length],
                    table[None].expand(length, -1),
                    np.arange(start + 1, end + 1, dtype=np.int64),
                    self.scale,
                    window=window,
                )
                outputs.append(out.reshape(length, -1))
                continue
            context_k, context_v = paged_attention.gather_context(keys, values, table, end)
            query = q[offset : offset + length].transpose(0, 1)[None]
            key = _repeat(context_k[None], self.groups)
            value = _repeat(context_v[None], self.groups)
            seen = mask if window is None else window_mask
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=seen, scale=self.scale)
            outputs.append(out.transpose(1, 2).reshape(length, -1))
        if pad:
            outputs.append(q.new_zeros(pad, self.heads * self.head_dim))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _paged_decode(
    positions: list[int],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    compiled: bool,
    kv_heads: int,
    decode_rows: int,
) -> _PagedDecode:
    """`positions`/`tables`: the decode rows', then (compiled kernel only) those of the short chunks'
    tokens after the first `decode_rows`."""
    spans = np.array(positions, dtype=np.int64) + 1
    width = max(-(-int(span) // block_size) for span in spans)
    padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
    table = torch.tensor(padded, dtype=torch.long, device=device)
    if compiled:
        write = None
        if len(positions) > decode_rows:
            pos = torch.from_numpy(spans - 1).to(device)
            rows = torch.arange(len(positions), device=device)
            write = paged_attention.flat_index(table[rows, pos // block_size], pos % block_size, kv_heads, block_size)
            write = write.reshape(-1)
        kernel = paged_attention.KernelRows.of(table, spans, kv_heads)
        return _PagedDecode(len(positions), table, spans, None, kernel, write)
    return _PagedDecode(len(positions), table, spans, paged_attention.decode_index(table, spans, block_size, device))


# a paged prefill chunk of at most this many tokens attends through the compiled decode kernel on CPU fp32
# (measured on SmolLM2's attention shape, 2 AMD EPYC cores: 28 tokens after 1,972 take 5.3 ms a layer
# there against 8.9 ms gathered with SDPA; from 64 tokens SDPA wins)
KERNEL_CHUNK_TOKENS = 32
# over a paged cache (CPU fp32) the step's leading chunks of at most KERNEL_CHUNK_TOKENS tokens join the
# decode rows in one kernel call a layer, their keys and values written through an index made once a
# step (a 2-token chunk at position 200 of SmolLM2-135M: attention 10.5 -> 4.6 ms a step on the AMD
# EPYC); False: a kernel call, a write and its index a chunk and a layer (benchmarks/verify_chunk.py's
# "before")
CHUNKS_AS_DECODE_ROWS = True


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, heads, length, dim = x.shape
    return x[:, :, None].expand(b, heads, groups, length, dim).reshape(b, heads * groups, length, dim)
