"""Reading a weights file (safetensors, or a PyTorch file of tensors), with one-line errors."""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError
from ...files import weights_problem


def load_weights(path: str | Path) -> dict:
    """The tensors of ``path``: a ``.safetensors`` file, else a PyTorch file read with
    ``torch.load(weights_only=True)`` (never arbitrary pickles). A truncated, corrupt or refused
    file is a ConfigError naming it, in one line."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path)
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_problem says which are the file's fault
        problem = weights_problem(exc)
        if problem is None:
            raise
        raise ConfigError(f"{path} {problem}") from None


__all__ = ["load_weights"]
