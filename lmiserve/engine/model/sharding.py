"""Tensor parallelism of the fast runner's Llama-family models: which degrees a model allows, the
shard of its weights a rank keeps, and the collectives its forward needs (torch.distributed).

A rank of ``world`` keeps (Megatron's split, as vLLM's layers do):

- q/k/v and gate/up *column-parallel*: the rows of its attention heads (``heads / world`` query heads and
  their KV heads) and its slice of the intermediate size, so attention and the activation run on local
  data;
- o and down *row-parallel*: the matching columns; each rank's product is a partial sum, all-reduced
  (a row-parallel bias is added by rank 0 only);
- a mixture of experts (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, GLM-4.5's, gpt-oss's) *split in every expert*, as vLLM's
  default: each expert's gate/up rows and down columns of the rank's slice of the experts' intermediate size
  (a shared expert's likewise), the router whole on every rank; so every rank routes each token as the whole
  model does, runs every expert on its slice, and the block's output is a partial sum, all-reduced as a
  dense MLP's;
- the embedding and the output projection *vocabulary-parallel*: rows ``[rank * part, (rank + 1) * part)``
  of the vocabulary (the last part padded with zero rows). An embedding lookup outside a rank's rows
  gives zeros and the all-reduce sums the one rank that has it; the output logits are all-gathered, so
  every rank holds the whole ``[rows, vocab]`` (and samples what rank 0 samples).
- KV heads: split when ``world`` divides them; with fewer KV heads than ranks each KV head is kept by the
  ``world / kv_heads`` ranks whose query heads read it (replicated).

A LoRA adapter is cut as the linears it adapts (`shard_adapter`): B's output rows of a column-parallel
linear, A's input columns of a row-parallel one (its partial products summed by the same all-reduce).

Sharding edits the loaded transformers model in place (its linears point at their slices; its config
says the local head counts), so `FastLlama` and the KV pool, which read the model and its config, run a
shard as they run a whole model; only `FastLlama.forward` calls `TensorParallelShard`'s collectives.
The transformers forward of a sharded model is not usable (the generic runner is not sharded).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from lmiserve.engine.model.language_model import language_model
from lmiserve.engine.model.layout_variants import VLM_DECODER_TYPES, moe_block
from lmiserve.engine.model.llama_layout import QUANTIZED_LINEARS, SUPPORTED_TYPES, LlamaFamily

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PretrainedConfig, PreTrainedModel

    from lmiserve.engine.lora.adapters import LoraAdapter


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` keeps: query heads ``[q_first, q_first + q_heads)``, KV heads
    ``[kv_first, kv_first + kv_heads)`` (of the model's `kv_total`), the `rank`-th of `world` equal parts of
    each intermediate size (`part`), vocabulary rows ``[vocab_first, vocab_first + vocab_part)`` (the last part
    may run past the vocabulary: zero rows)."""

    rank: int
    world: int
    head_dim: int
    q_first: int
    q_heads: int
    kv_first: int
    kv_heads: int
    kv_total: int
    vocab: int
    vocab_first: int
    vocab_part: int

    def heads(self) -> slice:
        """The rank's query heads (of a tensor with one row a head: gpt-oss's sinks)."""
        return slice(self.q_first, self.q_first + self.q_heads)

    def part(self, size: int) -> slice:
        """The rank's part of an intermediate size `size` (a dense MLP's, an expert's, a shared expert's)."""
        n = size // self.world
        return slice(self.rank * n, (self.rank + 1) * n)


# the intermediate sizes of a config that tensor parallelism splits (a dense MLP's, the experts', a shared expert's)
INTERMEDIATE_SIZES = {
    "intermediate_size": "intermediate size",
    "moe_intermediate_size": "experts' intermediate size",
    "shared_expert_intermediate_size": "shared expert's intermediate size",
}


