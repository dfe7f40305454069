"""Which files of a remote model are fetched (lmiserve/models/download/selection.py): one set of weights, the
files that describe the model, one GGUF file of a GGUF repository; clear errors when there is no model."""

from __future__ import annotations

import pytest

from lmiserve.models.download import DownloadError, allowed, canonical_url, scheme_of
from lmiserve.models.download.selection import RemoteFile, select, split_gguf_tag


def files(*names: str) -> list[RemoteFile]:
    return [RemoteFile(name, 10) for name in names]


def names(chosen: list[RemoteFile]) -> list[str]:
    return [f.name for f in chosen]


LLAMA_REPO = files(
    ".gitattributes",
    "README.md",
    "LICENSE",
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin",
    "pytorch_model.bin.index.json",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/tokenizer.model",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "modeling_custom.py",
    "onnx/model.onnx",
)


def test_safetensors_only_never_the_bin_copies_nor_original():
    assert names(select(LLAMA_REPO, source="org/llama")) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_remote_code_only_when_trusted():
    assert "modeling_custom.py" in names(select(LLAMA_REPO, source="org/llama", trust_remote_code=True))


def test_bin_weights_when_there_are_no_safetensors():
    repo = files("config.json", "pytorch_model.bin", "training_args.bin", "vocab.txt", "merges.txt", "vocab.json")
    assert names(select(repo, source="r")) == [
        "config.json",
        "merges.txt",
        "pytorch_model.bin",
        "vocab.json",
        "vocab.txt",
    ]


def test_consolidated_copies_are_skipped():
    repo = files("config.json", "consolidated.safetensors", "model.safetensors", "tokenizer.json")
    assert names(select(repo, source="r")) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_sentence_transformers_modules_and_adapters():
    st = files("config.json", "model.safetensors", "modules.json", "1_Pooling/config.json", "2_Normalize/x.bin")
    assert names(select(st, source="r")) == [
        "1_Pooling/config.json",
        "config.json",
        "model.safetensors",
        "modules.json",
    ]
    adapter = files("adapter_config.json", "adapter_model.safetensors", "README.md")
    assert names(select(adapter, source="r")) == ["adapter_config.json", "adapter_model.safetensors"]


GGUF_REPO = files("README.md", "Model-Q4_K_M.gguf", "Model-Q8_0.gguf", "Model.F16.gguf")


def test_gguf_by_tag_by_file_and_by_default():
    assert names(select(GGUF_REPO, source="r", gguf_tag="q8_0")) == ["Model-Q8_0.gguf"]
    assert names(select(GGUF_REPO, source="r", gguf_tag="F16")) == ["Model.F16.gguf"]
    assert names(select(GGUF_REPO, source="r", gguf_file="Model-Q8_0.gguf")) == ["Model-Q8_0.gguf"]
    assert names(select(GGUF_REPO, source="r")) == ["Model-Q4_K_M.gguf"]  # llama.cpp's default
    assert names(select(files("only.Q2_K.gguf"), source="r")) == ["only.Q2_K.gguf"]  # the only one


def test_gguf_errors_name_what_is_there():
    with pytest.raises(DownloadError, match=r"r has no IQ2_XS GGUF file; its quantizations: F16, Q4_K_M, Q8_0"):
        select(GGUF_REPO, source="r", gguf_tag="IQ2_XS")
    with pytest.raises(DownloadError, match=r"r has no file 'x.gguf'; its GGUF files: Model-Q4_K_M.gguf"):
        select(GGUF_REPO, source="r", gguf_file="x.gguf")
    with pytest.raises(DownloadError, match="no Q4_K_M GGUF file.*name one with r:TAG"):
        select(files("a.Q8_0.gguf", "a.Q6_K.gguf"), source="r")
    with pytest.raises(DownloadError, match="split GGUF"):
        select(files("big-Q4_K_M-00001-of-00002.gguf"), source="r")


def test_no_model_in_it():
    with pytest.raises(DownloadError, match=r"^s3://b/p holds no model: it has no files$"):
        select([], source="s3://b/p")
    with pytest.raises(DownloadError, match=r"holds no model: no config.json, adapter_config.json, .gguf or"):
        select(files("README.md", "data.csv"), source="s3://b/p")
    with pytest.raises(DownloadError, match="holds no model weights"):
        select(files("config.json", "tokenizer.json"), source="r")


def test_torchscript_model():
    assert names(select(files("model.pt", "README.md"), source="r")) == ["model.pt"]


def test_split_gguf_tag():
    assert split_gguf_tag("org/repo:Q4_K_M") == ("org/repo", "Q4_K_M")
    assert split_gguf_tag("org/repo") == ("org/repo", None)


def test_what_is_remote(tmp_path):
    assert scheme_of("org/name") == "hf"
    assert scheme_of("gpt2") == "hf"
    assert scheme_of("org/repo:Q4_K_M") == "hf"
    assert scheme_of("hf://org/name") == "hf"
    assert scheme_of("s3://bucket/prefix") == "s3"
    assert scheme_of("gs://bucket/prefix") == "gs"
    assert scheme_of("https://example.com/m") is None
    assert scheme_of("./models/a") is None
    assert scheme_of("/abs/path") is None
    assert scheme_of("model.gguf") is None
    assert scheme_of("a/b/c") is None
    (tmp_path / "org").mkdir()
    assert scheme_of(str(tmp_path / "org")) is None  # an existing path is never a Hub id


def test_allowed_model_urls_match_whole_path_segments():
    prefixes = "s3://bucket/models/, gs://other, hf://my-org"
    assert allowed("s3://bucket/models/llama", prefixes)
    assert not allowed("s3://bucket/models-private/llama", "s3://bucket/models")
    assert allowed("gs://other/x/y", prefixes)
    assert not allowed("gs://other-bucket/x", prefixes)
    assert allowed("my-org/model", prefixes)
    assert allowed("hf://my-org/model", prefixes)
    assert not allowed("my-org-evil/model", prefixes)
    assert not allowed("s3://bucket/models/llama", None)
    assert not allowed("s3://bucket/models/llama", "")
    assert allowed("org/name", "org/")  # a Hub prefix written as an id
    assert canonical_url("org/name") == "hf://org/name"
