"""What every runner shares: how it describes itself, and the attention kernels it allows on CUDA."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Attention kernels on CUDA. PyTorch prefers cuDNN's attention on Hopper, which builds an execution
#: plan for every new key length: about 1 ms of CPU per layer per pass on an H100 when a cache grows
#: by a token or a few each step (docs/benchmarks.md). These kernels need no plan.
GPU_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_backends(device: torch.device):
    """A context choosing :data:`GPU_ATTENTION` on CUDA (nothing changes on other devices)."""
    return sdpa_kernel(list(GPU_ATTENTION)) if device.type == "cuda" else nullcontext()


class RunnerBase:
    """What every runner says about itself (``model`` is the module it runs), and the defaults of
    :class:`~specdraft.types.TargetRunner`'s interface."""

    implementation = ""
    compiled = False
    quantization: str | None = None
    supports_tree = False
    model: Any

    def close(self) -> None:
        """Nothing to release beyond the runner itself (a sharded runner stops its other ranks)."""

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def info(self) -> dict:
        return {"implementation": self.implementation, "compiled": self.compiled, "quantization": self.quantization,
                "dtype": str(self.dtype).removeprefix("torch.")}
