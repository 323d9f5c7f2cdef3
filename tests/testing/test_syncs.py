"""HostSyncs, which the host-copy test of every drafter's round relies on, counts every kind of copy."""

from __future__ import annotations

import torch

from specdraft.testing.syncs import HostSyncs
from specdraft.verifier.proposal import _width_on_cpu


def test_every_kind_of_read_is_counted_inside_inference_mode_too():
    """The engine's passes run under inference mode, where the dispatcher hands no Python mode
    ``int()``'s or ``bool()``'s read: each is counted at the tensor method instead."""
    t = torch.tensor([3, 4])
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            x = t + 1
            with HostSyncs() as syncs:
                int(x[0]), bool(x[1] > 2), float(x[0]), x[1].item(), x.tolist(), x[: x[0]], x.cpu()
        assert syncs.count == 7, (mode.__name__, dict(syncs.where))


def test_reads_made_on_a_cpu_only_are_not_counted():
    with HostSyncs() as syncs:
        width = _width_on_cpu(torch.tensor([1, 3]), 5)
    assert width == 3 and syncs.count == 0
