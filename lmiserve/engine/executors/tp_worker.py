"""A tensor-parallel worker process: one a rank (one a device), the model's shard in it
(engine/model/sharding.py), joined in a torch.distributed group (NCCL on CUDA, gloo on CPU); rank 0 receives
each step's plain-data batch from the leader (engine/executors/tensor_parallel.py's `TensorParallelExecutor`) and
broadcasts it to every rank over a gloo group; every rank runs it and rank 0 answers with its `StepOutput`
(engine/executors/tp_steps.py, which launches a batch that comes while the step before it runs behind that step).

LoRA: a batch names a new request's adapter by its name, load id and folder (`step.AdapterRef`), and every
rank reads its shard of that load from the folder on the first batch that names it
(`lora.manager.LoraManager`, `model.sharding.shard_adapter`), forgetting it when a batch's
`dropped_adapters` says.

In a worker any exception of a step is fatal (its ranks' collectives would no longer pair up). Workers
ignore SIGINT and SIGTERM (the leader drains, then closes them) and exit when their parent process goes
away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lmiserve.core import threads
from lmiserve.engine.attention import cuda_graphs
from lmiserve.engine.child_process import start_child
from lmiserve.engine.core.step import StepBatch, StepOutput
from lmiserve.engine.executors.tp_steps import run_batches
from lmiserve.engine.runner.fast import PagedFastRunner
from lmiserve.engine.runner.vision import is_vision_model
from lmiserve.engine.runner.vision_fast import PagedFastVisionRunner

if TYPE_CHECKING:
    from lmiserve.engine.core.async_engine import EngineConfig
    from lmiserve.engine.loaded import LoadedModel
    from lmiserve.engine.model.quant_formats import QuantSpec
    from lmiserve.engine.pool_plan import PoolPlan

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)  # the batch broadcast waits as long as the server idles
# the group's rendezvous and the loading that follows wait this long at least for every rank (nodes and
# their weights may come up minutes apart); a step's collectives are watched by the leader's step_timeout
START_TIMEOUT_S = 1800.0


class LoadModel(Protocol):
    """Loads the whole model, weights included (`lmiserve.models.load.load_causal_lm`)."""

    def __call__(
        self, path: str, *, dtype: str, device: str, trust_remote_code: bool, load_format: str
    ) -> LoadedModel: ...


class QuantizeShard(Protocol):
    """Quantizes a rank's float shard at load as `spec` says (4-bit codes of a `dummy` model's random weights:
    `lmiserve.models.quantized_load.quantize_at_load`), on `device`; an account of what it did."""

    def __call__(self, model: Any, spec: QuantSpec, dtype: torch.dtype, device: torch.device) -> str: ...


class LoadShell(Protocol):
    """Loads the model's tokenizer and config around a model without weights
    (`lmiserve.models.load.load_model_shell`)."""

    def __call__(self, path: str, *, dtype: str, device: str, trust_remote_code: bool) -> LoadedModel: ...


@dataclass(frozen=True)
class DraftLoad:
    """How a worker loads speculative decoding's draft model (`load_model`'s arguments)."""

    path: str
    dtype: str
    load_format: str


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to load its shard and join its group (picklable: sent to spawned
    processes)."""

    model_path: str
    dtype: str  # resolved for the device (e.g. bfloat16 on CUDA)
    device: str  # "cpu" or "cuda"
    load_format: str
    trust_remote_code: bool
    world: int  # ranks over all nodes (tensor_parallel_degree)
    config: EngineConfig  # block size, pool budget, speculation (ngram), ...
    # how a worker reads the model, handed down from above the engine (models/compose.py passes
    # models/load.py's functions: module-level, so the spawned workers unpickle them by name)
    load_model: LoadModel
    load_shell: LoadShell
    quantize_shard: QuantizeShard  # 4-bit codes of a dummy model's random weights (`quantize=awq|gptq`)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    step_timeout: float = 300.0
    log_level: str = "INFO"
    # the checkpoint's quantization (a quantized checkpoint's linears cut as stored), or `quantize` made at load
    # (fp8 of a float checkpoint: shard_quantized.quantize_fp8_shard; 4-bit codes of a dummy model: `quantize_shard`)
    quantization: QuantSpec | None = None
    draft: DraftLoad | None = None  # speculative decoding's draft model, loaded whole by every rank

    @property
    def local_world(self) -> int:
        return self.world // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.local_world, (self.node_rank + 1) * self.local_world)


