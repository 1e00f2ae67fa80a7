"""Balanced DataParallel (transformer-XL, via the source documents): device 0
also gathers outputs and holds the optimizer, so it gets a smaller share of
each batch (`--gpu0-batch`) and the rest is split evenly over the others."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import DataParallel
from torch.nn.parallel._functions import Scatter


def chunk_sizes(batch: int, gpu0: int, devices: int) -> list[int]:
    """Per-device batch sizes: `gpu0` on device 0, the remainder spread evenly
    (earlier devices take the odd samples). Sums to `batch`."""
    if devices < 1 or not 0 <= gpu0 <= batch:
        raise ValueError(f"cannot split a batch of {batch} with {gpu0} on device 0 over {devices} devices")
    if devices == 1:
        return [batch]
    rest = batch - gpu0
    even, odd = divmod(rest, devices - 1)
    return [gpu0] + [even + (1 if i < odd else 0) for i in range(devices - 1)]


class BalancedDataParallel(DataParallel[torch.nn.Module]):
    """DataParallel over one input tensor with an uneven split along dim 0."""

    def __init__(self, gpu0_batch: int, module: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self.gpu0_batch = gpu0_batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor  # what the model returns (a Module's call and DataParallel.gather are typed Any)
        if not self.device_ids:  # no CUDA: DataParallel runs the module as is
            out = self.module(x)
            return out
        sizes = chunk_sizes(x.size(self.dim), min(self.gpu0_batch, x.size(self.dim)), len(self.device_ids))
        used = [(d, s) for d, s in zip(self.device_ids, sizes) if s > 0]
        devices, sizes = [d for d, _ in used], [s for _, s in used]
        chunks = Scatter.apply(devices, sizes, self.dim, x)
        if len(devices) == 1:
            out = self.module(chunks[0]) if devices[0] == self.device_ids[0] else \
                self.replicate(self.module, devices)[0](chunks[0]).to(self.output_device)
            return out
        replicas = self.replicate(self.module, devices)
        outputs = self.parallel_apply(replicas, [(c,) for c in chunks], [{} for _ in chunks])
        out = self.gather(outputs, self.output_device)
        return out
