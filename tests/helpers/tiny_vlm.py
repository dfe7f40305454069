"""Tiny random vision-language models, one per transformers family, saved like real checkpoints.

Each directory holds a random-weight model (fp32, seeded) with its processor: the family's PIL image
processor (no torchvision), the tiny byte-level BPE tokenizer of `tiny_model` with the family's special
tokens added, and the family's real chat template. `lmiserve.models.load.load_causal_lm` loads it as it
loads a real checkpoint.

The shapes follow these published checkpoints, shrunk (hidden 64, two text layers, a two-to-three-layer
vision tower, a small image size) while every architecture knob keeps its published value or ratio:

- ``llava``: llava-hf/llava-1.5-7b-hf. CLIP vision tower (quick_gelu, vision_feature_layer -2,
  select strategy ``default``: the CLS token dropped), gelu projector, Llama text; ``<image>`` token,
  CLIPImageProcessor (shortest edge + centre crop; 336 -> 32, patch 14 -> 8: 16 image tokens).
- ``llava_next``: llava-hf/llava-v1.6-mistral-7b-hf. As LLaVA, Mistral text, AnyRes with the published
  ``image_grid_pinpoints`` scaled by 32/336 (336 -> 32), ``image_newline``; LlavaNextImageProcessor.
- ``qwen2_vl``: Qwen/Qwen2-VL-2B-Instruct. Patch 14, temporal patch 2, spatial merge 2, quick_gelu
  vision MLP (ratio 4), M-RoPE ``mrope_section`` [16, 24, 24] scaled to head_dim 16 -> [2, 3, 3];
  ``<|vision_start|><|image_pad|><|vision_end|>``; max_pixels lowered to 64 merged tokens per image.
- ``qwen2_5_vl``: Qwen/Qwen2.5-VL-3B-Instruct. Window attention (window_size 112) with full-attention
  blocks (the last of each group, ``fullatt_block_indexes`` [1] of 2), SiLU gated vision MLP, M-RoPE
  as Qwen2-VL; its chat template is Qwen2-VL's.
- ``qwen3_vl``: Qwen/Qwen3-VL-2B-Instruct. Patch 16, learned position embeddings interpolated
  (``num_position_embeddings`` a square), DeepStack (``deepstack_visual_indexes``: features of early
  vision layers added to the first text layers), interleaved M-RoPE ``mrope_section`` [24, 20, 20]
  scaled to head_dim 32 -> [6, 5, 5]; its chat template without the tool-calling branch.
- ``idefics3``: HuggingFaceTB/SmolVLM-256M-Instruct (Idefics3 architecture). SigLIP-style vision tower,
  pixel-shuffle connector with ``scale_factor`` 4, image splitting into crops + a global image with
  ``<fake_token_around_image>``/``<row_i_col_j>``/``<global-img>`` markup; vision 512 px / patch 16 ->
  32 px / patch 4 (64 patches / 4**2 = 4 tokens per crop, ``image_seq_len`` 4).
- ``gemma3``: google/gemma-3-4b-it. SigLIP vision tower, average pooling to ``mm_tokens_per_image``
  (256 of 4096 patches -> 16 of 64), ``query_pre_attn_scalar``, sliding/full layer pattern (one sliding
  then one full layer, sliding_window 1024 as published), local/global RoPE bases; the embeddings are
  untied (published: tied), as a tied random model only repeats its last token;
  ``<start_of_image>`` expanded to ``\\n\\n<start_of_image>`` + 16 ``<image_soft_token>`` +
  ``<end_of_image>\\n\\n``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from helpers.tiny_model import build_tiny_tokenizer

__all__ = [
    "FAMILIES",
    "IMAGE_TOKEN_ATTR",
    "MOE_FAMILIES",
    "TINY_VLM_SEED",
    "TinyVlmDirs",
    "build_tiny_vlm_dir",
    "image_token_id",
    "load_tiny_vlm",
    "reference_generate",
    "reference_inputs",
    "served_name",
    "tiny_image",
]

FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "gemma3")
# Qwen3-VL's mixture of experts (Qwen3-VL-30B-A3B): Qwen3-VL's processor and vision tower, experts in every text
# layer; apart from FAMILIES (the VLM tests' parameters): tests/unit/test_moe_fast.py serves it
MOE_FAMILIES = ("qwen3_vl_moe",)
TINY_VLM_SEED = 4321
# The config attribute naming the id of the token the image features replace.
IMAGE_TOKEN_ATTR = {
    "llava": "image_token_index",
    "llava_next": "image_token_index",
    "qwen2_vl": "image_token_id",
    "qwen2_5_vl": "image_token_id",
    "qwen3_vl": "image_token_id",
    "qwen3_vl_moe": "image_token_id",
    "idefics3": "image_token_id",
    "gemma3": "image_token_index",
}
_INIT_STD = 0.2  # as the tiny text model (helpers.tiny_model.TINY_INIT_STD): varied greedy output
_MAX_POSITIONS = 1024
_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}

# ---- the families' real chat templates ------------------------------------------------------------------

# llava-hf/llava-1.5-7b-hf (chat_template.json)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# llava-hf/llava-v1.6-mistral-7b-hf (chat_template.json)
LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + "
    "message['content'][0]['text'] + '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', "
    "'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}{{' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'][0]['text'] + '<\\s> '}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Qwen/Qwen2-VL-2B-Instruct and Qwen/Qwen2.5-VL-3B-Instruct (chat_template.json)
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = "
    "image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# Qwen/Qwen3-VL-2B-Instruct (chat_template.json), its tool-calling and tool-response branches left out
QWEN3_VL_TEMPLATE = """{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                <|vision_start|><|image_pad|><|vision_end|>
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                <|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, false) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, True) %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# HuggingFaceTB/SmolVLM-256M-Instruct (chat_template.json)
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]"
    "['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if "
    "line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# google/gemma-3-4b-it (chat_template.json)
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# ---- tokenizers -------------------------------------------------------------------------------------------