class TensorParallelRunner(PagedFastRunner):
    """A rank's runner: the paged fast runner over its shard, whose failures are not retried part by part
    (a retry alone would run collectives the other ranks do not): a step that raises stops the worker."""

    def _run_rows(self, batch: StepBatch, part: list[int], out: StepOutput) -> None:
        self._finish_rows(batch, part, self._forward_rows(batch, part), out)


class TensorParallelVisionRunner(PagedFastVisionRunner):
    """A rank's runner of a vision-language model: lmiserve's forward over its shard of the decoder (LoRA adapters
    too, cut as a text model's), the image encoder whole (every rank encodes a request's images: the same features
    everywhere); as `TensorParallelRunner`, a step that raises stops the worker. Transformers' forward of the VLM does
    not run a shard: a step that would take it raises (none does: runner/vision_fast.py)."""

    probes_backend = False

    def _run_rows(self, batch: StepBatch, part: list[int], out: StepOutput) -> None:
        self._finish_rows(batch, part, self._forward_rows(batch, part), out)

    def _forward_lora(self, batch: StepBatch, part: list[int], rows: Any, backend: Any) -> torch.Tensor:
        raise RuntimeError("a step of a vision-language model's shard needs transformers' forward, which is not split")


# ---- the worker process ------------------------------------------------------------------------------
def worker_main(spec: WorkerSpec, rank: int, local_rank: int, conn: Connection | None) -> None:
    """A rank's process: join the group, load the shard, agree on the pool, then run batches until told
    to stop (None) or until the group breaks. Rank 0 talks to the leader over `conn`."""
    cpu = spec.device == "cpu"  # the threads the node may use (core/threads.py) shared by its ranks
    start_child(
        spec.log_level,
        max(1, threads.choose().threads // spec.local_world) if cpu else None,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
    )
    code = 1
    try:
        code = _serve(spec, rank, local_rank, conn)
    except Exception as exc:  # noqa: BLE001 - told to the leader (rank 0), logged, and the worker exits
        log.exception("tensor-parallel worker failed")
        _tell(conn, ("error", f"rank {rank}: {type(exc).__name__}: {_summary(exc)}"))
    finally:
        os._exit(code)  # no interpreter teardown: a broken group's threads must not keep the process alive


def _serve(spec: WorkerSpec, rank: int, local_rank: int, conn: Connection | None) -> int:
    import torch.distributed as dist

    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=rank,
        world_size=spec.world,
        timeout=timedelta(seconds=max(spec.step_timeout, START_TIMEOUT_S)),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    error, shard, capacity = None, None, (0, 0)
    try:
        shard = _load_shard(spec, rank, local_rank)
        capacity = (shard.plan.blocks, shard.plan.draft_blocks)
    except Exception as exc:  # noqa: BLE001 - gathered below: every rank stops, rank 0 says why
        log.exception("loading the shard failed")
        error = f"rank {rank}: {exc}"
    if error is None:  # logged before the ranks agree: every rank's line precedes the leader's "ready"
        log.info("rank %d of %d loaded its shard: room for %d KV blocks", rank, spec.world, capacity[0])
    statuses: list[Any] = [None] * spec.world
    dist.all_gather_object(statuses, (error, capacity), group=control)
    errors = [e for e, _ in statuses if e]
    if errors:
        _tell(conn, ("error", errors[0]))
        return 1
    assert shard is not None
    runner = _runner(spec, shard, min(c[0] for _, c in statuses), min(c[1] for _, c in statuses), spec.config)
    graphs = cuda_graphs.of_runner(runner)  # (each rank's the same sizes: the leader's warm-up runs each)
    sizes = tuple(graphs.sizes) if graphs is not None else None
    shape = (
        runner.num_blocks,
        runner.block_size,
        runner.vocab_size,
        list(runner.eos_token_ids),
        runner.kv_bytes,
        sizes,
    )
    _tell(conn, ("ready", shape))
    run_batches(runner, rank, conn, control)  # (until the leader says stop)
    dist.destroy_process_group()
    return 0


@dataclass
class Shard:
    """A rank's shard of the model (`loaded`), its speculative decoding's draft model (whole on every rank:
    each proposes the same drafts; None: none) and the blocks of the two pools its memory allows."""

    loaded: Any
    draft: Any
    draft_cls: Any
    plan: PoolPlan


def _load_shard(spec: WorkerSpec, rank: int, local_rank: int) -> Shard:
    """This rank's shard of the model, on its device, its draft model (`spec.draft`) and the blocks of KV its
    memory allows (`kv_cache_memory_bytes` per worker, else the device's share), the draft's pool beside the
    model's (`plan_pools`). From a safetensors checkpoint only the shard's slices are read
    (`load_shard_weights`); otherwise (a `dummy` model, other formats) the whole model is loaded on the CPU and
    cut."""
    import torch.distributed as dist

    from lmiserve.engine.codecs import image_codec
    from lmiserve.engine.factory import draft_proposer, draft_rows, draft_runner_class, profile_step_memory
    from lmiserve.engine.model import fp8_experts
    from lmiserve.engine.model.shard_checkpoint import checkpoint_files, load_shard_weights
    from lmiserve.engine.model.shard_quantized import maxima_over_ranks, quantize_fp8_shard
    from lmiserve.engine.model.sharding import shard_model
    from lmiserve.engine.pool_plan import DraftNeeds, PoolPlan, largest_step_tokens, plan_pools, profiled_sampling
    from lmiserve.engine.text.images import probe_prompt

    quant = spec.quantization
    target = torch.device("cuda", local_rank) if spec.device == "cuda" else torch.device("cpu")
    if spec.load_format != "dummy" and checkpoint_files(spec.model_path) is not None:
        loaded = spec.load_shell(
            spec.model_path, dtype=spec.dtype, device="cpu", trust_remote_code=spec.trust_remote_code
        )
        shard_model(loaded.model, rank, spec.world, dist.group.WORLD)
        load_shard_weights(loaded.model, spec.model_path, quant, target)
        loaded.model.train(False)
    else:
        loaded = spec.load_model(
            spec.model_path,
            dtype=spec.dtype,
            device="cpu",
            trust_remote_code=spec.trust_remote_code,
            load_format=spec.load_format,
        )
        shard_model(loaded.model, rank, spec.world, dist.group.WORLD)
    if quant is not None and quant.dynamic:  # (each row's scale over its whole row: one process's fp8 weights)
        count = quantize_fp8_shard(loaded.model, getattr(torch, spec.dtype), target)
        name, maxima = f"rank {rank}: quantize=fp8", maxima_over_ranks(loaded.model)
        experts = fp8_experts.quantize_servable(loaded.model, target, name, maxima)
        log.info("rank %d: %d linears and %d experts modules quantized to fp8 at load", rank, count, experts)
    elif quant is not None and quant.source == "dummy":
        log.info("rank %d: %s", rank, spec.quantize_shard(loaded.model, quant, getattr(torch, spec.dtype), target))
    config = spec.config
    if spec.device == "cuda":
        loaded.model.to(target)  # type: ignore[arg-type]  # transformers' wrapped `to`
        loaded = dataclasses.replace(loaded, device=target)
    draft = draft_cls = None
    if spec.draft is not None:  # whole on every rank (a small model): no collectives, the same drafts everywhere
        draft = spec.load_model(
            spec.draft.path,
            dtype=spec.draft.dtype,
            device=str(target),
            trust_remote_code=spec.trust_remote_code,
            load_format=spec.draft.load_format,
        )
        draft_cls = draft_runner_class(loaded, config, draft)
    activation = draft_activation = None
    if spec.device == "cuda" and config.kv_cache_memory_bytes is None:
        # every rank profiles the same steps (its collectives pair up): a VLM's with an image too; the draft's
        # largest step
        images = image_codec(loaded)
        quiet = dataclasses.replace(config, enforce_eager=True)  # (a prompt step: no decode graphs)
        activation = profile_step_memory(
            target,
            lambda blocks: _runner(spec, Shard(loaded, None, None, PoolPlan(blocks, 0, 0)), blocks, 0, quiet),
            largest_step_tokens(config, loaded.max_context),
            config.block_size,
            probe_prompt(images) if images is not None else None,
            sampler=profiled_sampling(loaded, config),
        )
        if draft is not None:
            draft_activation = profile_step_memory(
                target,
                lambda blocks: draft_proposer(draft, quiet, blocks, draft_cls).runner,  # (no graphs while profiled)
                largest_step_tokens(config, draft.max_context),
                config.block_size,
            )
    # the decode graphs (the shard's forward, its all-reduces captured with it; the draft's own, no collectives)
    graphs = cuda_graphs.wanted(target, config.enforce_eager)
    needs = (
        None if draft is None else DraftNeeds(draft, draft_rows(config), draft_activation, graphs and bool(draft_cls))
    )
    return Shard(loaded, draft, draft_cls, plan_pools(loaded, config, activation, graphs, draft=needs))


def _runner(
    spec: WorkerSpec, shard: Shard, num_blocks: int, draft_blocks: int, config: EngineConfig
) -> TensorParallelRunner | TensorParallelVisionRunner:
    """A rank's runner over `num_blocks` of its shard's KV (the draft's pool `draft_blocks`); on CUDA with decode
    graphs unless `config.enforce_eager`: every rank captures and replays the same sizes, the collectives inside
    (NCCL's, captured), so their all-reduces pair up as eager steps' do."""
    from lmiserve.engine.factory import draft_proposer, kv_format_of
    from lmiserve.engine.speculative.proposers import NgramProposer

    loaded = shard.loaded
    runner_cls = TensorParallelVisionRunner if is_vision_model(loaded.model) else TensorParallelRunner
    runner = runner_cls(
        loaded.model,
        max_slots=config.max_running,
        max_context=loaded.max_context,
        eos_token_ids=loaded.eos_token_ids,
        num_blocks=num_blocks,
        block_size=config.block_size,
        enforce_eager=config.enforce_eager,
        kv_format=kv_format_of(loaded, config),  # (its KV heads' share of each block, in `kv_cache_dtype`)
        graph_prompt_tokens=config.graph_prompt_tokens,
    )
    spec_settings = config.speculation
    if spec_settings is not None and shard.draft is not None:
        runner.proposer = draft_proposer(shard.draft, config, draft_blocks, shard.draft_cls)
    elif spec_settings is not None:  # prompt lookup
        runner.proposer = NgramProposer(spec_settings.prompt_lookup_min, spec_settings.prompt_lookup_max)
    if config.lora is not None:  # each rank reads its shard of an adapter when a batch first names it
        from lmiserve.engine.factory import attach_lora
        from lmiserve.engine.lora.adapters import FAST_PATH_MODULES
        from lmiserve.engine.model.sharding import shard_adapter

        model = loaded.model
        attach_lora(runner, config.lora.max_lora_rank, FAST_PATH_MODULES, lambda adapter: shard_adapter(adapter, model))
        if runner.graphs is not None:  # decode steps with adapters replay the graphs too
            runner.graphs.carry_lora(config.lora.max_loras, config.lora.max_lora_rank)
    return runner


_NATIVE_PLACE = re.compile(r"^\[[^\]]+\.(?:cc|cpp|h|hpp):\d+\]\s*")  # gloo's and c10's "[file.cc:553] "


def _summary(exc: BaseException) -> str:
    """The first line of `exc` without a native library's source place and advice (the worker's log has
    the whole of it): "Connection closed by peer [127.0.0.1]:16015" of gloo's long message."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    native = _NATIVE_PLACE.sub("", text)
    return native.split(". ", 1)[0] if native != text else text


def _tell(conn: Connection | None, message: tuple[str, Any]) -> None:
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.send(message)
