"""Any architecture over the block KV cache (Engine v2), through transformers' own paged-attention
interface: the model's forward runs with transformers' attention functions (sdpa or eager), which
hand each layer's new keys and values to a paged cache's ``update`` and attend over what it returns.

A step packs every row's tokens into one sequence (batch 1): token t of a row sits at its position
in that row; `BlockCacheView.update` writes the step's keys and values into the rows' blocks and
returns, for the layer, each row's context gathered from its blocks one after the other; the step's
4D mask lets token t of row r attend to row r's positions up to its own, nothing else. So the same
blocks, scheduler, preemption and prefix sharing serve architectures lmiserve's own forward does not
cover (GPT-2, Phi, ...), without a second attention implementation.

On CUDA (where `triton_ops.chosen`) the gather goes: for the runner's forward the model's attention
implementation is lmiserve's (registered with transformers' `AttentionInterface`), which writes each
layer's keys and values and runs the Triton paged kernel over the blocks in place for every token of the
step (engine/attention/triton_ops.py), with no mask. A model is switched to it only after a probe gives the
same logits both ways (an architecture whose attention takes more than the kernel does, softcapping or a
bias, keeps the gather).

Sliding windows (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, Gemma 3's sliding layers
between full ones): the step's mask has each windowed layer's window in, given to the model's forward
as one mask or one a layer kind, as its own forward takes them (`windows.step_mask`); the kernel
takes the window transformers passes its layer. Left out: layers of other kinds (chunked, linear, ...),
which the engine refuses at start (`unsupported_reason`).

Batch-invariant (`alone=True`, `batch_invariant=true`): each row runs in a forward of its own, its prompt
whole (the scheduler does not chunk it), over its blocks gathered (no kernel): the shapes and the ops of
`model.generate` for that sequence alone, so its greedy output equals generate()'s bit for bit whatever
else runs, at the cost of batching throughput.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from lmiserve.engine import host_copy
from lmiserve.engine.attention import backends
from lmiserve.engine.attention import windows as attention_window
from lmiserve.engine.attention.backends import AttentionBackend, SeqTokens
from lmiserve.engine.attention.kv_quant import KvFormat
from lmiserve.engine.attention.paged import AttentionShape, PagedKVCache, gather_context, paged_cache, write_tokens
from lmiserve.engine.core.step import StepBatch
from lmiserve.engine.lora.adapters import lora_out_features
from lmiserve.engine.lora.batch import LoraBatch, LoraGroup
from lmiserve.engine.runner.persistent_batch import PersistentBatchRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

Span = tuple[int, int, int, int]  # a row of a step's packed tokens: first token, tokens, start position, first key


def _paged_cache_class() -> type:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return PagedAttentionCache


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why `model` cannot run over the block cache through transformers' attention (None: it can)."""
    config = model.config
    kinds = attention_window.unsupported_kinds(config)
    if kinds is not None:
        return kinds
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    try:
        _paged_cache_class()
    except ImportError:  # pragma: no cover - transformers without continuous batching
        return "this transformers has no paged-attention cache"
    return _probe(model)


def _probe(model: PreTrainedModel) -> str | None:
    """Run two tokens through the model over a scratch pool: every attention layer must hand its keys
    and values to the cache's `update` (an architecture whose attention does not go through
    transformers' attention functions would silently attend within the step only)."""
    shape = AttentionShape.of(model.config)
    kv = PagedKVCache(shape.layers, 1, 2, shape.kv_heads, shape.head_dim, model.dtype, model.device)
    kv.ensure_zeroed(1)
    dev = model.device
    table = torch.zeros(1, dtype=torch.long, device=dev)
    view = _view_class()(kv, torch.zeros(2, dtype=torch.long, device=dev), torch.arange(2, device=dev), [(table, 2)])
    calls: list[int] = []
    update = view.update

    def counted(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict[str, Any]) -> Any:
        calls.append(layer_idx)
        return update(key_states, value_states, layer_idx, kwargs)

    view.update = counted
    mask = attention_window.step_mask(model.config, [(0, 2, 0, 0)], 2, 2, model.dtype, dev)  # as the runner's
    try:
        with torch.inference_mode():
            model(
                input_ids=torch.tensor([[1, 2]], device=dev),
                position_ids=torch.arange(2, device=dev)[None],
                attention_mask=mask,
                cache=view,
                use_cache=False,
            )
    except Exception as exc:  # noqa: BLE001 - any failure: this model keeps the slot layout
        return f"its forward does not take a paged cache ({type(exc).__name__}: {exc})"
    if sorted(set(calls)) != list(range(shape.layers)):
        return "its attention does not go through transformers' attention functions"
    return None


