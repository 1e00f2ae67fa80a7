"""The CUDA image installs the torch ddpkit is tested with: the version record
(the ARG block at the top of docker/Dockerfile) names the versions that
constraints.txt pins for `make install` and that this venv holds, and the
image's base and index carry the same CUDA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torchvision

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
ARG = re.compile(r"^ARG (\w+)=(\S*)$")
PIN = re.compile(r"^(torch|torchvision)==(\S+)$")


def record() -> dict[str, str]:
    """The ARG defaults declared before the first FROM: the tested versions."""
    out: dict[str, str] = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("FROM "):
            break
        match = ARG.match(line)
        if match:
            out[match[1]] = match[2]
    return out


def major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def test_the_record_names_every_version() -> None:
    assert set(record()) >= {"TORCH_VERSION", "TORCHVISION_VERSION", "CUDA_VERSION", "NCCL_VERSION",
                             "TORCH_INDEX_URL", "BASE_IMAGE"}


def pins() -> dict[str, str]:
    """What constraints.txt pins for `make install`: {"torch": "2.14.1", ...}."""
    lines = (REPO / "constraints.txt").read_text().splitlines()
    return {m[1]: m[2] for m in map(PIN.match, lines) if m}


def test_the_image_torch_is_the_tested_torch() -> None:
    rec = record()
    assert pins() == {"torch": rec["TORCH_VERSION"], "torchvision": rec["TORCHVISION_VERSION"]}
    assert major_minor(rec["TORCH_VERSION"]) == major_minor(torch.__version__)
    assert major_minor(rec["TORCHVISION_VERSION"]) == major_minor(torchvision.__version__)


def test_base_and_index_carry_the_recorded_cuda() -> None:
    rec = record()
    cuda = rec["CUDA_VERSION"]
    assert re.match(rf"^nvidia/cuda:{re.escape(cuda)}\.\d+-(cudnn-)?runtime-", rec["BASE_IMAGE"]), rec["BASE_IMAGE"]
    assert rec["TORCH_INDEX_URL"].endswith("/cu" + cuda.replace(".", ""))


@pytest.mark.skipif(torch.version.cuda is None, reason="this venv's torch is a CPU build: no CUDA/NCCL to compare")
def test_recorded_cuda_and_nccl_are_the_venvs() -> None:
    rec = record()
    assert rec["CUDA_VERSION"] == torch.version.cuda
    assert rec["NCCL_VERSION"] == ".".join(map(str, torch.cuda.nccl.version()))


def test_the_runtime_stage_installs_and_checks_the_record() -> None:
    text = DOCKERFILE.read_text()
    assert 'ARG TORCH_PACKAGES="torch==${TORCH_VERSION} torchvision==${TORCHVISION_VERSION}"' in text
    assert "want = ('${TORCH_VERSION}', '${CUDA_VERSION}', '${NCCL_VERSION}')" in text
    # no other pinned torch base may creep back in
    assert "pytorch/pytorch:" not in text