def _tokenizer(
    specials: Sequence[str],
    bos: str = "<s>",
    eos: str = "</s>",
    pad: str = "<pad>",
    extra: dict[str, str] | None = None,
    add_bos: bool = True,
) -> Any:
    """The tiny trained BPE tokenizer with `specials` added as special tokens (ids from 512 on), `bos`,
    `eos` and `pad` (added when new), and `extra` named special tokens (``image_token`` ...)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    base = build_tiny_tokenizer()
    backend = base.backend_tokenizer
    new = [token for token in (bos, eos, pad, *specials) if backend.token_to_id(token) is None]
    from tokenizers import AddedToken

    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in new])
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = None
    kwargs: dict[str, Any] = {}
    if extra:
        kwargs["extra_special_tokens"] = extra
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token="<unk>",
        model_max_length=_MAX_POSITIONS,
        **kwargs,
    )


def _token_ids(tokenizer: Any, **tokens: str) -> dict[str, int]:
    return {name: int(tokenizer.convert_tokens_to_ids(token)) for name, token in tokens.items()}


def _common_text(tokenizer: Any) -> dict[str, Any]:
    return {
        **_TEXT,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": _MAX_POSITIONS,
        "initializer_range": _INIT_STD,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


# ---- the families -------------------------------------------------------------------------------------------


def _clip_vision(image_size: int) -> dict[str, Any]:
    # CLIP ViT-L/14-336 shrunk: quick_gelu, patch 14 -> 8 at 336 -> 32 px
    return {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 8,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
        "initializer_range": _INIT_STD,
    }


def _llava(next_: bool) -> tuple[Any, Any]:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = _tokenizer(["<image>"], extra={"image_token": "<image>"})
    image_id = _token_ids(tokenizer, image="<image>")["image"]
    common = {
        "vision_config": _clip_vision(32),
        "image_token_index": image_id,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "image_seq_length": 16,
        "tie_word_embeddings": False,
    }
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    if not next_:
        from transformers import LlavaConfig, LlavaProcessor

        text = {"model_type": "llama", **_common_text(tokenizer)}
        config = LlavaConfig(text_config=text, **common)
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_mean=mean, image_std=std
        )
        processor = LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=LLAVA_TEMPLATE,
        )
        return config, processor
    from transformers import LlavaNextConfig, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    # published [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], 336 -> 32
    pinpoints = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
    text = {"model_type": "mistral", **_common_text(tokenizer), "num_key_value_heads": 2, "sliding_window": None}
    config = LlavaNextConfig(text_config=text, image_grid_pinpoints=pinpoints, **common)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_grid_pinpoints=pinpoints,
        image_mean=mean,
        image_std=std,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_NEXT_TEMPLATE,
    )
    return config, processor


def _images_only(processor_class: type) -> Any:
    """The Qwen-VL processor class without its video processor (transformers' video processors need
    torchvision), as lmiserve builds it."""
    from lmiserve.models.vision import _without_video

    return _without_video(processor_class)


_QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _qwen(family: str) -> tuple[Any, Any]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # Qwen's tokenizers add no BOS; the chat template's <|im_end|> ends a turn
    tokenizer = _tokenizer(_QWEN_SPECIALS, bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", add_bos=False)
    ids = _token_ids(
        tokenizer,
        image_token_id="<|image_pad|>",
        video_token_id="<|video_pad|>",
        vision_start_token_id="<|vision_start|>",
        vision_end_token_id="<|vision_end|>",
    )
    text = {**_common_text(tokenizer), "num_key_value_heads": 2, "tie_word_embeddings": False}
    patch = 16 if family.startswith("qwen3_vl") else 14
    factor = patch * 2  # patch x spatial merge
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    if family.startswith("qwen3_vl"):
        mean, std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    # 4 to 64 merged tokens per image (published: 4 to 16384 for Qwen2-VL, 8 to 16384 for Qwen3-VL)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": factor * factor * 4, "longest_edge": factor * factor * 64},
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=mean,
        image_std=std,
    )
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLProcessor

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        vision = {
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "hidden_act": "quick_gelu",
            "mlp_ratio": 4,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": _INIT_STD,
        }
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        return config, _images_only(Qwen2VLProcessor)(image_processor, tokenizer, chat_template=QWEN2_VL_TEMPLATE)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "hidden_act": "silu",
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "out_hidden_size": 64,
            "tokens_per_second": 2,
            "initializer_range": _INIT_STD,
        }
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        return config, _images_only(Qwen2_5_VLProcessor)(image_processor, tokenizer, chat_template=QWEN2_VL_TEMPLATE)
    from transformers import Qwen3VLConfig, Qwen3VLProcessor

    text["head_dim"] = 32
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
        "initializer_range": _INIT_STD,
    }
    if family == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig

        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
        moe = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
        return moe, _images_only(Qwen3VLProcessor)(image_processor, tokenizer, chat_template=QWEN3_VL_TEMPLATE)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    return config, _images_only(Qwen3VLProcessor)(image_processor, tokenizer, chat_template=QWEN3_VL_TEMPLATE)


def _idefics3() -> tuple[Any, Any]:
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    rows = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    specials = ["<|im_start|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *rows]
    # SmolVLM: <|im_start|> is BOS (written by the chat template), <end_of_utterance> ends a turn
    tokenizer = _tokenizer(specials, bos="<|im_start|>", eos="<end_of_utterance>", add_bos=False)
    image_id = _token_ids(tokenizer, image="<image>")["image"]
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 4,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": _INIT_STD,
    }
    text = {"model_type": "llama", **_common_text(tokenizer), "num_key_value_heads": 4, "tie_word_embeddings": False}
    config = Idefics3Config(
        text_config=text, vision_config=vision, image_token_id=image_id, scale_factor=4, tie_word_embeddings=False
    )
    # published: longest edge 2048 resized, split into 512 crops; here 64 into 32 crops (at most 2 x 2 + 1)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 64},
        max_image_size={"longest_edge": 32},
        do_image_splitting=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    return config, processor


def _gemma3() -> tuple[Any, Any]:
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    specials = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tokenizer = _tokenizer(
        specials,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        extra={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
    )
    ids = _token_ids(
        tokenizer,
        image_token_index="<image_soft_token>",
        boi_token_index="<start_of_image>",
        eoi_token_index="<end_of_image>",
    )
    text = {
        **_common_text(tokenizer),
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,  # published: head_dim (256)
        "sliding_window": 1024,
        "layer_types": ["sliding_attention", "full_attention"],  # published: 5 sliding, then 1 full
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": False,  # published: tied (a tied random model repeats its last token)
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 4,
        "vision_use_head": False,
        "initializer_range": _INIT_STD,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=16,
        initializer_range=_INIT_STD,
        tie_word_embeddings=False,
        **ids,
    )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": 32, "width": 32}, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    processor = Gemma3Processor(image_processor, tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=16)
    return config, processor


def _spec(family: str) -> tuple[Any, Any]:
    if family in ("llava", "llava_next"):
        return _llava(family == "llava_next")
    if family.startswith("qwen"):
        return _qwen(family)
    if family == "idefics3":
        return _idefics3()
    if family == "gemma3":
        return _gemma3()
    raise ValueError(f"unknown VLM family {family!r}: one of {', '.join(FAMILIES)}")


def build_tiny_vlm_dir(family: str, path: Path) -> Path:
    """Save the tiny `family` model (random weights, seeded, fp32), its processor and a generation config
    into `path`."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config, processor = _spec(family)
    tokenizer = processor.tokenizer
    with torch.random.fork_rng():
        torch.manual_seed(TINY_VLM_SEED)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def image_token_id(config: Any) -> int:
    """The id of the token the image features replace, whatever the family calls it."""
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    raise AttributeError(f"{type(config).__name__} names no image token")


