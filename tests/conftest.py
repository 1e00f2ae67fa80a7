"""Suite-wide hooks: tests marked `gpu` need a CUDA device and are skipped,
with a one-line reason, on a machine without one."""

from __future__ import annotations

import pytest

GPU_SKIP_REASON = "needs a CUDA GPU (none here)"


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)