def unsplittable_reason(config: PretrainedConfig, world: int) -> str | None:
    """None when a model of `config` splits over `world` ranks, else one line saying why not. A vision-language
    model's decoder is split as a text model's (its text config's), its vision tower kept whole on every rank."""
    cfg: Any = config
    model_type = getattr(cfg, "model_type", None)
    if getattr(cfg, "vision_config", None) is not None:
        cfg = cfg.get_text_config()
        text_type = getattr(cfg, "model_type", None)
        if text_type not in SUPPORTED_TYPES:
            return f"tensor parallelism splits VLMs whose decoder lmiserve runs; {model_type!r}'s is {text_type!r}"
    elif model_type not in SUPPORTED_TYPES or model_type in VLM_DECODER_TYPES:
        split = [t for t in SUPPORTED_TYPES if t not in VLM_DECODER_TYPES]
        return (
            f"tensor parallelism runs the fast path's architectures ({', '.join(split)}); this model is {model_type!r}"
        )
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % world:
        return f"tensor_parallel_degree={world} does not divide the model's {heads} attention heads"
    if kv_heads % world and world % kv_heads:
        return (
            f"tensor_parallel_degree={world} neither divides the model's {kv_heads} KV heads nor is a multiple of them"
        )
    for key, what in INTERMEDIATE_SIZES.items():
        size = int(getattr(cfg, key, None) or 0)
        if size % world:
            return f"tensor_parallel_degree={world} does not divide the model's {what} {size}"
    return None


