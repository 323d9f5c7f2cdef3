"""Checkpoints: a run killed or crashed mid-write resumes to the weights of an uninterrupted
one, the same seed and inputs give the same weights, and a damaged checkpoint is one line."""

from __future__ import annotations

import runpy
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

from specdraft.cli import main
from specdraft.training import loop
from specdraft.training.io import DamagedFileError

TOY = '''
"""A toy run whose batches and noise depend on the step alone. As a script, it stops in the
middle of writing its second checkpoint and waits there to be killed."""
import sys

import torch

from specdraft.training import loop


def toy_run(out_dir, steps=6):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4))
    data = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))

    def loss_fn(step):
        x = data[loop.batch_indices(step, 3, len(data), seed=0)]
        noise = torch.randn(3, 4, generator=loop.step_generator(0, step))
        return ((x @ w - x.flip(1) - noise) ** 2).mean()

    losses = loop.train({"w": w}, loss_fn, steps, out_dir, lr=0.05, warmup=2, checkpoint_every=2, progress=False,
                        settings={"toy": 1})
    return w.detach().clone(), losses


if __name__ == "__main__":
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def half_then_wait(tensors, path, metadata=None):
        calls.append(path)
        real(tensors, path, metadata=metadata)
        if len(calls) == 2:
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
            print("writing", flush=True)
            sys.stdin.readline()  # the parent kills us here

    safetensors.torch.save_file = half_then_wait
    toy_run(sys.argv[1])
'''


@pytest.fixture
def toy(tmp_path):
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    return script, runpy.run_path(str(script))["toy_run"]


def _step_of(folder: Path) -> int:
    return loop._load_checkpoint(folder / loop.CHECKPOINT)[1]["step"]


def test_a_run_killed_by_sigterm_while_writing_a_checkpoint_resumes_to_the_same_weights(tmp_path, toy):
    script, toy_run = toy
    w_ref, losses_ref = toy_run(tmp_path / "ref")
    out = tmp_path / "killed"
    child = subprocess.Popen([sys.executable, str(script), str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "writing\n", child.stderr.read()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=120) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    assert list(out.glob(f".{loop.CHECKPOINT}.*.tmp"))  # it died with the new checkpoint half written...
    assert _step_of(out) == 2  # ...and the one before it untouched
    w, losses = toy_run(out)
    assert torch.equal(w, w_ref) and losses == losses_ref


def test_a_crash_in_the_middle_of_a_write_keeps_the_last_checkpoint_and_resumes_exactly(tmp_path, toy, monkeypatch):
    _, toy_run = toy
    w_ref, losses_ref = toy_run(tmp_path / "ref")
    real, calls = safetensors.torch.save_file, []

    def half_then_fail(tensors, path, metadata=None):
        calls.append(path)
        real(tensors, path, metadata=metadata)
        if len(calls) == 2:
            Path(path).write_bytes(Path(path).read_bytes()[:100])
            raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    out = tmp_path / "crashed"
    with pytest.raises(OSError, match="No space left"):
        toy_run(out)
    monkeypatch.undo()
    assert _step_of(out) == 2 and not list(out.glob(".*.tmp"))  # the torn file was removed
    w, losses = toy_run(out)
    assert torch.equal(w, w_ref) and losses == losses_ref


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "flipped byte"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_what_to_do(tmp_path, toy, damage):
    _, toy_run = toy
    toy_run(tmp_path, steps=2)
    path = tmp_path / loop.CHECKPOINT
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\x00not a checkpoint",
                      "flipped byte": data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]}[damage])
    with pytest.raises(DamagedFileError) as err:
        toy_run(tmp_path, steps=2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {path} is damaged (") and message.endswith(
        "); delete it to train from step 0 (or restore it from a backup)")
    if damage == "flipped byte":  # the file reads fine: only the checksum tells
        assert "do not match their checksum" in message


def test_the_cli_reports_a_damaged_checkpoint_in_one_line(tmp_path, qa_file, tiny_target_dir, capsys):
    checkpoint = tmp_path / "work" / "medusa" / loop.CHECKPOINT
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"\x00" * 10)
    code = main(["train-heads", "--kind", "medusa", "--target", str(tiny_target_dir), "--output", str(tmp_path / "out"),
                 "--work", str(tmp_path / "work"), "--prompts", str(qa_file), "--num-prompts", "2", "--num-texts", "2",
                 "--max-new-tokens", "2", "--steps", "2", "--batch-size", "2", "--head-tokens", "64",
                 "--gate-steps", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if "error" in line]
    assert line.startswith(f"specdraft: error: checkpoint {checkpoint} is damaged (") and line.endswith(
        "); delete it to train from step 0 (or restore it from a backup)")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_train_heads_is_reproducible_and_resumes_exactly_after_a_crash(tmp_path, qa_file, smol_tokenizer,
                                                                      tiny_target, monkeypatch, kind):
    """EAGLE (its input noise), EAGLE-3 (its draft vocabulary, warm start and unrolled steps), the
    copy gate (its sampled examples), fresh weights: two runs with the same seed are bit-identical,
    and so is one that crashed mid-checkpoint and resumed."""
    from specdraft.drafters.heads.formats import FORMAT_FILE
    from specdraft.training import heads

    monkeypatch.setattr(heads, "train", partial(loop.train, checkpoint_every=2))

    def run(name: str):
        return heads.train_heads(tiny_target, smol_tokenizer, "tiny", kind, [qa_file], tmp_path / name,
                                 num_texts=4, num_prompts=4, max_new_tokens=6, steps=6, batch_size=2, head_tokens=64,
                                 gate_steps=3, progress=False, work_dir=tmp_path / f"{name}-work")

    def state(name: str) -> dict[str, torch.Tensor]:
        return {f"{part}/{k}": v for part in (kind, f"{kind}-copy-gate")
                for k, v in load_file(tmp_path / f"{name}-work" / part / loop.CHECKPOINT).items()}

    run("a")
    run("b")
    a, b = state("a"), state("b")
    assert a.keys() == b.keys() and any(k.startswith(f"{kind}-copy-gate/optim.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert (tmp_path / "a" / "heads.safetensors").read_bytes() == (tmp_path / "b" / "heads.safetensors").read_bytes()

    cached = ["sequences.json", *(p.name for p in (tmp_path / "a-work").glob("*_states*.safetensors"))]
    assert len(cached) == 3 and all(("_layers_" in n) == (kind == "eagle3") for n in cached[1:])  # eagle3's own
    for name in cached:  # reused as they are
        (tmp_path / "c-work").mkdir(exist_ok=True)
        shutil.copy(tmp_path / "a-work" / name, tmp_path / "c-work" / name)
    real, eagle_writes = safetensors.torch.save_file, []

    def crash_on_second_eagle_checkpoint(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        if Path(path).parent.name == kind and Path(path).name.startswith(f".{loop.CHECKPOINT}"):
            eagle_writes.append(path)
            if len(eagle_writes) == 2:
                Path(path).write_bytes(Path(path).read_bytes()[:64])
                raise RuntimeError("simulated crash")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", crash_on_second_eagle_checkpoint)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run("c")
    assert _step_of(tmp_path / "c-work" / kind) == 2
    run("c")
    c = state("c")
    assert [k for k in a if not torch.equal(a[k], c[k])] == []
    assert (tmp_path / "c" / FORMAT_FILE).is_file()
