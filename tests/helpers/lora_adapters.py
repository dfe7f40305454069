"""PEFT LoRA adapters made in tests: random, with a non-zero B (PEFT starts B at zero, which would make
an adapter that changes nothing), saved as PEFT saves them (`adapter_config.json` and
`adapter_model.safetensors`), and the reference output: `generate()` of the base model with the adapter
merged into its weights by PEFT."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter made for a test adapts: its rank, alpha, target linears, seed and B's scale."""

    name: str
    rank: int
    targets: Sequence[str]
    seed: int
    alpha: float = 16.0
    b_std: float = 0.05
    rslora: bool = False


# three adapters of different ranks and targets (the "several adapters")
SPECS = (
    AdapterSpec("alpha", 8, ("q_proj", "v_proj"), seed=1, b_std=0.3),
    AdapterSpec("beta", 4, ALL_MODULES, seed=2, alpha=8.0, b_std=0.15),
    AdapterSpec("gamma", 16, ("o_proj", "gate_proj", "down_proj", "k_proj"), seed=3, b_std=0.08, rslora=True),
)


def _peft_model(base_dir: Path, spec: AdapterSpec):  # -> peft.PeftModel
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        use_rslora=spec.rslora,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * spec.b_std)
            elif "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (1.0 / param.shape[1] ** 0.5))
    return peft_model


def make_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Save adapter `spec` for the model in `base_dir` into `out_dir` (PEFT's own files)."""
    peft_model = _peft_model(base_dir, spec)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_generate(
    base_dir: Path,
    adapter_dir: Path | None,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """Greedy `generate()` of the base model with the adapter merged by PEFT (None: the base model),
    one prompt at a time on `device`: the new token ids of each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.to(device).eval()
    model.generation_config.eos_token_id = None  # as `ignore_eos_token`: EOS may be generated, and does not stop
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def served_with_adapter(loaded, config, name: str, folder: Path, prompts: Sequence[str], tokens: int, path: str):  # noqa: ANN001, ANN201 - (LoadedModel, EngineConfig) -> list[list[int]]
    """An engine of `config` over `loaded` (its runner on `path`: fast or generic) with adapter `name` registered
    from `folder`: the greedy token ids of each of `prompts` (served at once), each request naming the adapter."""
    import asyncio

    from lmiserve.core.request import GenerationRequest, SamplingParams
    from lmiserve.engine.factory import create_engine

    async def run() -> list[list[int]]:
        engine = create_engine(loaded, config)
        assert engine.runner.path == path and engine.adapters is not None
        await asyncio.to_thread(engine.adapters.register, name, folder)
        engine.start()
        params = SamplingParams(max_new_tokens=tokens, ignore_eos_token=True)

        async def one(prompt: str) -> list[int]:
            request = GenerationRequest(prompt, params, adapter=name)
            return [e.token.id async for e in engine.generate(request) if e.token is not None]

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await engine.stop()

    return asyncio.run(run())
