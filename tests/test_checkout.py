"""The checkout travels: its tracked tree fits, with half the default model's GGUF, in one 64 MiB
send to a GPU machine; the shipped weights, kept out of that tree, are in git's history (listed
in MANIFEST.json) and scripts/restore_weights.py writes them back, or says what to do."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdraft.drafters.common import shipped
from specdraft.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "restore_weights.py"
WEIGHTS = ROOT / "src" / "specdraft" / "drafters" / "weights"
MANIFEST = json.loads((WEIGHTS / "MANIFEST.json").read_text())["files"]
MiB = 1 << 20


def git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)


def in_git() -> bool:
    try:
        return git("rev-parse", "--git-dir").returncode == 0
    except FileNotFoundError:
        return False


needs_git = pytest.mark.skipif(not in_git(), reason="not a git checkout")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def restore(*args: str, script: Path = SCRIPT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@needs_git
def test_the_tracked_tree_fits_beside_half_a_gguf_in_one_send():
    files = [ROOT / f for f in git("ls-files", "-z").stdout.split("\0") if f]
    size = sum(f.stat().st_size for f in files if f.is_file())
    big = sorted(((f.stat().st_size, str(f.relative_to(ROOT))) for f in files if f.is_file()), reverse=True)[:5]
    assert size < 14 * MiB, f"tracked files take {size / MiB:.1f} MiB; the largest: {big}"


@needs_git
def test_no_weights_file_is_tracked_and_every_shipped_folder_is_in_the_manifest():
    tracked = git("ls-files", str(WEIGHTS)).stdout.split()
    assert not [f for f in tracked if f.endswith((".safetensors", ".pt", ".bin"))]
    listed = {Path(e["path"]).parent.name for e in MANIFEST}
    folders = {p.parent.name for p in WEIGHTS.glob("*/specdraft_*.json")}
    assert folders and folders == listed


@needs_git
@pytest.mark.parametrize("entry", MANIFEST, ids=[e["path"] for e in MANIFEST])
def test_every_manifest_blob_is_in_the_repository(entry):
    """A history rewrite (or a shallow clone) that loses a shipped file fails here."""
    assert git("cat-file", "-t", entry["blob"]).stdout.strip() == "blob", (
        f"git has no blob {entry['blob']} ({entry['path']}); in a shallow clone run `git fetch --unshallow`")
    assert int(git("cat-file", "-s", entry["blob"]).stdout) == entry["size"]
    path = (WEIGHTS / entry["path"]).relative_to(ROOT).as_posix()
    assert git("rev-parse", f"{entry['commit']}:{path}").stdout.strip() == entry["blob"]
    assert git("merge-base", "--is-ancestor", entry["commit"], "HEAD").returncode == 0, "the commit left main's history"


@needs_git
def test_restore_writes_missing_and_damaged_files_and_leaves_right_ones(tmp_path):
    done = restore("--target", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("restored") == len(MANIFEST)
    for entry in MANIFEST:
        assert sha256(tmp_path / entry["path"]) == entry["sha256"]
    first, second = (tmp_path / e["path"] for e in MANIFEST[:2])
    first.unlink()
    second.write_bytes(second.read_bytes()[:1000])  # truncated
    untouched = tmp_path / MANIFEST[-1]["path"]
    mtime = untouched.stat().st_mtime_ns
    assert restore("--check", "--target", str(tmp_path)).returncode == 1
    done = restore("--target", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("restored") == 2
    assert sha256(first) == MANIFEST[0]["sha256"] and sha256(second) == MANIFEST[1]["sha256"]
    assert untouched.stat().st_mtime_ns == mtime
    done = restore("--target", str(tmp_path))
    assert "all 5 files present" in done.stdout and not list(tmp_path.glob("*/.*"))  # no temporary files left


def copy_script(into: Path) -> Path:
    """The script and the manifest, laid out as in a checkout under ``into``."""
    (into / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, into / "scripts")
    weights = into / "src" / "specdraft" / "drafters" / "weights"
    weights.mkdir(parents=True)
    shutil.copy(WEIGHTS / "MANIFEST.json", weights)
    return into / "scripts" / SCRIPT.name


def test_restore_outside_a_git_checkout_says_what_to_do(tmp_path):
    script = copy_script(tmp_path / "copy")
    done = restore(script=script, env={"GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert done.returncode == 1
    assert "not a git checkout" in done.stderr and "full clone" in done.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
@pytest.mark.parametrize("shallow", [True, False])
def test_restore_in_a_clone_without_the_history_says_what_to_fetch(tmp_path, shallow):
    origin, clone = tmp_path / "origin", tmp_path / "clone"
    ident = ["-c", "user.name=t", "-c", "user.email=t@t"]
    assert git("init", "-q", str(origin), cwd=tmp_path).returncode == 0
    for n in range(2):
        (origin / "f").write_text(str(n))
        git("add", "f", cwd=origin)
        assert git(*ident, "commit", "-qm", str(n), cwd=origin).returncode == 0
    depth = ["--depth", "1"] if shallow else []
    assert git("clone", "-q", *depth, f"file://{origin}", str(clone), cwd=tmp_path).returncode == 0
    script = copy_script(clone)
    done = restore(script=script)
    assert done.returncode == 1
    assert ("git fetch --unshallow" in done.stderr) == shallow
    assert ("git fetch origin main" in done.stderr) != shallow


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_shipped_drafter_without_its_weights_says_how_to_restore_them(tmp_path, monkeypatch, damage):
    entry = next(e for e in MANIFEST if "medusa" in e["path"])
    folder = tmp_path / Path(entry["path"]).parent
    folder.mkdir()
    shutil.copy(WEIGHTS / "MANIFEST.json", tmp_path)
    meta = json.loads((WEIGHTS / Path(entry["path"]).parent / "specdraft_heads.json").read_text())
    (folder / "specdraft_heads.json").write_text(json.dumps(meta))
    if damage == "truncated":
        (folder / Path(entry["path"]).name).write_bytes(b"\0" * 100)
    monkeypatch.setattr(shipped, "SHIPPED", tmp_path)
    monkeypatch.setattr("specdraft.drafters.common.compact_draft.target_fingerprint", lambda w: meta["target_fingerprint"])
    target = SimpleNamespace(embeddings=SimpleNamespace(weight=None))
    with pytest.raises(ConfigError, match=r"restore_weights\.py.*install\.sh") as error:
        shipped.find_shipped(target, "specdraft_heads.json", kind="medusa")
    assert ("is missing" if damage == "missing" else "incomplete (100 of") in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None, reason="no bash or coreutils")
def test_gpu_setup_gathers_the_weights_carried_over_several_calls(tmp_path):
    """scripts/gpu-setup.sh (.gpu/setup.sh on a GPU machine): each call is a fresh checkout with a
    part of .gpu/; what it carried is kept in the machine's /tmp (here tmp_path/tmp) and put back."""
    medusa, mlp = (next(e for e in MANIFEST if kind in e["path"]) for kind in ("medusa", "mlp-speculator"))

    def call(n: int, carried: dict[str, Path | bytes]) -> str:
        checkout = tmp_path / f"call{n}"
        copy_script(checkout)
        shutil.copytree(WEIGHTS, checkout / "src/specdraft/drafters/weights", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors"))
        (checkout / ".gpu").mkdir()
        shutil.copy(ROOT / "scripts" / "gpu-setup.sh", checkout / ".gpu" / "setup.sh")
        for rel, what in carried.items():
            (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
            (checkout / rel).write_bytes(what) if isinstance(what, bytes) else shutil.copy(what, checkout / rel)
        done = subprocess.run(["bash", ".gpu/setup.sh"], cwd=checkout, capture_output=True, text=True,
                              env={**os.environ, "SPECDRAFT_GPU_TMP": str(tmp_path / "tmp")})
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = call(1, {".gpu/a/m1": b"half", f".gpu/w1/{medusa['path']}": WEIGHTS / medusa["path"]})
    assert "default model: no (halves here: m1)" in out and "shipped weights here: medusa\n" in out
    out = call(2, {".gpu/b/m2": b"not the other half", f".gpu/w2/{mlp['path']}": WEIGHTS / mlp["path"]})
    assert "the halves do not make the GGUF" in out and "default model: no" in out
    assert "shipped weights here: medusa mlp-speculator\n" in out
    assert "eagle3/heads.safetensors: missing" in out
    weights = tmp_path / "call2" / "src/specdraft/drafters/weights"
    assert [sha256(weights / e["path"]) for e in (medusa, mlp)] == [medusa["sha256"], mlp["sha256"]]