class BlockCacheView:
    """What a transformers attention function sees as its paged cache during one forward: `update`
    writes the step's keys and values into the rows' blocks and returns each row's context."""

    def __init__(
        self,
        kv: PagedKVCache,
        write_blocks: torch.Tensor,
        write_offsets: torch.Tensor,
        reads: list[tuple[torch.Tensor, int]],
    ) -> None:
        self.kv, self.write_blocks, self.write_offsets, self.reads = kv, write_blocks, write_offsets, reads

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`key_states`/`value_states`: ``[1, kv_heads, tokens, head_dim]`` of the step's tokens; returns
        ``[1, kv_heads, sum of the rows' context lengths, head_dim]`` (row after row)."""
        keys, values = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        scales = self.kv.scales[layer_idx]  # an fp8 pool's (engine/attention/kv_quant.py)
        write_tokens(
            keys,
            values,
            key_states[0].transpose(0, 1),
            value_states[0].transpose(0, 1),
            self.write_blocks,
            self.write_offsets,
            scales,
        )
        dtype = key_states.dtype
        gathered = [gather_context(keys, values, table, end, dtype, scales) for table, end in self.reads]
        key = torch.cat([k for k, _ in gathered], dim=1) if len(gathered) > 1 else gathered[0][0]
        value = torch.cat([v for _, v in gathered], dim=1) if len(gathered) > 1 else gathered[0][1]
        return key[None], value[None]


def _view_class() -> type:
    """`BlockCacheView` as a subclass of transformers' `PagedAttentionCache` (its attention functions
    check the type); made once, on first use (transformers imported lazily)."""
    global _VIEW
    if _VIEW is None:
        _VIEW = type("PagedBlockCacheView", (BlockCacheView, _paged_cache_class()), {})
    return _VIEW


_VIEW: type | None = None

# lmiserve's attention implementation in transformers' AttentionInterface (`backend_attention`)
BACKEND_ATTENTION = "lmiserve_paged_backend"


class BackendStep:
    """What lmiserve's attention implementation gets as its cache for one forward: the attention backend
    (engine/attention/backends.py) and its metadata for the step's tokens, in the forward's order."""

    def __init__(self, backend: AttentionBackend, meta: Any) -> None:
        self.backend, self.meta = backend, meta


def backend_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract over the block pool: `query`/`key`/`value` ``[1, heads,
    tokens, head_dim]`` of the step's tokens; the backend stores the keys and values in their blocks, then
    every token attends over its own row's positions up to its own. Returns ``[1, tokens, heads,
    head_dim]``. What the backend does not apply (softcapping, sinks, a position bias, another window than
    the layer's) raises: the runner's probe then keeps transformers' own attention over gathered blocks."""
    if not isinstance(cache, BackendStep):
        raise TypeError("lmiserve's paged attention runs only inside lmiserve's paged generic runner")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"lmiserve's paged attention does not take {name}")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError("lmiserve's paged attention needs the attention module's layer_idx")
    backend = cache.backend
    if kwargs.get("sliding_window") != backend.windows[layer]:
        raise ValueError(f"layer {layer}'s window is not the one its config gives")
    tokens, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = backend.forward(layer, q, k, v, cache.meta, scale=scaling)
    return out.view(tokens, heads, dim)[None], None


def _register_backend_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(BACKEND_ATTENTION, backend_attention)


