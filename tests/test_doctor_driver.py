"""`ddpkit doctor`'s CUDA driver check: torch's CUDA (the image's) against
the newest CUDA the host driver supports."""

from __future__ import annotations

import pytest
import torch

from ddpkit.doctor import local
from ddpkit.doctor.results import Status

WHERE = local.Where(0, "testhost")


@pytest.mark.parametrize(
    ("runtime", "driver", "status"),
    [
        ("13.2", "13.2", Status.PASS),
        ("12.8", "13.0", Status.PASS),
        ("13.2", "13.0", Status.WARN),  # minor-version compatibility only
        ("13.2", "12.9", Status.FAIL),  # a major behind: torch sees no GPU
        ("13.2", None, Status.WARN),
    ],
)
def test_driver_against_the_runtime(runtime: str, driver: str | None, status: Status) -> None:
    check = local.check_cuda_driver(WHERE, wants_cuda=True, runtime=runtime, driver=driver)
    assert check.status is status
    if status is not Status.PASS:
        assert check.fix and runtime in check.fix


def test_cpu_runs_and_cpu_builds_skip() -> None:
    assert local.check_cuda_driver(WHERE, wants_cuda=False, runtime="13.2", driver=None).status is Status.SKIP
    assert local.check_cuda_driver(WHERE, wants_cuda=True, runtime=None, driver="13.2").status is Status.SKIP


def test_the_driver_version_reads_as_major_minor_or_none() -> None:
    got = local.driver_cuda_version()
    assert got is None or (got.count(".") == 1 and all(p.isdigit() for p in got.split(".")))


@pytest.mark.gpu
def test_a_working_gpu_has_a_driver_new_enough() -> None:
    driver = local.driver_cuda_version()
    assert driver is not None
    check = local.check_cuda_driver(WHERE, wants_cuda=True, runtime=torch.version.cuda, driver=driver)
    assert check.status in (Status.PASS, Status.WARN)
