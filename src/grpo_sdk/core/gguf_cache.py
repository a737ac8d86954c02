"""GGUF files as a model source: dequantized once into a cached Hugging Face model directory.

A ``.gguf`` file (llama.cpp's format, quantized weights plus tokenizer and chat template in one
file) is loaded through transformers' GGUF support, which dequantizes it to float. transformers
then refuses ``save_pretrained`` ("quantized with gguf and is not serializable") and vLLM reads
directories, so the model is rebuilt from its config and state dict and written, once, as a plain
safetensors model directory keyed by the file's sha256: every later load (policy, reference,
generation, vLLM, a teacher, ``grpoctl serve``) reads that directory in its configured precision.
The weights are cached in float32, the values transformers' dequantization produces, unchanged:
a run then loads them in whatever precision it asks for.

The cache is ``$GRPO_SDK_CACHE_DIR/models`` (default ``~/.cache/grpo-sdk/models``), one
``gguf-<sha256>`` directory per file (docs/models.md). A conversion writes a staging directory and
renames it into place, under an exclusive ``flock`` on ``models/.lock``: a kill mid-conversion
leaves only a staging directory, which the next conversion removes, and a second process waits for
the first, then finds its directory. A file that cannot be read fails before anything is written.

Importing this module imports nothing heavy; torch, transformers and gguf load when a file converts.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from grpo_sdk.core.errors import ModelFileError, ModelLoadError, PluginError
from grpo_sdk.core.files import fsync_dir, fsync_tree

CACHE_ENV = "GRPO_SDK_CACHE_DIR"
DEFAULT_CACHE = "~/.cache/grpo-sdk"
INSTALL = "pip install 'grpo-sdk[gguf]'"
MAGIC = b"GGUF"
LOCK_NAME = ".lock"
LOCK_WAIT_S = 3600.0  # another process converting the same file: wait this long at most
PACKAGES = ("gguf", "accelerate")  # transformers dequantizes with gguf and loads GGUF weights only with accelerate

_hashes: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: a run hashes each file once


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def models_cache() -> Path:
    return cache_root() / "models"


def file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _hashes:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        _hashes[key] = digest.hexdigest()
    return _hashes[key]


def cache_dir_of(path: Path) -> Path:
    return models_cache() / f"gguf-{file_sha256(path)}"


def _complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def cached_model_dir(name: str) -> Path | None:
    """The cached directory of GGUF file ``name`` if it was converted before, else None; never converts."""
    path = Path(name).expanduser()
    try:
        directory = cache_dir_of(path)
    except OSError:
        return None
    return directory if _complete(directory) else None


def check_gguf_file(name: str, key: str) -> Path:
    """The file exists and starts like a GGUF file (cheap: the first bytes only). ModelFileError otherwise."""
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelFileError(f"{key}: no GGUF file at {name}")
    if not path.is_file():
        raise ModelFileError(f"{key}: {name} is a directory; a name ending in .gguf must be a GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as exc:
        raise ModelFileError(f"{key}: cannot read {name}: {exc.strerror or exc}") from None
    if head != MAGIC:
        shown = "an empty file" if not head else f"it starts with {head!r}"
        raise ModelFileError(f"{key}: {name} is not a GGUF file ({shown}; a GGUF file starts with b'GGUF')")
    return path


def require_packages(key: str, name: str) -> None:
    """gguf and accelerate are installed (found, not imported), else a PluginError (exit 3) with the install line."""
    missing = [p for p in PACKAGES if _find_spec(p) is None]
    if missing:
        raise PluginError(f"{key}: loading the GGUF file {name} needs {' and '.join(missing)}, which "
                          f"{'is' if len(missing) == 1 else 'are'} not installed: {INSTALL}")


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # sys.modules[name] = None (a test's way of uninstalling it)
        return None


def gguf_model_dir(name: str, key: str) -> str:
    """The cached model directory of GGUF file ``name``, converting it first when it is not cached."""
    path = check_gguf_file(name, key)
    try:
        final = cache_dir_of(path)
        if _complete(final):
            return str(final)
        require_packages(key, name)
        inspect_gguf(path, key)  # a bad file fails here, before anything is written to the cache
        final.parent.mkdir(parents=True, exist_ok=True)
        with _conversion_lock(final.parent / LOCK_NAME, path):
            if not _complete(final):  # another process may have finished it while this one waited
                _convert_into(path, final, key)
    except OSError as exc:
        where = exc.filename or models_cache()
        raise ModelLoadError(f"{key}: could not write the converted model of {name} to the cache ({where}: "
                             f"{exc.strerror or exc}); set {CACHE_ENV} to a writable directory") from None
    return str(final)


class _conversion_lock:
    """An exclusive flock on the cache's one lock file (conversions are rare: one at a time is enough,
    and one file leaves no lock per model behind); the kernel drops it when the holder dies."""

    def __init__(self, path: Path, source: Path):
        self.path, self.source = path, source

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, told = time.monotonic() + LOCK_WAIT_S, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise
            if time.monotonic() > deadline:
                os.close(self.fd)
                raise ModelLoadError(f"another process has been converting {self.source} for over "
                                     f"{LOCK_WAIT_S:.0f} s (it holds {self.path}); stop it or remove that file")
            if not told:
                print(f"waiting for another process converting {self.source.name} ...", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing the descriptor drops the flock


def _convert_into(path: Path, final: Path, key: str) -> None:
    """Convert under the lock: a leftover staging directory (a killed conversion) and an incomplete
    final one go first; the new one appears by rename only once every file is written and flushed."""
    for stale in final.parent.glob(f".{final.name}.partial*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        shutil.rmtree(final)
    staging = final.with_name(f".{final.name}.partial-{os.getpid()}")
    size = path.stat().st_size
    shown = f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"
    print(f"converting {path.name} ({shown}) to a safetensors model in {final} ...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        _write_model(path, staging, key)
        (staging / "gguf_source.json").write_text(json.dumps(
            {"file": str(path.resolve()), "bytes": size, "sha256": file_sha256(path)}, indent=2) + "\n")
        fsync_tree(staging)
        os.replace(staging, final)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"converted {path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def inspect_gguf(path: Path, key: str) -> Any:
    """Read the header and tensor table (gguf's reader), and check what transformers will need: an
    architecture it reads and quantisation types gguf dequantizes. Returns the reader."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader fails with IndexError, ValueError... on a damaged file
        raise ModelFileError(f"{key}: {path} is truncated or corrupt ({path.stat().st_size:,} bytes): gguf cannot "
                             f"read its tensor table ({type(exc).__name__}: {exc})") from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # metadata sections, not models
        raise ModelFileError(f"{key}: {path} holds a {arch!r} model, an architecture transformers' GGUF loader "
                             f"cannot read (it reads: {', '.join(known)})")
    readable = {Q.F32, Q.F16, *getattr(gguf.quants, "_type_traits", {})}
    unreadable = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if unreadable:
        raise ModelFileError(f"{key}: {path} stores tensors as {', '.join(unreadable)}, a quantisation type the "
                             f"gguf package ({_version('gguf')}) cannot dequantize; use a file quantised otherwise "
                             "(Q8_0, Q4_K_M, F16...)")
    return reader


def _write_model(path: Path, staging: Path, key: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ImportError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers fails in many ways on a file it cannot map
        first = f"{exc}".strip().splitlines()[0] if f"{exc}".strip() else ""
        raise ModelFileError(f"{key}: transformers could not load {path} ({type(exc).__name__}: {first})") from None
    # save_pretrained refuses a GGUF-loaded model; the same architecture built from the config is a
    # plain model (tied embeddings tie again in the rebuild, so the head is saved once).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = str(path)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    del model
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


def gguf_parameters(name: str) -> tuple[int, dict[str, Any]]:
    """(elements of every tensor, config facts) from a GGUF file's header and tensor table, without
    torch: for the run plan. The facts hold model_type, vocab_size and the context length."""
    import gguf

    reader = gguf.GGUFReader(Path(name).expanduser())
    arch = reader.fields["general.architecture"].contents()
    facts: dict[str, Any] = {"model_type": arch}
    for gguf_key, hf_key in ((f"{arch}.vocab_size", "vocab_size"), (f"{arch}.context_length", "max_position_embeddings")):
        if gguf_key in reader.fields:
            facts[hf_key] = int(reader.fields[gguf_key].contents())
    if "vocab_size" not in facts and "tokenizer.ggml.tokens" in reader.fields:
        facts["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return sum(int(t.n_elements) for t in reader.tensors), facts


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"

