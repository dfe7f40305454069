"""The memory plan of the paged KV pools: the model's pool and, with speculative decoding's draft model, the
draft's own pool, planned together from one budget (engine/factory.py builds them; issue #39 item 4).

The budget is `kv_cache_memory_bytes` when set (both pools together, as vLLM's counts the draft's layers in its
KV cache); else on CUDA `gpu_memory_utilization` of the GPU less what is allocated (the weights of both models,
and never more than the GPU has free: another model's engine process) less the profiled activations of both models'
largest steps (and their decode graphs' memory); on a CPU `CPU_KV_SHARE` of the memory available. The draft's
pool gets the blocks of the rows that may draft at once at full context (never more tokens than the model's
pool), the model's the rest. `memory` reads the device's free bytes in place of the device (a test simulates a
bounded GPU with it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.attention.paged import kv_bytes_per_block
from lmiserve.engine.core.async_engine import EngineConfig
from lmiserve.engine.loaded import LoadedModel
from lmiserve.engine.lora import slots as lora_slots

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

CPU_KV_SHARE = 0.25  # of the memory available at start-up: the paged KV pools' default budget on CPU
GPU_ACTIVATION_RESERVE = 2 * 2**30  # bytes left for activations beside the paged KV pool on CUDA
# the GPU memory left free beside the pools where the GPU's free memory bounds them (`free_on_gpu`): this
# process's growth past torch's allocator (cuBLAS's workspaces, loaded kernels), another process's
OWN_SLACK = 2**30

# the profiled activations are grown by this factor and this many bytes (allocator fragmentation, the
# sampler's own tensors) before the KV pool takes the rest of gpu_memory_utilization
PROFILE_MARGIN = 1.2
PROFILE_SLACK = 256 * 2**20

# bytes the KV pools and the activations may take on a device now (replaces reading the device)
MemoryReader = Callable[[torch.device], int]


def available_memory() -> int:
    """Bytes of RAM available now (Linux's MemAvailable; elsewhere the physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# the bytes a logit of the largest decode graph's step takes beside the model's own: its float32 copy in the
# graphs' output buffer, and the pick's intermediates, a sampled graph's (runner/graph_sampling.py; its top_k and
# top_p stages and the sort of the vocabulary: 26 B measured on a CPU, with room for the GPU sort's scratch),
# else a greedy graph's (4 B: the log-softmax; a draft model's graphs pick greedily alone)
GRAPH_LOGIT_BYTES = 4 + 32
GREEDY_GRAPH_LOGIT_BYTES = 4 + 4


def graph_pool_bytes(
    step_bytes: int, step_tokens: int, rows: int, vocab: int, itemsize: int, sampled: bool = True
) -> int:
    """The memory the captured decode graphs keep (engine/attention/cuda_graphs.py: one pool for all, which
    holds the largest capture size's step, and one output buffer): the profiled step's activations scaled to
    `rows` tokens, with the margin, and that step's logits (in the model's dtype) and what each logit takes
    beside them (`GRAPH_LOGIT_BYTES`; without `sampled` graphs, `GREEDY_GRAPH_LOGIT_BYTES`)."""
    activations = step_bytes * rows // max(1, step_tokens)
    beside = GRAPH_LOGIT_BYTES if sampled else GREEDY_GRAPH_LOGIT_BYTES
    return int(activations * PROFILE_MARGIN) + rows * vocab * (itemsize + beside)


def profiled_sampling(loaded: LoadedModel, config: EngineConfig) -> tuple[int, int]:
    """The sampler's largest step the profile runs too (`factory.run_profile_step`): the batch limit's rows
    of the vocabulary."""
    return config.max_running, int(loaded.model.config.get_text_config().vocab_size)


def largest_step_tokens(config: EngineConfig, max_context: int) -> int:
    """The most tokens one step computes: the prefill budget and a decode row for every other sequence,
    within the step's budget (`max_step_tokens`) when one is set."""
    tokens = config.max_prefill_tokens + config.max_running
    if config.max_step_tokens is not None:
        tokens = min(tokens, config.max_step_tokens)
    return min(tokens, max_context)


def block_bytes(model: PreTrainedModel, config: EngineConfig) -> int:
    """The bytes of one block of `model`'s KV in a pool of `config` (its block size, its KV dtype)."""
    return kv_bytes_per_block(model, config.block_size, config.kv_cache_dtype)


def free_memory(device: torch.device, config: EngineConfig) -> int:
    """What the KV pools and the activations may take on `device` now: on CUDA `gpu_memory_utilization` of the
    GPU less what this process allocated, and never more than the GPU has free (`free_on_gpu`); elsewhere
    `CPU_KV_SHARE` of the memory available."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        share = int(config.gpu_memory_utilization * total) - torch.cuda.memory_allocated(device)
        return min(share, free_on_gpu(device))
    return int(available_memory() * CPU_KV_SHARE)


def free_on_gpu(device: torch.device) -> int:
    """Bytes this process may still allocate on the GPU `device`: what the device has free, what this process's
    allocator holds unused, less `OWN_SLACK`. `gpu_memory_utilization` is each process's share (vLLM's rule):
    where other processes hold memory (a second LLM's engine process, each LLM having one by default on a GPU;
    another program) the pool takes what is left, not more, as it does with two models in one process."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - OWN_SLACK


