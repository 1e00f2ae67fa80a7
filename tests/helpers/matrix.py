"""The targets matrix's one spec, its promise, and the records every target
leaves for the others (docs/TESTING.md).

The matrix is three test modules (hosts, Docker, Kubernetes) so that pytest-xdist
can run them on different workers at once; they still compare as one matrix.
Each target's records are checked against the spec's promise, then, under a
file lock, against the records of every target that finished before it, and
kept in the run's folder (`folder()`, named by the pytest run). Whichever of
two targets finishes second compares the pair, so every pair is compared once
whatever the order or the worker. conftest prints the table of targets covered
at the end of the run and fails the run when only part of the matrix ran
(`missing_targets`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from filelock import FileLock

from ddpkit.launch.local import free_port
from tests.helpers.rank_records import Difference, Promise, differences, records, table
from tests.infra import netns
from tests.infra.docker_daemon import RUN_VAR

PYTHON = sys.executable
DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
NODES, NPROC = 3, 2
NODE_NAMES = [f"node{i + 1}" for i in range(NODES)]
# Quotes of both kinds, command substitution of both forms, a newline, a tab,
# variables in both forms and a literal `$$`: each would change if any shell,
# YAML file, compose file or kubelet on the way expanded or re-quoted it.
HOSTILE = "it's \"q\" $(echo INJECTED) `echo TICK` $HOME ${HOME} $$ \\n\nsecond\tline '\"'"
TRAIN_ARGS = ["--model=tiny", "--data=synthetic", "--image-size=16", "--synthetic-size=48", "--batch-size=4",
              "--max-steps=1", "--workers=0", "--no-eval", "--progress=plain",
              "--rank-report-json=-", "--rank-report-env=HOSTILE"]
TIMEOUT_S = 420
IN_IMAGE = {"command.python": "python3"}  # the image's interpreter; ddpkit is installed there

# Every target, and the test that runs it: the closing check of the run (conftest)
# knows by these names which targets ran.
TARGET_TESTS = {
    "launch local": "tests/test_targets_matrix.py::test_launch_local",
    "launch ssh": "tests/test_targets_matrix.py::test_launch_ssh",
    "launch.sh": "tests/test_targets_matrix.py::test_rendered_ssh_launcher",
    "slurm torchrun": "tests/test_targets_matrix.py::test_slurm[torchrun]",
    "slurm srun": "tests/test_targets_matrix.py::test_slurm[srun]",
    "docker compose": "tests/test_targets_matrix_docker.py::test_docker_compose",
    "launch docker": "tests/test_targets_matrix_docker.py::test_launch_docker",
    "k8s pytorchjob": "tests/test_targets_matrix_k8s.py::test_kubernetes_emulated[pytorchjob]",
    "k8s indexed-job": "tests/test_targets_matrix_k8s.py::test_kubernetes_emulated[indexed-job]",
    "k8s trainjob": "tests/test_targets_matrix_k8s.py::test_kubernetes_emulated[trainjob]",
    "k8s jobset": "tests/test_targets_matrix_k8s.py::test_kubernetes_emulated[jobset]",
}
TARGETS = list(TARGET_TESTS)


def folder() -> Path:
    """This pytest run's matrix folder, the same in every xdist worker."""
    path = Path(tempfile.gettempdir()) / f"ddpkit-matrix-{os.environ[RUN_VAR]}"
    path.mkdir(exist_ok=True)
    return path


def _lock() -> FileLock:
    return FileLock(str(folder() / "lock"))


def master_port() -> int:
    """One port for every target of the run, whichever worker asks first: a
    fixed master_port wins everywhere, and the targets compare it."""
    with _lock():
        path = folder() / "master_port"
        if not path.exists():
            path.write_text(str(free_port()))
        return int(path.read_text())


def spec_dict(workdir: Path, **placement: Any) -> dict[str, Any]:
    """THE spec. `placement` says only where it runs (interpreter, image,
    ssh folders, Slurm mode, Kubernetes kind): nothing any process compares."""
    spec: dict[str, Any] = {
        "name": "targets", "image": "ddpkit:latest", "nodes": NODES, "nproc_per_node": NPROC,
        "device": "cpu", "backend": "gloo", "master_port": master_port(),
        "command": {"python": PYTHON, "args": TRAIN_ARGS}, "env": {"HOSTILE": HOSTILE},
        # The launcher's pre-start checks import torch on every host (about 20 s on a
        # loaded 2-core machine); their limit is connect_timeout_s + 20 s.
        "ssh": {"workdir": str(workdir), "log_dir": str(workdir / "logs"), "grace_s": 3, "connect_timeout_s": 60},
    }
    for key, value in placement.items():
        node = spec
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return spec


def write_spec(workdir: Path, **placement: Any) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(spec_dict(workdir, **placement)))
    return path


