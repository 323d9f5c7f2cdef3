"""Finding targets: errors that say what is wrong with the path or id, hub ids that fail fast
offline, and the converted-GGUF cache keyed by content (no real conversion here: 20 s)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from specdraft import ModelLoadError, SpeculativeDecoder, models
from specdraft.models import load_target
from specdraft.testing import tiny_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A transformers folder with config and weights but no tokenizer files."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab_size=64, seed=3, layers=1).save_pretrained(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache directory (only for files that never get converted)."""
    monkeypatch.setenv("SPECDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def _message(target, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_target(target, **kwargs)
    return str(info.value)


# ---- local folders and files: say what is wrong with them ----------------------------------------------

def test_empty_folder(tmp_path):
    assert _message(tmp_path) == (f"{str(tmp_path)!r} is not a model folder: it is empty. Pass a folder saved with "
                                  "save_pretrained (config.json, *.safetensors weights, tokenizer files) or a .gguf file")


def test_folder_without_config(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert "is not a model folder: it has no config.json" in _message(tmp_path)


def test_invalid_config_json_gives_the_position(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",, }')
    assert _message(tmp_path) == (f"{str(tmp_path / 'config.json')!r} is not valid JSON (Expecting property name "
                                  "enclosed in double quotes: line 1 column 24 (char 23)); fix or replace that file")


def test_folder_without_weights(tmp_path, tiny_folder):
    (tmp_path / "config.json").write_text((tiny_folder / "config.json").read_text())
    message = _message(tmp_path, require_tokenizer=False)
    assert message.startswith(f"could not load model folder {str(tmp_path)!r}: OSError: ") and "\n" not in message


def test_folder_without_tokenizer(tiny_folder):
    assert _message(tiny_folder) == (
        f"model folder {str(tiny_folder)!r} has no tokenizer files: add the tokenizer of the model it comes from "
        "(tokenizer.json and tokenizer_config.json; `tokenizer.save_pretrained(folder)` writes them)")
    model, tokenizer, _ = load_target(tiny_folder, require_tokenizer=False)  # a draft needs none
    assert tokenizer is None and model.config.vocab_size == 64


def test_unloadable_tokenizer_is_one_line(tmp_path, tiny_folder):
    for f in tiny_folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{}")  # no vocabulary anywhere
    message = _message(tmp_path)
    assert message.startswith(f"could not load the tokenizer of {str(tmp_path)!r} (")
    assert message.endswith("writes them)") and "\n" not in message


def test_file_that_is_not_gguf(tmp_path, cache):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert _message(weights) == (f"{str(weights)!r} is not a GGUF file (it does not start with the GGUF magic "
                                 "bytes); pass a .gguf file or a model folder")


def test_truncated_gguf(tmp_path, cache):
    half = tmp_path / "half.gguf"
    with open(models.default_gguf_path(), "rb") as f:
        half.write_bytes(f.read(2_000_000))  # the real header, most tensors cut off
    message = _message(half)
    assert message.startswith(f"GGUF file {str(half)!r} is truncated or corrupt (ValueError: ")
    assert message.endswith("; download it again")
    assert not any(cache.glob(".tmp-*")) and not any(p.is_dir() for p in cache.iterdir())  # nothing half-made


def test_broken_draft_model_path_says_what_is_wrong(tmp_path, tiny_model, cache):
    """draft-model used to claim such a path was 'not a local folder, not in the Hugging Face cache'."""
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    for path, expected in [(tmp_path / "empty", "is not a model folder: it is empty"),
                           (broken, "is truncated or corrupt")]:
        with pytest.raises(ModelLoadError) as info:
            SpeculativeDecoder(tiny_model, None, drafter="draft-model", drafter_options={"model": str(path)})
        assert str(info.value).startswith(f"draft model: ") and expected in str(info.value)
        assert "Hugging Face" not in str(info.value)


# ---- hub ids without network: one probe, no retries, and what to do instead -------------------------------

@pytest.fixture
def no_sockets(monkeypatch):
    """Record (and refuse) every connection attempt: the hub's retry loop would show up here."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_hub_id_without_network_fails_at_once(monkeypatch, no_sockets):
    import huggingface_hub.constants

    probes = []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(models, "_hub_reachable", lambda: probes.append(1) or False)
    message = _message("someorg/not-cached-model")
    assert probes == [1] and no_sockets == []  # one probe, then the local cache only: no request, no retry
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False  # offline only while loading
    assert message == (
        "model 'someorg/not-cached-model' is not (fully) in the Hugging Face cache and the hub "
        f"({huggingface_hub.constants.ENDPOINT}) cannot be reached. Point --target at a local copy "
        "(--target=/path/to/folder or a .gguf file), or download it where there is network "
        "(`hf download someorg/not-cached-model`) and set HF_HUB_OFFLINE=1 to use the cached copy")


def test_hub_id_with_hf_hub_offline_does_not_probe(monkeypatch, no_sockets):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "_hub_reachable", lambda: pytest.fail("probed although HF_HUB_OFFLINE is set"))
    assert "and HF_HUB_OFFLINE is set. Point --target" in _message("someorg/not-cached-model")
    assert no_sockets == []


def test_probe_is_one_request(monkeypatch):
    """Refused at once: unreachable; any HTTP answer, even an error: reachable."""
    import http.server
    import threading

    import huggingface_hub.constants

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert models._hub_reachable.__wrapped__() is True
    finally:
        server.server_close()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    assert models._hub_reachable.__wrapped__() is False


# ---- the converted-GGUF cache: keyed by content, hashed once, no leftovers --------------------------------

def _fake_gguf(path, payload: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + payload)
    return path


def _converted(cache, data: bytes, stem="m"):
    """Pretend ``data`` was converted already: the folder its content key names."""
    out = cache / f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    return out


def test_copies_of_a_file_share_one_conversion(tmp_path, cache):
    a = _fake_gguf(tmp_path / "clone1" / "m.gguf", b"weights")
    b = _fake_gguf(tmp_path / "clone2" / "m.gguf", b"weights")
    other = _fake_gguf(tmp_path / "clone3" / "m.gguf", b"other weights")
    out = _converted(cache, a.read_bytes())
    assert models._converted_gguf_dir(a) == out
    assert models._converted_gguf_dir(b) == out  # another install path, same content: no new conversion
    assert models._content_hash(other, cache / "hashes.json") != models._content_hash(a, cache / "hashes.json")


def test_the_hash_is_remembered_by_path_size_and_mtime(tmp_path, cache, monkeypatch):
    hashed = []
    real = models.file_sha256
    monkeypatch.setattr(models, "file_sha256", lambda p: hashed.append(p) or real(p))
    gguf = _fake_gguf(tmp_path / "m.gguf", b"weights")
    out = _converted(cache, gguf.read_bytes())
    assert models._converted_gguf_dir(gguf) == out
    assert models._converted_gguf_dir(gguf) == out
    assert hashed == [gguf]  # the second load read the sidecar
    assert list(json.loads((cache / "hashes.json").read_text()).values()) == [hashlib.sha256(b"GGUFweights").hexdigest()]
    gguf.write_bytes(b"GGUFchanged")  # new content (and mtime): hashed again, another folder
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert models._content_hash(gguf, cache / "hashes.json") == hashlib.sha256(b"GGUFchanged").hexdigest()
    assert hashed == [gguf, gguf]


def test_stale_conversion_folders_are_removed(tmp_path, cache):
    gguf = _fake_gguf(tmp_path / "m.gguf", b"weights")
    _converted(cache, gguf.read_bytes())
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    folders = {
        "dead": cache / f".tmp-{dead}@{host}-abcd1234",  # its process is gone
        "old": cache / f".tmp-{os.getpid()}@{host}-abcd1234",  # alive, but unchanged for 2 hours
        "live": cache / f".tmp-{os.getpid()}@{host}-efgh5678",  # a conversion under way
        "elsewhere": cache / f".tmp-{dead}@not-{host}-abcd1234",  # another host's: only its age counts
    }
    for folder in folders.values():
        folder.mkdir()
    old = time.time() - 2 * models.STALE_TMP_S
    os.utime(folders["old"], (old, old))
    models._converted_gguf_dir(gguf)  # any load of a GGUF file cleans up
    assert {k for k, f in folders.items() if f.exists()} == {"live", "elsewhere"}


@pytest.mark.skipif(os.name == "nt", reason="SIGKILL")
def test_a_conversion_killed_with_sigkill_leaves_nothing_behind(tmp_path, cache):
    cache.mkdir(parents=True)
    code = ("import sys, time; from pathlib import Path; from specdraft import models; "
            "print(models._conversion_tmp_dir(Path(sys.argv[1])), flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(cache)], stdout=subprocess.PIPE, text=True)
    tmp = proc.stdout.readline().strip()
    assert os.path.isdir(tmp) and os.path.basename(tmp).startswith(".tmp-")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    gguf = _fake_gguf(tmp_path / "m.gguf", b"weights")
    _converted(cache, gguf.read_bytes())
    models._converted_gguf_dir(gguf)
    assert not os.path.exists(tmp)


@pytest.mark.parametrize("flags, dtype, reason", [
    ({"avx512f", "avx512_bf16"}, "bfloat16", "native: avx512_bf16"),
    ({"avx512f", "amx_bf16", "avx512_bf16"}, "bfloat16", "native: amx_bf16"),
    ({"avx2", "avx512f"}, "bfloat16", "with AVX-512: specdraft's panel products"),
    ({"avx2", "fma"}, "bfloat16", "with AVX2: specdraft's panel products"),
    ({"sse4_2", "avx"}, "float32", "without native bfloat16 products, AVX-512 or AVX2"),
])
def test_the_cpu_default_dtype_follows_native_bfloat16(monkeypatch, flags, dtype, reason):
    import torch

    if reason.startswith("native") and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this processor's oneDNN has no bfloat16 products at all")
    monkeypatch.setattr(models, "cpu_flags", lambda: flags)
    chosen, why = models.default_dtype("cpu")
    assert chosen == getattr(torch, dtype) and reason in why
    assert models.resolve_dtype(None, "cpu") == chosen and models.resolve_dtype("float64", "cpu") == torch.float64
    assert models.default_dtype("cuda")[0] == torch.bfloat16


def test_from_pretrained_says_why_the_target_has_its_dtype(cached_default_model):
    with SpeculativeDecoder.from_pretrained(drafter="none") as dec:
        info = dec.runner_info
    assert info["dtype"] == str(models.default_dtype("cpu")[0]).removeprefix("torch.")
    assert info["dtype_reason"] == models.default_dtype("cpu")[1]
    with SpeculativeDecoder.from_pretrained(drafter="none", dtype="float32") as dec:
        assert (dec.runner_info["dtype"], dec.runner_info["dtype_reason"]) == ("float32", "asked for")