def activation_reserve(
    loaded: LoadedModel, config: EngineConfig, activation_bytes: int | None, graphs: bool, sampled: bool = True
) -> int:
    """On CUDA, the bytes `loaded`'s steps need beside its pool: `activation_bytes` as profiled, with a
    margin (else the fixed `GPU_ACTIVATION_RESERVE`), and with decode `graphs` their memory (and that of
    their LoRA slots when adapters are served), whose steps sample or (a draft model's, not `sampled`) pick
    greedily alone; 0 elsewhere."""
    if loaded.device.type != "cuda":
        return 0
    reserve = GPU_ACTIVATION_RESERVE
    if activation_bytes is not None:
        reserve = int(activation_bytes * PROFILE_MARGIN) + PROFILE_SLACK
    if graphs:
        reserve += graph_pool_bytes(
            activation_bytes or 0,
            largest_step_tokens(config, loaded.max_context),
            # the largest graph: the batch limit, plus the prompt rows a step may fold in (cuda_graph_prompt_tokens)
            cuda_graphs.capture_sizes(config.max_running + config.graph_prompt_tokens)[-1],
            int(loaded.model.config.vocab_size),
            loaded.model.dtype.itemsize,
            sampled,
        )
        if config.lora is not None:  # the adapters' slots the graphs read (engine/lora/slots.py)
            reserve += lora_slots.slot_bytes(loaded.model, config.lora.max_loras, config.lora.max_lora_rank)
    return reserve


@dataclasses.dataclass(frozen=True)
class DraftNeeds:
    """The draft model of a plan: the model, its profiled activations, whether it captures decode graphs,
    and the rows that may draft at once."""

    loaded: LoadedModel
    rows: int
    activation_bytes: int | None = None
    graphs: bool = False


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """Blocks of the model's pool and of the draft's (0: no draft), and the bytes they shared."""

    blocks: int
    draft_blocks: int
    budget: int


def plan_pools(
    loaded: LoadedModel,
    config: EngineConfig,
    activation_bytes: int | None = None,
    graphs: bool = False,
    draft: DraftNeeds | None = None,
    memory: MemoryReader | None = None,
) -> PoolPlan:
    """The blocks of `loaded`'s pool and of the `draft`'s from one budget (the module's doc), read once
    before either pool exists. The model's pool never holds more than `max_running` sequences at full
    context; the draft's never more than its rows at full context nor more tokens than the model's."""
    per_block = block_bytes(loaded.model, config)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        budget = (memory or (lambda device: free_memory(device, config)))(loaded.device)
        budget -= activation_reserve(loaded, config, activation_bytes, graphs)
        if draft is not None:
            # (a draft model proposes greedily: engine/speculative/proposers.py)
            budget -= activation_reserve(draft.loaded, config, draft.activation_bytes, draft.graphs, sampled=False)
    # with decode graphs a pool has one block more, where their padding rows write (runner/fast.py)
    budget -= per_block * int(graphs)
    full_batch = config.max_running * -(-loaded.max_context // config.block_size)
    if draft is None:
        return PoolPlan(max(1, min(budget // per_block, full_batch)), 0, budget)
    draft_per_block = block_bytes(draft.loaded.model, config)
    budget -= draft_per_block * int(draft.graphs)
    context = min(loaded.max_context, draft.loaded.max_context)
    draft_full = draft.rows * -(-context // config.block_size)
    shared = budget // (per_block + draft_per_block)  # as many blocks each, while the draft needs them
    if shared <= draft_full:
        blocks = draft_blocks = shared
    else:
        draft_blocks, blocks = draft_full, (budget - draft_full * draft_per_block) // per_block
    blocks = max(1, min(blocks, full_batch))
    return PoolPlan(blocks, max(1, min(draft_blocks, blocks)), budget)


def kv_pool_blocks(
    loaded: LoadedModel,
    config: EngineConfig,
    activation_bytes: int | None = None,
    graphs: bool = False,
    memory: MemoryReader | None = None,
) -> int:
    """Blocks of the paged KV pool of a model without a draft (`plan_pools`): the budget over a block's
    bytes, never more than `max_running` sequences at full context need, at least one."""
    return plan_pools(loaded, config, activation_bytes, graphs, memory=memory).blocks


def report_draft_pool(plan: PoolPlan, draft: DraftNeeds, config: EngineConfig, context: int, drafts: int) -> None:
    """Log the draft's pool, and warn when it holds fewer tokens than one request at full `context` with
    its `drafts` (its longer requests get no drafts: a budget too small, never silent)."""
    tokens = plan.draft_blocks * config.block_size
    log.info(
        "speculative decoding: the draft model's KV pool: %d blocks (%.1f MiB, %d tokens) for %d rows that may "
        "draft at once",
        plan.draft_blocks,
        plan.draft_blocks * block_bytes(draft.loaded.model, config) / 2**20,
        tokens,
        draft.rows,
    )
    one_request = min(context, draft.loaded.max_context) + drafts
    if tokens < one_request:
        log.warning(
            "speculative decoding: the draft model's KV pool holds %d tokens, less than one request at full "
            "context (%d): requests longer than that get no drafts; give the pools more memory "
            "(gpu_memory_utilization, kv_cache_memory_bytes) or lower max_model_len",
            tokens,
            one_request,
        )
