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


def load_strict(module, state: dict, where: Path) -> None:
    """Load ``state`` into ``module`` (cast to its dtypes), or one ConfigError line naming the
    missing, unexpected and misshapen tensors of ``where``."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        details = [f"missing {missing[:4]}" if missing else "", f"unexpected {unexpected[:4]}" if unexpected else "",
                   "shapes differ for " + ", ".join(f"{k} ({tuple(state[k].shape)} vs {tuple(own[k].shape)})"
                                                    for k in wrong[:3]) if wrong else ""]
        raise ConfigError(f"the weights in {where} do not fit the heads they describe (or this target): "
                          + "; ".join(d for d in details if d))
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


__all__ = ["load_strict", "load_weights"]
