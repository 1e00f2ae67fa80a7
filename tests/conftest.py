"""Suite-wide hooks: tests marked `gpu` need a CUDA device and are skipped,
with a one-line reason, on a machine without one; and no test leaks
environment variables into the ones after it."""

from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Code under test sets variables in-process on purpose (netif pins
    NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, start-up sets MASTER_ADDR), and
    monkeypatch.delenv of an unset name records nothing to undo. A leaked
    `NCCL_SOCKET_IFNAME=lo` reached later Slurm jobs (sbatch exports the
    submitter's environment) and failed them in a full run only: restore the
    whole environment after every test."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
