"""One training loop for every learnt drafter: AdamW, warm-up + cosine, resumable checkpoints,
a progress bar, and a loss plot."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..models import TRAIN_DTYPES
from .io import DamagedFileError, changes, key_of, say, write_atomic

#: the checkpoint of a training run, in its ``out_dir``: parameters, optimizer state, step,
#: losses and the key of the settings, in one file written atomically
CHECKPOINT = "checkpoint.safetensors"


def _has_bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (Intel AMX), per /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


def autocast_dtype(choice: str, device) -> torch.dtype | None:
    """The autocast dtype of training steps for ``choice`` (one of :data:`TRAIN_DTYPES`), or None.

    "auto" is bfloat16 where matrix units make it fast (a CUDA GPU that supports it, a CPU
    with AMX: there a head's training step takes half the time) and float32 elsewhere, where
    bfloat16 autocast is slower than float32 on a CPU without them.
    """
    if choice not in TRAIN_DTYPES:
        raise ConfigError(f"unknown training dtype {choice!r}; use one of {', '.join(TRAIN_DTYPES)}")
    if choice == "float32":
        return None
    if choice == "bfloat16":
        return torch.bfloat16
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if device.type == "cpu" and _has_bf16_matrix_units() else None


def check_lr(lr) -> None:
    """``lr`` must be a finite number > 0 (the CLI's ``--lr`` is checked with this too)."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"lr must be a finite number > 0, not {lr!r}")


@functools.lru_cache(maxsize=4)
def _permutation(count: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(count))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    return tuple(order)


def batch_indices(step: int, batch_size: int, count: int, seed: int) -> list[int]:
    """The items of step ``step``'s batch: epochs of ``count`` items, each in its own seeded order.

    A function of its arguments alone, so that a resumed run draws the batches an
    uninterrupted one would have.
    """
    if count < 1:
        raise ConfigError("no training examples: nothing to train on")
    return [_permutation(count, seed, k // count)[k % count]
            for k in range(step * batch_size, (step + 1) * batch_size)]


def step_generator(seed: int, step: int, device="cpu") -> torch.Generator:
    """A random generator for step ``step`` alone (noise, sampled examples), for the same reason."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + step)


@contextlib.contextmanager
def seeded(seed: int):
    """Run the block (fresh weights' random init) with torch's CPU generator seeded, then restore it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of named tensors (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, info)`` of a checkpoint; :class:`DamagedFileError` when it cannot be trusted."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            record = (f.metadata() or {}).get("specdraft")
            if record is None:
                raise ValueError("it holds no record of a specdraft training run")
            info = json.loads(record)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if not {"key", "inputs", "step", "losses", "digest"} <= set(info):
            raise ValueError("its record of the run is incomplete")
        if not isinstance(info["step"], int) or len(info["losses"]) != info["step"]:
            raise ValueError("its step and loss history disagree")
        if weights_digest(tensors) != info["digest"]:
            raise ValueError("its contents do not match their checksum")
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises, the file is not usable
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DamagedFileError(f"checkpoint {path} is damaged ({why}); delete it to train from step 0 "
                               "(or restore it from a backup)") from None
    return tensors, info


def train(
    params: dict[str, torch.nn.Parameter],
    loss_fn: Callable[[int], torch.Tensor],
    steps: int,
    out_dir: str | Path,
    lr: float = 3e-4,
    warmup: int = 20,
    checkpoint_every: int = 50,
    progress: bool = True,
    desc: str = "train",
    autocast: torch.dtype | None = None,
    settings: dict | None = None,
) -> list[float]:
    """Minimise ``loss_fn(step)`` over ``params``; resumes from ``out_dir/checkpoint.safetensors``.

    The checkpoint is resumed only when it was made from the same initial weights, loop
    settings and ``settings`` (JSON-able: what the caller's loss depends on, e.g. its data's
    key, batch size, seed); otherwise training starts over, and says why. A checkpoint that
    cannot be read raises :class:`~.io.DamagedFileError`. ``loss_fn`` must depend on its
    step alone (see :func:`batch_indices`, :func:`step_generator`), so that a resumed run
    ends exactly where an uninterrupted one does.

    ``autocast`` (a dtype, or None for none): ``loss_fn`` runs under ``torch.autocast`` with
    it, on the device of the parameters; the parameters and optimizer stay in their dtype.

    Returns the loss of every step (resumed steps included). Writes ``losses.json`` and, when
    matplotlib is installed, ``loss.png`` into ``out_dir``.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    check_lr(lr)
    out_dir = Path(out_dir)
    path = out_dir / CHECKPOINT
    inputs = {**(settings or {}), "steps": steps, "lr": lr, "warmup": warmup, "autocast": str(autocast),
              "initial_weights": weights_digest({n: p for n, p in params.items()})[:16]}
    key = key_of(inputs)
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    names = list(params)
    losses: list[float] = []
    start = 0
    if path.is_file():
        tensors, info = _load_checkpoint(path)
        if info["key"] != key:
            say(f"training settings changed ({changes(info['inputs'], inputs)}): not resuming from {path}, "
                "training from step 0", progress)
        else:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(tensors[f"param.{n}"])
            state = {i: {k.removeprefix(f"optim.{n}."): v for k, v in tensors.items() if k.startswith(f"optim.{n}.")}
                     for i, n in enumerate(names)}
            optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s},
                                       "param_groups": optimizer.state_dict()["param_groups"]})
            start, losses = info["step"], info["losses"]
            say(f"resuming from step {start} of {steps} (key {key}) from {path}", progress)
    elif (out_dir / "checkpoint" / "progress.json").is_file():
        say(f"ignoring {out_dir / 'checkpoint'}: an older specdraft's checkpoint, which does not record what it "
            "was trained on; training from step 0", progress)

    def checkpoint(step: int) -> None:
        tensors = {f"param.{n}": p.detach().cpu().contiguous() for n, p in params.items()}
        state = optimizer.state_dict()["state"]
        for i, n in enumerate(names):
            for k, v in state.get(i, {}).items():
                tensors[f"optim.{n}.{k}"] = v.detach().cpu().contiguous()
        info = {"key": key, "inputs": inputs, "step": step, "losses": losses, "digest": weights_digest(tensors)}
        write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata={"specdraft": json.dumps(info)}))

    bar = tqdm(total=steps, initial=start, disable=not progress, desc=desc, unit="step")
    began = time.perf_counter()
    device_type = next(iter(params.values())).device.type if params else "cpu"
    for step in range(start, steps):
        for group in optimizer.param_groups:  # a function of the step: nothing to restore on resuming
            group["lr"] = lr * _lr_factor(step, steps, warmup)
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.update()
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            checkpoint(step + 1)
    bar.close()
    write_atomic(out_dir / "losses.json",
                 json.dumps({"losses": losses, "seconds_this_run": time.perf_counter() - began}))
    _plot(losses, out_dir / "loss.png", desc)
    return losses


def _plot(losses: list[float], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, linewidth=0.8)
    window = max(1, len(losses) // 30)
    smooth = [sum(losses[max(0, i - window):i + 1]) / len(losses[max(0, i - window):i + 1]) for i in range(len(losses))]
    ax.plot(smooth, linewidth=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
