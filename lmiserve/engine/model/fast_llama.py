"""A lean forward pass for Llama-family decoders over the paged KV cache, on ragged batches.

One call runs a whole engine step: the decode rows (one token each) and any number of prefill
chunks (several tokens of one sequence each), each reading and writing its KV through its block
table (engine/attention/paged.py), flattened into one ``[T, hidden]``
batch. Every matrix multiply sees all T tokens at once (one weight read per step), in the shapes
CPU BLAS runs fastest (`cpu_gemm.CpuGemm`: orientation, row blocks, rows padded to a multiple of 8),
or for a few rows (a request's last token and its drafts) a compiled kernel that reads W once.
Attention runs through the model's attention backend (engine/attention/backends.py: Triton on CUDA, the
compiled kernel on CPU fp32 or bf16, torch ops otherwise), whose metadata is planned once a step from the step's
inputs (`StepInputs`, one object: the decode rows, the prompt chunks, the rows kept, the adapters).
An int4 model's steps of a few rows without adapters run their layers through engine/model/q4_decode.py
(four kernel calls a layer, the RMS norms, SiLU and residual adds folded into the kernels).

It reuses the loaded transformers model's weights (`llama_layout.fused_layers`: q/k/v and gate/up
fused, the original modules pointed at their rows; an int4 group mixing int4 and q8 linears as parts
whose products are concatenated), so memory does not grow and the generic path keeps working. RoPE
comes from tables built with the model's own rotary module (`rope_tables`: one a kind of layer, Gemma 3's
local and global). The math mirrors transformers' modules op for op (RMSNorm in fp32, Qwen3's and Gemma 3's
over each query and key head too, OLMo 2's over the whole q and k projections, Gemma's ``1 + w`` before the
cast back; rotate-half RoPE, softmax attention; what each architecture adds: engine/model/layout_variants.py),
so the result differs from the generic path only where a kernel's summation order changes rounding.

A layer's mixture of experts (Mixtral's, the Qwen MoEs') is the model's own block, between these norms and adds.
Models outside the Llama family: `unsupported_reason` says why and the engine uses the generic transformers path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from lmiserve.engine import host_copy
from lmiserve.engine.attention import backends, cpu_kernel
from lmiserve.engine.attention import windows as attention_window
from lmiserve.engine.attention.backends import AttentionBackend, SeqTokens
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache
from lmiserve.engine.attention.scores import soft_cap
from lmiserve.engine.lora.batch import LoraGroup, LoraProducts
from lmiserve.engine.lora.slots import LoraSlots
from lmiserve.engine.model import fused_choice, fused_norm, input_order, q4_decode
from lmiserve.engine.model.cpu_gemm import PAD_ROWS_FROM, VOCAB_PAD_ROWS_FROM, CpuGemm
from lmiserve.engine.model.layer_ops import fused_product, projection_norms, rms_norm, rotate
from lmiserve.engine.model.layout_variants import (
    FP32_WEIGHT_NORM_TYPES,
    LAYER_NORM_TYPES,
    OFFSET_NORM_TYPES,
    Multipliers,
    attention_sinks,
    experts_graph_reason,
    head_norm_weights,
    lora_groups,
    moe_forward,
    norm_of,
    rope_layers,
)
from lmiserve.engine.model.llama_layout import (
    QUANTIZED_LINEARS,
    SUPPORTED_TYPES,
    FusedLayer,
    as_llama,
    fused_layers,
    outputs_of,
    unsupported_reason,
)
from lmiserve.engine.model.rope_tables import RopeTables
from lmiserve.engine.model.sharding import shard_of
from lmiserve.engine.model.step_inputs import DecodeReplay, StepInputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PAD_ROWS_FROM", "SUPPORTED_TYPES", "FastLlama", "StepInputs", "unsupported_reason"]


class FastLlama:
    def __init__(
        self,
        model: PreTrainedModel,
        cache: PagedKVCache,
        max_context: int,
        gemm: CpuGemm | None = None,
        compiled_attention_ok: bool = True,
    ) -> None:
        """`gemm`: the product shapes (default `CpuGemm.for_model`); `compiled_attention_ok`: False keeps
        the torch attention backend where the compiled kernel's would apply (`autotune` decides both)."""
        inner = (llama := as_llama(model)).model
        self.cache = cache
        self.windows = attention_window.layer_windows(model.config)  # each layer's (None: the whole context)
        self.device, self.dtype = model.device, model.dtype
        shape = AttentionShape.of(model.config)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.groups = self.heads // self.kv_heads
        self.embed = inner.embed_tokens.weight
        self.layers = fused_layers(model)  # shared by every engine on this model
        self.model_type = model.config.model_type
        self.decoder_path = getattr(model, "decoder_path", "model")  # (a VLM's: where its decoder is in it)
        self.multipliers = Multipliers.of(model)  # Granite's and Gemma's scalars (1.0 elsewhere)
        # Llama's norms: RMS, before attention and the MLP alone, w after the cast (not Gemma's 1 + w, LayerNorms,
        # gpt-oss's float32 w before the cast)
        self.plain_norms = self.model_type not in (
            *OFFSET_NORM_TYPES,
            *LAYER_NORM_TYPES,
            *FP32_WEIGHT_NORM_TYPES,
        ) and all(layer.in_norm is not None and layer.out_norms is None for layer in self.layers)
        # whether each layer rotates its queries and keys (not SmolLM3's `no_rope_layers`, EXAONE 4's full layers)
        self.rope_layers = rope_layers(model.config)
        # Qwen3's norms of each query and key head, as one weight a layer over the q and k heads (None: none)
        self.head_norms = head_norm_weights(self.layers, self.heads, self.kv_heads)
        self.norm = norm_of(inner.norm, self.model_type)
        head = llama.lm_head
        self.lm_head = head.weight
        # a quantized output projection: a speculative draft's (quantize.quantize_output_int8), an int4
        # model's q8 (quantize.install_output_q8: blocks of 16 rows, the last one maybe padded), or a checkpoint's
        # stored quantized (fp8, 4-bit or 8-bit codes on a GPU: their scales say which product runs it)
        self.lm_head_s = input_order.with_order(head.scales, head) if isinstance(head, QUANTIZED_LINEARS) else None
        self.vocab = outputs_of(head)  # the output projection's width (a tensor-parallel rank's: its part)
        self._max_context = max_context
        # each layer's RoPE table (Gemma 3's local and global), over a head or its first part (Phi-4-mini's)
        self.rope, self.rope_kind = RopeTables.of(model, self.head_dim, max_context)
        self._gemm = gemm if gemm is not None else CpuGemm.for_model(self.device, self.dtype)
        self.sinks = attention_sinks(inner.layers)  # gpt-oss's attention sinks (None: none)
        # the step's attention (backends.py): Triton on CUDA, the compiled kernel on a CPU (`plain_scores`)
        compiled_ok = compiled_attention_ok and self.plain_scores
        self.attention: backends.AttentionBackend = self._scaled(
            backends.choose(cache, self.heads, self.windows, compiled_ok=compiled_ok)
        )
        # decode steps replayed as CUDA graphs (engine/attention/cuda_graphs.py; set by the paged runner)
        self.graphs: DecodeReplay | None = None
        self._open_attention: backends.AttentionBackend | None = None  # (`open_attention`)
        self.graph_refusal = experts_graph_reason(model, self.layers)  # why graphs cannot capture it (None: they can)
        # a tensor-parallel rank's shard (engine/model/sharding.py): its collectives; None: the whole model
        self.tp = shard_of(model)
        # the width of the logits `forward` gives: the vocabulary (a tensor-parallel rank's gathered from every rank's)
        self.logits_width = self.tp.plan.vocab if self.tp is not None else self.vocab
        # an int4 model's layers in few kernel calls (engine/model/q4_decode.py), the whole model on CPU fp32
        self.packed: q4_decode.PackedLayers | None = None
        if self.tp is None and self.dtype == torch.float32 and self.plain_layers:
            dims = (self.heads, self.kv_heads, self.head_dim)
            norm = (self.norm[0], self.norm[1])  # (an RMS norm's: `plain_layers`)
            self.packed = q4_decode.PackedLayers.of(self.layers, dims, norm, (self.lm_head, self.lm_head_s))
        # residual adds with RMS norms, and SiLU with its product, in one kernel each (fused_norm.py; CUDA)
        # (on a GPU: where they measure faster there, fused_choice.py)
        self.fused_elementwise = (
            fused_norm.wanted(self.device) and self.silu_layers and self.plain_norms
            and fused_choice.chosen(fused_choice.LayerShape.of(self), self.dtype, self.device, self.tp is not None)
        )  # fmt: skip
        self.fp8_rows = self.fused_elementwise and fused_norm.fp8_rows_for(self.layers, self.device)  # (its doc)
        self._gemm = self._gemm.warmed(self.dtype, self.device)

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is a Llama layer as q4_decode's kernels compute it: rotated, without norms of
        the heads (Qwen3's), multipliers (Granite's) or Gemma's norms."""
        heads = all(n is None for n in self.head_norms)
        whole = self.rope.rotary_dim == self.head_dim and not self.rope.interleaved
        dense = all(layer.moe is None for layer in self.layers)
        return all(self.rope_layers) and whole and heads and dense and self.multipliers.plain and self.plain_norms

    @property
    def plain_scores(self) -> bool:
        """Whether attention is a plain causal softmax, what the compiled CPU kernel computes: no soft cap (Gemma 2's),
        no sinks (gpt-oss's)."""
        return not self.multipliers.attention_softcap and self.sinks is None

    @property
    def silu_layers(self) -> bool:
        """Whether every layer's activation is SiLU (what `fused_norm.silu_mul` computes), by its values."""
        probe = torch.linspace(-4.0, 4.0, 17, device=self.device, dtype=self.dtype)
        silu = torch.nn.functional.silu(probe)
        return all(torch.equal(layer.act(probe), silu) for layer in self.layers if layer.moe is None)

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def gemm(self) -> CpuGemm:
        return self._gemm

    @property
    def compiled_attention(self) -> bool:
        return isinstance(self.attention, backends.CpuKernelBackend)

    @property
    def triton(self) -> bool:
        return isinstance(self.attention, backends.TritonBackend)

    def use_kernels(self, gemm: CpuGemm, compiled: bool) -> None:
        """Run the next steps with these product shapes and (where it applies, not on Triton's backend)
        the compiled CPU attention, else the torch one."""
        self._gemm = gemm.warmed(self.dtype, self.device)
        if self.triton:
            return
        # (a pool of fp32, bf16 or fp8: the compiled kernel reads each)
        if compiled and self.plain_scores and cpu_kernel.available(self.cache.kv_dtype, self.device):
            self.attention = self._scaled(backends.CpuKernelBackend(self.cache, self.heads, self.windows))
        else:
            self.attention = self._scaled(backends.TorchBackend(self.cache, self.heads, self.windows))

    def open_attention(self) -> backends.AttentionBackend:
        """The torch backend, for a step whose images' tokens see each other both ways (`StepInputs.opens`)."""
        if self._open_attention is None:
            self._open_attention = self._scaled(backends.TorchBackend(self.cache, self.heads, self.windows))
        return self._open_attention

    def _scaled(self, attention: backends.AttentionBackend) -> backends.AttentionBackend:
        """`attention` with the model's scale where it has its own (Granite's `attention_multiplier`)."""
        if self.multipliers.attention is not None:
            attention.scale = float(self.multipliers.attention)
        attention.softcap = self.multipliers.attention_softcap  # (Gemma 2's)
        attention.sinks = self.sinks  # (gpt-oss's)
        return attention

    # ---- one step ----------------------------------------------------------------------------------
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Logits (float32, ``[len(step.keep), vocab]``) of the step's flattened tokens listed in `keep`.
        A step of decode rows alone, every row kept, replays a captured CUDA graph where `graphs` covers
        it (with adapters: where the graphs carry LoRA slots)."""
        dev = self.device
        rows = len(step.decode_ids)
        if rows != len(step.decode_tables) or rows != len(step.decode_positions):
            raise ValueError("every decode row needs its position and its block table")
        graphs = self.graphs if step.embeds is None else None  # (image features: an eager step)
        every = step.keep == list(range(rows))  # every row's logits kept
        if graphs is not None and rows and not step.chunks and every and graphs.covers(rows, step.lora):
            return graphs.run(*step.replayed())
        folded = graphs.run_folded(step) if graphs is not None and step.chunks and step.decode_sources is None else None
        if folded is not None:
            return folded
        if step.decode_sources is not None:
            raise ValueError("decode rows whose inputs are on the device need a step the decode graphs replay")
        ids, positions = step.tokens()
        shifts = step.token_shifts()  # (the positions RoPE rotates at: the attention's plan has the tokens')
        positions = positions if shifts is None else [p + s for p, s in zip(positions, shifts, strict=True)]
        pad = self._gemm.row_padding(len(ids), PAD_ROWS_FROM)  # token 0 at position 0, attends nothing, dropped
        ids += [0] * pad
        positions += [0] * pad
        cos_table, sin_table = self.rope.upto(max(positions) + 1)
        token_ids, pos = host_copy.to_device([ids, positions], dev)  # one copy, not waited for
        cos, sin = cos_table[pos], sin_table[pos]  # [T, kinds, D]
        if step.rope_rows is not None:  # (M-RoPE's image tokens: their rows, made by the model's rotary module)
            at, c, s = step.rope_rows
            cos, sin = cos.index_copy(0, at, c), sin.index_copy(0, at, s)
        tp = self.tp
        x = F.embedding(token_ids, self.embed) if tp is None else tp.embed(token_ids, self.embed)
        x = x if self.multipliers.embedding == 1.0 else x * self.multipliers.embedding
        if step.embeds is not None:  # a VLM's image features in place of their tokens' embeddings
            x = x.index_copy(0, step.embeds[0], step.embeds[1].to(x.dtype))
        seqs = [SeqTokens(t, p, 1) for t, p in zip(step.decode_tables, step.decode_positions, strict=True)]
        opens = step.opens or [()] * len(step.chunks)
        seqs += [SeqTokens(t, start, len(chunk), o) for (t, start, chunk), o in zip(step.chunks, opens, strict=True)]
        attention = self.attention if step.opens is None else self.open_attention()
        meta = attention.plan(seqs, rows, pad)
        keep = step.keep
        deepstack = None if step.deepstack is None or step.embeds is None else (step.embeds[0], step.deepstack)
        x = self._layers(x, cos, sin, meta, step.lora, deepstack, attention)
        count = len(keep)
        keep = keep + keep[:1] * self._gemm.row_padding(count, VOCAB_PAD_ROWS_FROM)  # (on CPU: to a multiple of 8)
        if keep != list(range(x.shape[0])):
            x = x[host_copy.to_device(keep, dev)]
        logits = self._logits(x)[:count].float().contiguous()
        return logits if tp is None else tp.gather_logits(logits)

    def decode_body(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: Any, lora: LoraSlots | None, out: torch.Tensor
    ) -> None:
        """A step of decode rows as tensor ops alone (no host values, no host syncs: what a CUDA graph
        captures): token `ids` at `positions` (device tensors, one a row; the RoPE table must already cover
        them), attention with the backend's metadata `meta` (made from the graph's buffers), the adapters
        of the rows' `lora` slots (engine/lora/slots.py, or None); every row's logits written, as float32,
        into `out` (the graphs' one output buffer). A tensor-parallel rank's: its shard's, its collectives inside (the
        embedding's and the layers' all-reduces, the logits' all-gather)."""
        tp = self.tp
        x = F.embedding(ids, self.embed) if tp is None else tp.embed(ids, self.embed)
        x = x if self.multipliers.embedding == 1.0 else x * self.multipliers.embedding
        products = lora.products(len(ids)) if lora is not None else None
        x = self._layers(x, self.rope.cos[positions], self.rope.sin[positions], meta, products)
        out.copy_(self._logits(x) if tp is None else tp.gather_logits(self._logits(x).float()))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm (with the fused kernels, one: `fused_norm.add_rms_norm`) and the output projection of hidden
        states ``x`` (the model's dtype)."""
        packed, fused = self.packed, self.fused_elementwise
        logits = packed.logits(x) if packed is not None and x.shape[0] <= q4_decode.MAX_ROWS else None
        if logits is None:
            h = fused_norm.add_rms_norm(x, None, self.norm[0], self.norm[1])[1] if fused else rms_norm(x, self.norm)
            logits = self._gemm.linear(h, self.lm_head, None, self.lm_head_s)
        logits = logits if self.multipliers.logits == 1.0 else logits / self.multipliers.logits
        logits = soft_cap(logits, self.multipliers.softcap)  # (Gemma 3's, in the model's dtype)
        return logits if logits.shape[-1] == self.vocab else logits[..., : self.vocab]

    def rope_upto(self, positions: int) -> None:
        """Build the RoPE table for positions ``0..positions-1`` now (a captured graph reads it in place)."""
        self.rope.upto(positions)

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: Any,
        lora: LoraProducts | None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
        attention: backends.AttentionBackend | None = None,
    ) -> torch.Tensor:
        """The decoder layers over the step's hidden states ``x`` (``[T, hidden]``; RoPE rows `cos`/`sin`,
        ``[T, kinds, head_dim]``: `rope_tables`; `deepstack`: `StepInputs.deepstack`, with its token rows;
        `attention`: the backend `meta` was planned by, if not the model's)."""
        packed = self.packed
        if packed is not None and lora is None and deepstack is None and x.shape[0] <= q4_decode.MAX_ROWS:
            return packed.run(x, cos, sin, meta, attention or self.attention)
        tp, gemm, fused, residual_factor = self.tp, self._gemm, self.fused_elementwise, self.multipliers.residual
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        residual: torch.Tensor | None = None  # fused: the last layer's output, added with the next norm
        at, adds = deepstack or (torch.empty(0, dtype=torch.long), [])
        for index, layer in enumerate(self.layers):
            pre, post = layer.in_norm, layer.post_norm  # None: OLMo 2's layers (norms of the outputs alone)
            if fused and pre is not None:
                x, h = fused_norm.add_rms_norm(x, residual, pre[0], pre[1], self.fp8_rows)
            else:
                h = x if pre is None else rms_norm(x, pre)
            qkv = fused_product(gemm, h, layer.qkv).contiguous()
            if lora is not None:
                lora.apply(f"{index}.qkv", h, qkv)
            if layer.proj_norms is not None:  # OLMo 2's: of the whole q and k projections
                qkv = projection_norms(qkv, layer.proj_norms, q_size, kv_size, tp)
            attn = self._attention(index, qkv, cos, sin, meta, attention or self.attention)
            o = gemm.linear(attn, layer.o_w, layer.o_b, layer.o_s)
            if lora is not None:
                lora.apply(f"{index}.o", attn, o)
            if tp is not None:
                o = tp.all_reduce(o)
            o = o if residual_factor == 1.0 else o * residual_factor
            o = o if layer.out_norms is None else rms_norm(o, layer.out_norms[0])
            if fused and post is not None:
                x, h = fused_norm.add_rms_norm(x, o, post[0], post[1], self.fp8_rows)
            else:
                x = x + o
                h = x if post is None else rms_norm(x, post)
            down = self._mlp(index, layer, h, lora) if layer.moe is None else moe_forward(layer.moe, h)
            if tp is not None:
                down = tp.all_reduce(down)
            down = down if residual_factor == 1.0 else down * residual_factor
            down = down if layer.out_norms is None else rms_norm(down, layer.out_norms[1])
            add = adds[index].to(x.dtype) if index < len(adds) else None  # (Qwen3-VL's DeepStack: after the layer)
            if fused:
                residual = down if add is None else down.index_add(0, at, add)
            else:
                x = x + down if add is None else (x + down).index_add(0, at, add)
        return x if residual is None else x + residual

    def _attention(
        self, index: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any, backend: AttentionBackend
    ) -> torch.Tensor:
        """Layer `index`'s attention of the step's q/k/v rows: q's and k's heads normed (Qwen3's) and rotated, the keys
        and values stored, the attention's output. With the fused kernels, where the backend gives its cache
        (`store_target`: Triton's), one kernel norms the heads, rotates and stores (`fused_norm.rope_store`)."""
        head_norm, rope, kind = self.head_norms[index], self.rope_layers[index], self.rope_kind[index]
        c, s = (cos, sin) if cos.shape[1] == 1 else (cos[:, kind : kind + 1], sin[:, kind : kind + 1])
        q_size, kv_size, heads = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.heads
        whole = self.fused_elementwise and rope and c.shape[-1] == self.head_dim and not self.rope.interleaved
        target = backend.store_target(index, meta) if whole else None
        if target is not None and fused_norm.stores_in(target, head_norm, self.dtype):
            q = fused_norm.rope_store(qkv, c, s, heads, self.kv_heads, target, head_norm)
            return fused_norm.attend(backend, index, q, meta, self.fp8_rows)
        if whole and head_norm is None:
            qk = fused_norm.rope(qkv, c, s, heads + self.kv_heads, self.head_dim)
        else:
            qk = qkv[:, : q_size + kv_size].view(-1, heads + self.kv_heads, self.head_dim)
            qk = qk if head_norm is None else rms_norm(qk, head_norm)
            qk = rotate(qk, c, s, self.rope.interleaved) if rope else qk  # (a head's first part: Phi-4-mini's)
        v = qkv[:, q_size + kv_size :].view(-1, self.kv_heads, self.head_dim)
        return backend.forward(index, qk[:, :heads], qk[:, heads:], v, meta)

    def _mlp(self, index: int, layer: FusedLayer, h: torch.Tensor, lora: LoraProducts | None) -> torch.Tensor:
        """A dense layer's MLP over its normed input `h` (an MoE layer's is the model's block: `FusedLayer.moe`)."""
        gate_up = fused_product(self._gemm, h, layer.gate_up)
        if lora is not None:
            lora.apply(f"{index}.gate_up", h, gate_up)
        inter = layer.intermediate
        if not layer.gated:  # (Starcoder2's MLP)
            h = layer.act(gate_up)
        elif self.fused_elementwise:
            h = fused_norm.silu_mul(gate_up, inter, self.fp8_rows)
        else:
            h = layer.act(gate_up[:, :inter]) * gate_up[:, inter:]
        down = self._gemm.linear(h, layer.down_w, layer.down_b, layer.down_s)
        if lora is not None:
            lora.apply(f"{index}.down", h, down)
        return down

    def lora_groups(self) -> list[LoraGroup]:
        """The groups `forward` applies adapters to: each layer's fused q/k/v, o, fused gate/up and down
        (``{layer}.qkv``, ...), their modules named as in the transformers model (`layout_variants.lora_groups`)."""
        shape = (self.heads, self.kv_heads, self.head_dim)
        return lora_groups(self.layers, self.model_type, shape, self.decoder_path)