def tiny_image(seed: int, size: tuple[int, int] = (112, 84)) -> Any:
    """A deterministic RGB image (`size` = width, height): a colour gradient with `seed`'s noise on top."""
    import numpy as np
    from PIL import Image

    width, height = size
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 // max(width - 1, 1), ys * 255 // max(height - 1, 1), (xs + ys) % 256], axis=-1)
    noisy = base + rng.integers(-64, 64, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), mode="RGB")


@functools.cache
def load_tiny_vlm(path: str) -> tuple[Any, Any]:
    """(model in eval mode, processor) of the tiny directory `path`, cached per process: the model by
    transformers alone (the reference), the processor as lmiserve builds it (transformers' processor
    class on the PIL image backend, without the video processor that needs torchvision)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from lmiserve.models.vision import load_processor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), load_processor(Path(path), model.config)


def reference_inputs(path: str | Path, messages_or_prompt: str | list[dict[str, Any]], images: Sequence[Any]) -> Any:
    """The processor's output (a BatchFeature of tensors) for a chat (`messages`, whose ``{"type":
    "image"}`` parts take `images` in order) or a prompt already holding the family's image tokens."""
    _, processor = load_tiny_vlm(str(path))
    if isinstance(messages_or_prompt, str):
        text = messages_or_prompt
    else:
        text = processor.apply_chat_template(messages_or_prompt, add_generation_prompt=True, tokenize=False)
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [list(images)]
    return processor(**kwargs)


def reference_generate(
    path: str | Path,
    messages_or_prompt: str | list[dict[str, Any]],
    images: Sequence[Any],
    max_new_tokens: int,
) -> list[int]:
    """transformers' own greedy `generate()` token ids (the new ones only) for the processor's output of
    `messages_or_prompt` and `images`: the parity reference for lmiserve's engine."""
    import torch

    model, _ = load_tiny_vlm(str(path))
    inputs = reference_inputs(path, messages_or_prompt, images)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0)
    return [int(token) for token in output[0, inputs["input_ids"].shape[1] :]]


def served_name(family: str) -> str:
    """The directory (so served model) name of `family`'s tiny model: ``tiny-llava``, ``tiny-qwen2-vl``..."""
    return "tiny-" + family.replace("_", "-")


class TinyVlmDirs(Mapping[str, Path]):
    """family -> its tiny model directory under `root`, each built the first time it is asked for."""

    def __init__(self, root: Path) -> None:
        self._root = Path(root)
        self._built: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in (*FAMILIES, *MOE_FAMILIES):
            raise KeyError(family)
        if family not in self._built:
            self._built[family] = build_tiny_vlm_dir(family, self._root / served_name(family))
        return self._built[family]

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)
