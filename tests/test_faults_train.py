"""Start-up faults of `ddpkit train` on real torchrun/gloo processes: each
row breaks one thing on one "node" (a torchrun
agent with its own working directory) and checks that the whole job ends
within seconds with a one-line cause and fix naming the host and the path,
its own exit code, no traceback from ddpkit, and no process left."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import TINY, processes_in, torchrun

pytestmark = pytest.mark.slow

DIST_TIMEOUT_S = 600  # a collective timeout is never what ends these jobs
# The fault ends the job, not that timeout: well within a third of it, however loaded the machine
# (on an idle one, 10-20 s; CI's 2 cores shared with two other workers took 87 s once).
ENDS_WITHIN_S = DIST_TIMEOUT_S / 3
BASE = [*TINY, "--synthetic-size", "32", "--batch-size", "4", "--no-eval", "--device", "cpu",
        "--dist-timeout", str(DIST_TIMEOUT_S)]


def write_imagefolder(root: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (8, 8), (i * 40, 0, 0) if label == "a" else (0, i * 40, 0)).save(folder / f"{i}.png")


@dataclass(frozen=True)
class Fault:
    """One row: how to break node `broken`, the flags, and what must come out."""

    name: str
    setup: Callable[[Path, Path], list[list[str]] | None]  # (node0, node1) -> per-node command prefixes
    args: list[str]
    code: ExitCode
    message: str  # a regex the one-line message matches
    broken: int   # the node whose host the message names


def readonly_checkpoint_dir(node0: Path, node1: Path) -> list[list[str]] | None:
    """node 0 (rank 0, the writer) sees ro/ read-only: a read-only bind mount in its
    own mount namespace when we are root (root ignores permission bits), else mode 555."""
    for node in (node0, node1):
        (node / "ro").mkdir()
    if os.geteuid() != 0:
        (node0 / "ro").chmod(0o555)
        return None
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a read-only directory as root")
    remount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    return [["unshare", "-m", "sh", "-c", remount, str(node0 / "ro")], []]


def data_on_node0_only(node0: Path, node1: Path) -> None:
    write_imagefolder(node0 / "data")  # node1 has no data/ at all


FAULTS = [
    Fault("checkpoint dir not writable", readonly_checkpoint_dir, ["--checkpoint-dir", "ro/ckpt"],
          ExitCode.CHECKPOINT_DIR,
          r"--checkpoint-dir ro/ckpt is not writable on host testhost-node0 \(rank 0\): "
          r"(Read-only file system|Permission denied).*make it writable by the job's user, or choose another "
          r"--checkpoint-dir", broken=0),
    Fault("dataset directory missing on one node", data_on_node0_only,
          ["--data", "imagefolder", "--data-dir", "data"], ExitCode.DATA_MISSING,
          r"--data imagefolder --data-dir data is missing on host testhost-node1 \(rank 1\): data: no such "
          r"directory; put the dataset at the same path on every node", broken=1),
]


# the read-only row mounts in a private mount namespace as root: marked `root` (run it under the infra lock)
ROWS = [pytest.param(f, id=f.name, marks=[pytest.mark.root] if f.code is ExitCode.CHECKPOINT_DIR else [])
        for f in FAULTS]


@pytest.mark.parametrize("fault", ROWS)
def test_start_up_fault_ends_the_job_within_seconds(tmp_path: Path, fault: Fault) -> None:
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    prefixes = fault.setup(node0, node1)
    started = time.monotonic()
    job = torchrun(tmp_path, 2, 1, [*BASE, *fault.args], tag="fault", cwds=[node0, node1], prefixes=prefixes)
    codes = job.wait(timeout=ENDS_WITHIN_S)
    elapsed = time.monotonic() - started
    out = job.output()
    assert codes[0] != 0 and codes[1] != 0, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("ddpkit train: ")]
    assert lines and all(re.search(fault.message, ln) for ln in lines), out[-4000:]
    # both ranks exit with the fault's code (torchrun's report of each worker)
    assert len(re.findall(rf"exitcode\s+:\s*{int(fault.code)}\b", out)) == 2, out[-3000:]
    # no traceback from the workers (torchrun's agent prints its own ChildFailedError one)
    assert "src/ddpkit/" not in out and out.count("Traceback") == out.count("ChildFailedError:")
    assert elapsed < ENDS_WITHIN_S, f"took {elapsed:.1f}s"
    assert processes_in(tmp_path) == []
