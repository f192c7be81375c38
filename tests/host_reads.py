"""A count of the reads of a tensor's value on the host, shared by ``tests/test_runtime_modes.py`` and
``benchmarks/host_syncs.py`` (where a CPU has no device syncs to count)."""

from __future__ import annotations

from typing import Any

import torch

HOST_READS = (torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__)
"""The calls that read a tensor's value on the host (a GPU tensor's would sync)."""


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the :data:`HOST_READS` made inside the block (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))