class PagedGenericRunner(PersistentBatchRunner):
    """The transformers model's own forward over the block KV cache (the generic strategy; with `alone`,
    the batch-invariant one)."""

    # whether a runner checks lmiserve's attention backend against transformers' forward at start (a tensor-parallel
    # rank's is not: transformers' forward does not run a shard)
    probes_backend = True

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int],
        num_blocks: int,
        block_size: int,
        alone: bool = False,
        kv_format: KvFormat | None = None,
        scratch_blocks: int = 0,
    ) -> None:
        """`scratch_blocks`: blocks past the `num_blocks` that sequences hold (decode graphs' scratch block)."""
        kv = paged_cache(model, num_blocks + scratch_blocks, block_size, kv_format)
        super().__init__(model, eos_token_ids, kv, num_blocks)
        self.alone = alone
        self.path = "batch_invariant" if alone else "generic"
        self._step_lora: LoraBatch | None = None  # the adapters of the forward running now
        self._hooked: set[str] = set()  # the modules that have the hook
        self._hooked_adapters: set[int] = set()  # the adapter loads whose modules all have it
        shape = AttentionShape.of(model.config)
        # lmiserve's attention backend over the blocks (Triton, the compiled CPU kernel) where one applies and
        # agrees with transformers' own attention; None: transformers' attention over the gathered blocks
        self.attention: AttentionBackend | None = None
        if not alone and self.probes_backend:
            layer_windows = attention_window.layer_windows(model.config)
            backend = backends.choose(self.kv, shape.heads, layer_windows)
            if not isinstance(backend, backends.TorchBackend) or backend.compiled:
                self.attention = backend if self._backend_agrees(backend) else None

    @property
    def kernel(self) -> bool:
        """Whether the forward runs lmiserve's attention backend (else transformers' over gathered blocks)."""
        return self.attention is not None

    @torch.inference_mode()
    def _backend_agrees(self, backend: AttentionBackend) -> bool:
        """Whether the model's forward through `backend` gives the logits of the gathered blocks (a short
        prompt, then a token of it and a chunk of another beside it, over the first blocks of the pool,
        before any request holds them), to 1 %, and in bf16 to 4 units of the rounding of the largest logit (3 %
        of it: the CPU kernel's fp32 sums over a bf16 cache and transformers' bf16 products part by a few)."""
        _register_backend_attention()
        blocks = -(-12 // self.block_size)
        first, second = list(range(blocks)), list(range(blocks, 2 * blocks))
        ids = [(7 * i + 3) % max(2, self.vocab_size) for i in range(12)]
        steps = [
            [(first, 0, ids[:6], 6)],
            [(first, 6, ids[6:7], 1), (second, 0, ids[:4], 4)],
        ]
        try:
            for rows in steps:
                gathered = self._forward(rows, None)
                through = self._forward(rows, backend)
                eps = torch.finfo(self.model.dtype).eps  # bf16: 4 units of the largest logit's rounding
                tol = 1e-2 if eps < 1e-3 else 4 * eps * max(1.0, float(gathered.abs().max()))
                if not torch.allclose(through, gathered, rtol=1e-2, atol=tol):
                    why = f"logits differ by {float((through - gathered).abs().max()):.3g} from the gathered path"
                    log.warning("paged attention backend %s: %s; gathering", backend.name, why)
                    return False
        except Exception:  # noqa: BLE001 - an architecture the backend does not fit keeps the gather
            log.warning("paged attention backend %s: not for this model; gathering", backend.name, exc_info=True)
            return False
        log.info("paged attention: the %s backend over the blocks (engine/attention/backends.py)", backend.name)
        return True

    # ---- LoRA: a hook on each adapted linear adds the step's deltas to its output ---------------------
    def _lora(self, batch: StepBatch, part: list[int], tokens: list[int]) -> LoraBatch | None:
        for i in part:
            adapter = self._requests[batch.rows[i].seq_id].adapter
            if adapter is not None and adapter.id not in self._hooked_adapters:  # its modules, once a load
                for path in adapter.modules:
                    if path not in self._hooked:
                        self._hook(path)
                self._hooked_adapters.add(adapter.id)
        return super()._lora(batch, part, tokens)

    def _hook(self, path: str) -> None:
        module = self.model.get_submodule(path)
        out = lora_out_features(module)
        self.lora_stacks.add_group(LoraGroup(path, ((path, 0, out),)))

        runner = weakref.ref(self)  # the hook stays on the model; it must not keep the runner alive

        def add_deltas(_module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            owner = runner()
            lora = owner._step_lora if owner is not None else None
            if lora is not None:
                x = args[0]
                lora.apply(path, x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1]))

        module.register_forward_hook(add_deltas)
        self._hooked.add(path)

    def _forward_rows(self, batch: StepBatch, part: list[int]) -> torch.Tensor:
        rows = []
        for i in part:
            row = batch.rows[i]
            rows.append((self._requests[row.seq_id].blocks, row.start, row.computed_ids, self._kept(row)))
        if self.alone:  # each row in a forward of its own: generate()'s shapes
            return torch.cat([self._forward_lora(batch, [i], [row], None) for i, row in zip(part, rows)])
        return self._forward_lora(batch, part, rows, self.attention)

    def _forward_lora(
        self,
        batch: StepBatch,
        part: list[int],
        rows: list[tuple[list[int], int, list[int], int]],
        backend: AttentionBackend | None,
    ) -> torch.Tensor:
        """`_forward` of `rows` (rows `part` of the batch) with their adapters' deltas added."""
        self._step_lora = self._lora(batch, part, [len(batch.rows[i].computed_ids) for i in part])
        try:
            return self._forward(rows, backend)
        finally:
            self._step_lora = None

    def _forward(
        self, rows: list[tuple[list[int], int, list[int], int]], backend: AttentionBackend | None
    ) -> torch.Tensor:
        """The float32 logits kept of one forward of `rows`, each ``(blocks, start, token ids, kept)``: the
        ids at positions ``start..``, the last `kept` of them with their logits. `backend`: through lmiserve's
        attention backend, else transformers' attention over the gathered blocks."""
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        write_blocks: list[int] = []
        reads: list[tuple[torch.Tensor, int]] = []
        keep: list[int] = []
        spans: list[Span] = []  # per row: first token, tokens, start position, key offset
        key_offset = 0
        bs = self.block_size
        for blocks, start, computed, kept in rows:
            first, count, end = len(ids), len(computed), start + len(computed)
            ids.extend(computed)
            positions.extend(range(start, end))
            write_blocks.extend(blocks[p // bs] for p in range(start, end))
            if backend is None:
                reads.append((host_copy.to_device(blocks[: -(-end // bs)], dev), end))
            spans.append((first, count, start, key_offset))
            keep.extend(range(first + count - kept, first + count))
            key_offset += end
        self.kv.ensure_zeroed(1 + max(write_blocks))
        model_inputs = self._model_inputs(ids, positions, spans)
        if backend is not None:
            seqs = [SeqTokens(blocks, start, len(computed)) for blocks, start, computed, _ in rows]
            decode_rows = next((i for i, seq in enumerate(seqs) if seq.count != 1), len(seqs))
            meta = backend.plan(seqs, decode_rows, 0)
            config = attention_window.text_config(self.model.config)
            before = config._attn_implementation_internal
            config._attn_implementation_internal = BACKEND_ATTENTION
            try:
                logits = self._logits(model_inputs, cache=BackendStep(backend, meta))
            finally:
                config._attn_implementation_internal = before
            return logits[host_copy.to_device(keep, dev)].float()
        # token t of a row attends to that row's keys at positions <= its own (within a layer's window)
        mask = self._mask(spans, len(ids), key_offset)
        view = _view_class()(
            self.kv,
            *host_copy.to_device([write_blocks, [p % bs for p in positions]], dev),
            reads,
        )
        logits = self._logits(model_inputs, attention_mask=mask, cache=view)
        return logits[host_copy.to_device(keep, dev)].float()

    # ---- what a vision-language model's runner changes (runner/vision.py) ----------------------------
    def _model_inputs(self, ids: list[int], positions: list[int], spans: list[Span]) -> dict[str, Any]:
        """The forward's inputs for the step's packed tokens (`spans`: each row's first token, tokens,
        start position and first key)."""
        both = host_copy.to_device([ids, positions], self.device)  # one copy, not waited for
        return {"input_ids": both[:1], "position_ids": both[1:]}

    def _mask(self, spans: list[Span], tokens: int, keys: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """The step's attention mask(s) over the gathered keys (`attention_window.step_mask`)."""
        return attention_window.step_mask(self.model.config, spans, tokens, keys, self.model.dtype, self.device)

    def _logits(self, model_inputs: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """``[tokens, vocab]``: the model's logits of the step's tokens."""
        logits: torch.Tensor = self.model(**model_inputs, **kwargs, use_cache=False).logits[0]
        return logits