def shard_plan(config: PretrainedConfig, rank: int, world: int) -> ShardPlan:
    reason = unsplittable_reason(config, world)
    if reason is not None:
        raise ValueError(reason)
    cfg: Any = config.get_text_config() if getattr(config, "vision_config", None) is not None else config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    q_heads = heads // world
    if kv_heads >= world:
        local_kv, kv_first = kv_heads // world, rank * (kv_heads // world)
    else:  # replicated: the KV head of this rank's query heads
        local_kv, kv_first = 1, (rank * q_heads) // (heads // kv_heads)
    vocab = int(cfg.vocab_size)
    part = -(-vocab // world)
    return ShardPlan(
        rank=rank,
        world=world,
        head_dim=head_dim,
        q_first=rank * q_heads,
        q_heads=q_heads,
        kv_first=kv_first,
        kv_heads=local_kv,
        kv_total=kv_heads,
        vocab=vocab,
        vocab_first=rank * part,
        vocab_part=part,
    )


class TensorParallelShard:
    """A rank's collectives over its tensor-parallel group (`group`: the process group of the ranks)."""

    def __init__(self, plan: ShardPlan, group: ProcessGroup | None) -> None:
        self.plan = plan
        self.group = group
        self.world = plan.world

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows of the (vocabulary-parallel) embedding `weight` for `ids`: each rank looks up the ids in
        its rows (zeros elsewhere), the all-reduce sums them."""
        local = ids - self.plan.vocab_first
        inside = (local >= 0) & (local < self.plan.vocab_part)
        x = F.embedding(local.clamp(0, self.plan.vocab_part - 1), weight)
        x = x * inside[:, None].to(x.dtype)
        return self.all_reduce(x)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place when `x` is contiguous)."""
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """The whole ``[rows, vocab]`` logits from every rank's ``[rows, vocab_part]``."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.plan.vocab].contiguous()


# the shard of each sharded model (weak keys: it goes with its model)
_SHARDS: weakref.WeakKeyDictionary[Any, TensorParallelShard] = weakref.WeakKeyDictionary()


def shard_of(model: Any) -> TensorParallelShard | None:
    """The shard `model` (a model, or a vision-language model's `LanguageModel` view) was cut to (None: whole)."""
    return _SHARDS.get(model)


def decoder_of(model: PreTrainedModel) -> LlamaFamily:
    """What tensor parallelism splits of `model`: a causal LM itself, a vision-language model's decoder and output
    projection (`language_model`'s view: ``model``, ``lm_head``, the text ``config``)."""
    if getattr(model.config, "vision_config", None) is None:
        return cast(LlamaFamily, model)
    view = language_model(model)
    if view is None:
        raise ValueError(f"the decoder of this vision-language model ({model.config.model_type}) is not found")
    return cast(LlamaFamily, view)


def shard_model(model: PreTrainedModel, rank: int, world: int, group: ProcessGroup | None) -> TensorParallelShard:
    """Keep rank `rank`'s share of `model`'s weights (in place; the rest is freed) and say the local head counts in
    its config (a VLM's decoder's: `decoder_of`; its vision tower is kept whole). Refused (ValueError) for a model the
    fast path does not run or that does not split over `world` ranks, or whose linears are quantized (int8, int4,
    q8, a checkpoint's fp8 or AWQ/GPTQ codes: their blocked rows and scales are not cut here)."""
    plan = shard_plan(model.config, rank, world)
    if any(isinstance(m, QUANTIZED_LINEARS) for m in model.modules()):
        raise ValueError(
            "tensor parallelism shards float models: this one has quantized linears (dtype int8 or int4, or a "
            "checkpoint's fp8 or AWQ/GPTQ weights)"
        )
    # the architecture was checked by the plan; the rest of the layout (on real weights) by FastLlama
    llama = decoder_of(model)
    for layer in llama.model.layers:
        for owner in (layer.self_attn, layer.mlp):  # (an MoE block's shared expert: a dense MLP inside it)
            for name, module in cast(torch.nn.Module, owner).named_modules():
                short = name.rpartition(".")[2]
                if isinstance(module, torch.nn.Linear) and short in ROW_PARALLEL:
                    _keep_columns(module, column_run(plan, short, module.in_features), rank)
                elif isinstance(module, torch.nn.Linear) or short in ("q_norm", "k_norm"):  # (norms: OLMo 2's)
                    runs = row_runs(plan, short, module.weight.shape[0])
                    if runs is not None:
                        _keep_rows(module, runs)
        block = moe_block(layer)
        if block is not None:
            _cut_experts(cast(Any, block).experts, plan)
        sinks = getattr(layer.self_attn, "sinks", None)  # (gpt-oss's: a logit a head, the rank's heads')
        if isinstance(sinks, torch.Tensor):
            cast(Any, layer.self_attn).sinks = torch.nn.Parameter(
                sinks.detach()[plan.heads()].clone(), requires_grad=False
            )
    embed, head = llama.model.embed_tokens, llama.lm_head
    tied = tied_output(model)
    embed.weight = torch.nn.Parameter(_vocab_rows(embed.weight, plan), requires_grad=False)
    head.weight = embed.weight if tied else torch.nn.Parameter(_vocab_rows(head.weight, plan), requires_grad=False)
    cfg: Any = cast(Any, llama).config
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = plan.q_heads, plan.kv_heads, plan.head_dim
    shard = _SHARDS[model] = _SHARDS[llama] = TensorParallelShard(plan, group)
    return shard


def _cut_experts(experts: Any, plan: ShardPlan) -> None:
    """Keep every expert's part of `plan`'s share of the experts' intermediate size (`experts_part`), in place."""
    layout = experts_layout(experts)
    for kind in EXPERT_TENSORS:
        tensor = getattr(experts, kind, None)
        if isinstance(tensor, torch.Tensor):
            kept = experts_part(tensor.detach(), kind, plan, *layout).clone(memory_format=torch.contiguous_format)
            setattr(experts, kind, torch.nn.Parameter(kept, requires_grad=False))


EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


def experts_layout(experts: Any) -> tuple[bool, bool]:
    """How transformers holds `experts`' tensors: transposed (``[experts, in, out]``: gpt-oss's; else ``[experts,
    out, in]``) and gate/up concatenated (``[gate; up]``; else interleaved, gpt-oss's ``gate_up[..., ::2]``)."""
    return bool(getattr(experts, "is_transposed", False)), bool(getattr(experts, "is_concatenated", True))


def experts_part(tensor: Any, kind: str, plan: ShardPlan, transposed: bool, concatenated: bool) -> torch.Tensor:
    """The rank's part of experts tensor `kind` (a tensor or a safetensors slice: only that part is read): of
    ``gate_up_proj`` and its bias every expert's outputs of the rank's share of the intermediate size (the gate's
    run, then the up's; interleaved, one run of whole pairs), of ``down_proj`` the matching inputs; ``down_proj_bias``
    whole on rank 0 and zeros elsewhere (the ranks' outputs are summed; the forward adds it on each)."""
    if kind == "down_proj_bias":
        whole = torch.as_tensor(tensor[:])
        return whole if plan.rank == 0 else torch.zeros_like(whole)
    shape = tensor.get_shape() if hasattr(tensor, "get_shape") else tuple(tensor.shape)
    if kind == "down_proj":
        dim = 1 if transposed else 2
        return torch.as_tensor(_along(tensor, dim, plan.part(shape[dim])))
    dim = 2 if transposed and kind == "gate_up_proj" else 1
    size = shape[dim]
    runs = cast(list[slice], row_runs(plan, "gate_up_proj", size)) if concatenated else [plan.part(size)]
    return torch.cat([torch.as_tensor(_along(tensor, dim, run)) for run in runs], dim=dim)


def _along(tensor: Any, dim: int, part: slice) -> Any:
    return tensor[:, part] if dim == 1 else tensor[:, :, part]


def tied_output(model: PreTrainedModel) -> bool:
    """Whether the output layer is the embedding (as the model ties it, or as its config says: a shell made
    on the meta device may not be tied yet)."""
    llama = decoder_of(model)
    config: Any = model.config.get_text_config()
    return llama.lm_head.weight is llama.model.embed_tokens.weight or bool(
        getattr(config, "tie_word_embeddings", False)
    )


ROW_PARALLEL = ("o_proj", "down_proj", "c_proj")  # the linears whose input columns a rank keeps
# the column-parallel linears (a rank keeps rows of their outputs): attention's, the MLP's
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "c_fc", "gate_up_proj")


def row_runs(plan: ShardPlan, name: str, size: int) -> list[slice] | None:
    """The rows a rank keeps of column-parallel linear `name` of `size` output rows (None: not one): its query
    heads' of q, its KV heads' of k and v, its part of gate's and up's; of Phi-3's fused `qkv_proj` and a fused
    `gate_up_proj` (an expert's too) those runs, each after the whole projections before it."""
    d = plan.head_dim
    q = slice(plan.q_first * d, (plan.q_first + plan.q_heads) * d)
    kv = slice(plan.kv_first * d, (plan.kv_first + plan.kv_heads) * d)
    q_all, kv_all = plan.q_heads * plan.world * d, plan.kv_total * d

    def after(part: slice, offset: int) -> slice:
        return slice(part.start + offset, part.stop + offset)

    if name in ("q_proj", "k_proj", "v_proj"):
        return [q if name == "q_proj" else kv]
    if name in ("q_norm", "k_norm") and size == (q_all if name == "q_norm" else kv_all):  # OLMo 2's: of projections
        return [q if name == "q_norm" else kv]
    if name == "qkv_proj":
        return [q, after(kv, q_all), after(kv, q_all + kv_all)]
    if name == "gate_up_proj":
        half = plan.part(size // 2)
        return [half, after(half, size // 2)]
    return [plan.part(size)] if name in COLUMN_PARALLEL else None


def column_run(plan: ShardPlan, name: str, size: int) -> slice:
    """The input columns a rank keeps of row-parallel linear `name` with `size` of them (o's: its heads'; down's:
    its part)."""
    d = plan.head_dim
    return slice(plan.q_first * d, (plan.q_first + plan.q_heads) * d) if name == "o_proj" else plan.part(size)


def keep_runs(tensor: Any, runs: list[slice]) -> torch.Tensor:
    """`tensor`'s rows of `runs`, one after the other (a copy; a safetensors slice: only those rows read)."""
    return torch.cat([tensor[run] for run in runs]) if len(runs) > 1 else torch.as_tensor(tensor[runs[0]]).clone()


def _keep_rows(module: torch.nn.Module, rows: list[slice]) -> None:  # (a linear, or OLMo 2's norm: no bias)
    linear: Any = module
    linear.weight = torch.nn.Parameter(keep_runs(linear.weight.detach(), rows), requires_grad=False)
    if getattr(linear, "bias", None) is not None:
        linear.bias = torch.nn.Parameter(keep_runs(linear.bias.detach(), rows), requires_grad=False)


def _keep_columns(linear: torch.nn.Linear, columns: slice, rank: int) -> None:
    linear.weight = torch.nn.Parameter(linear.weight.detach()[:, columns].contiguous(), requires_grad=False)
    if linear.bias is not None and rank != 0:  # the partial sums are all-reduced: one rank adds the bias
        linear.register_parameter("bias", None)


def _vocab_rows(weight: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    return padded_vocab(weight.detach()[plan.vocab_first : plan.vocab_first + plan.vocab_part], plan).clone()


def padded_vocab(rows: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """A rank's vocabulary rows, zero rows added up to `plan.vocab_part` (the last rank's part)."""
    if rows.shape[0] < plan.vocab_part:
        rows = torch.cat([rows, rows.new_zeros(plan.vocab_part - rows.shape[0], rows.shape[1])])
    return rows


# ---- a LoRA adapter's shard ----------------------------------------------------------------------------------
def shard_adapter(adapter: LoraAdapter, model: torch.nn.Module) -> LoraAdapter:
    """What a rank of `model` (cut by `shard_model`) keeps of `adapter` (read whole, ``A [r, in]`` and the
    scaled ``B [out, r]`` of each module), cut as the base linears are: column-parallel q/k/v and gate/up
    keep the rows of B of their output rows (each rank's delta is its rows of the whole delta); row-parallel
    o and down keep the columns of A of their input columns (each rank's delta ``B (A_rank x_rank)`` is a
    partial sum, which the forward's all-reduce adds with the base product's). ValueError for a module
    the fast path's layers do not have, or when a cut does not match the rank's linear."""
    shard = shard_of(model)
    if shard is None:
        raise ValueError("shard_adapter cuts an adapter for a model cut by shard_model")
    cut: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for path, (a, b) in adapter.modules.items():
        short = path.rsplit(".", 1)[-1]
        outputs, inputs = _rank_shape(model.get_submodule(path))
        runs = row_runs(shard.plan, short, b.shape[0])
        if runs is not None:
            a, b = a, keep_runs(b, runs)
            fits = b.shape[0] == outputs
        elif short in ROW_PARALLEL:
            a, b = a[:, column_run(shard.plan, short, a.shape[1])].contiguous(), b
            fits = a.shape[1] == inputs
        else:
            raise ValueError(f"adapter {adapter.name} adapts {path}, which tensor parallelism does not shard")
        if not fits:
            raise ValueError(
                f"adapter {adapter.name}: the shard of {path} is {list(a.shape)} and {list(b.shape)}, the rank's "
                f"linear {[outputs, inputs]}"
            )
        cut[path] = (a, b)
    return dataclasses.replace(adapter, modules=cut)


def _rank_shape(module: torch.nn.Module) -> tuple[int, int]:
    """``(out, in)`` of a rank's linear: a cut float linear's weight's (its ``in_features`` and ``out_features`` stay
    the whole linear's, which `lora.adapters.read_adapter` checks a whole adapter against), a quantized one's
    features (`shard_quantized`'s layers are made of the rank's shape)."""
    if type(module) is torch.nn.Linear:
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return int(getattr(module, "out_features", -1)), int(getattr(module, "in_features", -1))