def promise(target: str) -> Promise:
    # `launch local` runs every node on this one machine: its processes reach
    # the master (127.0.0.1) over loopback, which `auto` picks there.
    return Promise(nodes=NODES, nproc_per_node=NPROC, master_port=master_port(), backend="gloo", device="cpu",
                   interface="lo" if target == "launch local" else "eth0", env={"HOSTILE": HOSTILE})


def _comparable(record: dict[str, Any], target: str) -> dict[str, Any]:
    """A record without what may differ (hosts, addresses, pids, launcher;
    the interface where `launch local` rightly uses loopback)."""
    left_out = {"host", "address", "pid", "launcher", "master_addr", "torch", "cuda", "nccl", "kind"}
    if target == "launch local":
        left_out |= {"interface", "nccl_socket_ifname", "gloo_socket_ifname"}
    return {k: v for k, v in record.items() if k not in left_out}


def disagreements(target: str, got: list[dict[str, Any]], other: str,
                  theirs: list[dict[str, Any]]) -> list[Difference]:
    """Every compared field in which `target`'s processes differ from `other`'s."""
    out: list[Difference] = []
    for ref, mine in zip(theirs, got, strict=True):
        a, b = _comparable(ref, other), _comparable(mine, target)
        for key in sorted(set(a) & set(b)):
            if a[key] != b[key]:
                out.append(Difference(f"{target} vs {other}", f"rank {mine['rank']} {key}", repr(a[key]),
                                      repr(b[key])))
    return out


def check(target: str, output: str, started: float) -> None:
    """Compare the target's records with the promise and with every target
    kept so far; then keep them for the targets after it."""
    seconds = time.monotonic() - started
    got = records(output)
    diffs = differences(target, got, promise(target))
    assert not diffs, f"{target} broke the contract:\n{table(diffs)}\n--- output tail\n{output[-4000:]}"
    assert "INJECTED" not in output.replace("$(echo INJECTED)", "") and "TICK" not in output.replace(
        "`echo TICK`", ""), f"{target}: a shell ran the hostile value\n{output[-4000:]}"
    with _lock():
        kept = kept_results()
        against = [d for other, (theirs, _) in kept.items() for d in disagreements(target, got, other, theirs)]
        assert not against, f"{target} disagrees with targets run before it:\n{table(against)}"
        _result_path(target).write_text(json.dumps({"target": target, "seconds": seconds, "records": got}))


def _result_path(target: str) -> Path:
    return folder() / f"result-{target.replace(' ', '_').replace('/', '_')}.json"


def kept_results() -> dict[str, tuple[list[dict[str, Any]], float]]:
    """RowKey -> (records, seconds) of every target that has passed so far."""
    out = {}
    for path in sorted(folder().glob("result-*.json")):
        data = json.loads(path.read_text())
        out[data["target"]] = (data["records"], data["seconds"])
    return out


def coverage_table() -> str:
    """The targets covered, as the closing lines of the run print them."""
    kept = kept_results()
    lines = [f"{'target':16} {'processes':>9} {'launcher':10} {'host of node 0':24} {'seconds':>7}"]
    for target in TARGETS:
        if target not in kept:
            lines.append(f"{target:16} {'-':>9} (no records: not selected, skipped or failed)")
            continue
        rows, seconds = kept[target]
        lines.append(f"{target:16} {len(rows):>9} {rows[0]['launcher']:10} {rows[0]['host']:24} {seconds:>7.1f}")
    return "\n".join(lines)


def missing_targets(outcomes: dict[str, tuple[str, bool]]) -> list[str]:
    """Targets whose test did not pass in a run where a real-infrastructure
    target did (`outcomes`: nodeid -> (outcome, marked root)). A run without
    root (every such test skipped) or that selected part of the matrix with
    -k checks only what ran; a run where Docker or Slurm was missing beside
    working targets does not pass as a whole matrix."""
    ran_root = any(outcome == "passed" and root for outcome, root in outcomes.values())
    if not ran_root:
        return []
    return [t for t, nodeid in TARGET_TESTS.items() if outcomes.get(nodeid, ("passed", False))[0] != "passed"]


def remove_folder() -> None:
    if RUN_VAR in os.environ:
        shutil.rmtree(Path(tempfile.gettempdir()) / f"ddpkit-matrix-{os.environ[RUN_VAR]}", ignore_errors=True)


def run_ok(argv: list[str], *, host: netns.Host | None = None, **kwargs: Any) -> str:
    """Run a launcher (on `host` when given) and return its output; it must exit 0."""
    kwargs.setdefault("timeout", TIMEOUT_S)
    if host is not None:
        out = host.run(argv, **kwargs)
    else:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{argv[:4]} exited {out.returncode}\n{text[-6000:]}"
    return text
