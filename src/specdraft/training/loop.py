"""One training loop for every learnt drafter: AdamW, warm-up + cosine, resumable checkpoints,
a progress bar, and a loss plot."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from ..models import TRAIN_DTYPES


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
    from ..errors import ConfigError

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


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


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
) -> list[float]:
    """Minimise ``loss_fn(step)`` over ``params``; resumes from ``out_dir/checkpoint`` if present.

    ``autocast`` (a dtype, or None for none): ``loss_fn`` runs under ``torch.autocast`` with
    it, on the device of the parameters; the parameters and optimizer stay in their dtype.

    Returns the loss of every step (resumed steps included). Writes ``losses.json`` and, when
    matplotlib is installed, ``loss.png`` into ``out_dir``.
    """
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    ckpt = out_dir / "checkpoint"
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps, warmup))
    losses: list[float] = []
    start = 0
    if (ckpt / "progress.json").is_file():
        state = load_file(ckpt / "params.safetensors")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
        saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        info = json.loads((ckpt / "progress.json").read_text())
        start, losses = info["step"], info["losses"]

    def checkpoint(step: int) -> None:
        ckpt.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous().cpu() for n, p in params.items()}, ckpt / "params.safetensors")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, ckpt / "optimizer.pt")
        (ckpt / "progress.json").write_text(json.dumps({"step": step, "losses": losses}))

    bar = tqdm(total=steps, initial=start, disable=not progress, desc=desc, unit="step")
    began = time.perf_counter()
    device_type = next(iter(params.values())).device.type if params else "cpu"
    for step in range(start, steps):
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        bar.update()
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            checkpoint(step + 1)
    bar.close()
    (out_dir / "losses.json").write_text(json.dumps({"losses": losses, "seconds_this_run": time.perf_counter() - began}))
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
