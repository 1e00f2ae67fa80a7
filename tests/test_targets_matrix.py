"""One spec, every target, the same ranks: proven by running each.

One job spec (3 nodes x 2 processes, gloo, CPU, a one-step ResNet on 16 px
synthetic images, tests/helpers/matrix.py) runs on every target ddpkit
renders or launches. This module runs the targets on this machine and on
namespace hosts: `launch local`, `launch ssh` and the rendered `launch.sh`
with real sshd, real Slurm in torchrun and srun mode. The Docker targets are
in tests/test_targets_matrix_docker.py, the Kubernetes kinds in
tests/test_targets_matrix_k8s.py: three modules, so that xdist runs them at
once on different workers.

Every process's rank report record (`--rank-report-json -`: rank 0 prints
one JSON line per process) is read back from the job's own output and
compared with the spec's promise (tests/helpers/rank_records.py): rank =
node_rank x nproc + local_rank, world size, master port, backend, device,
interface and socket variables, and a hostile `env:` value read from inside
every process byte for byte. Only host names, addresses, pids and the
launcher may differ; their relations are checked (one host per node, node 0
hosts the master). A difference fails with a target/field/expected/got table.
Each target is also compared with every target that finished before it, in
any module or worker (`matrix.check`); the run ends with the table of targets
covered, and fails if only part of the matrix ran (tests/conftest.py). One
Slurm cluster whose namespace hosts also run the sshd hosts serves this
module. docs/TESTING.md describes the matrix.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.matrix import DDPKIT, HOSTILE, NODE_NAMES, NODES, NPROC, TIMEOUT_S, check, run_ok, write_spec
from tests.helpers.rank_records import Promise, differences
from tests.helpers.tiers import full_case
from tests.infra import netns, slurm_cluster, sshd
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

# ---- launch local: no infrastructure ----


def test_launch_local(tmp_path: Path) -> None:
    job = write_spec(tmp_path)
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_"))}
    output = run_ok([DDPKIT, "launch", "local", "-f", str(job)], cwd=tmp_path, env=env)
    check("launch local", output, started)


def test_rank_report_flags_are_checked_and_frozen(tmp_path: Path) -> None:
    import argparse

    from ddpkit.train.config.options import problems
    from ddpkit.train.config.values import TrainConfig
    from ddpkit.train.main import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--rank-report-json", str(tmp_path), "--rank-report-env", "A", "--rank-report-env", "B"])
    assert any("--rank-report-json" in p and "folder" in p for p in problems(args)), problems(args)
    config = TrainConfig.from_args(args)
    assert config.rank_report_env == ("A", "B") and hash(config)
    assert problems(parser.parse_args(["--rank-report-json", "-"])) == []


@pytest.mark.slow
def test_rank_report_json_file_and_metrics_records(tmp_path: Path) -> None:
    """The file form of the record (one JSON document by rank 0) and the
    metrics lines (kind rank_report, one per process) carry the same records."""
    from tests.helpers import runs

    report, metrics = tmp_path / "out" / "ranks.json", tmp_path / "metrics.jsonl"
    args = [*runs.TINY, "--synthetic-size=16", "--batch-size=4", "--max-steps=1", "--no-eval",
            f"--rank-report-json={report}", "--rank-report-env=HOSTILE", "--rank-report-env=UNSET_HERE",
            f"--metrics={metrics}"]
    runs.run_ok(runs.torchrun(tmp_path, 2, 1, args, env={"HOSTILE": HOSTILE}))
    document = json.loads(report.read_text())
    assert document["kind"] == "rank_report" and document["world_size"] == 2 and document["problems"] == []
    lines = [r for r in runs.metrics(metrics) if r["kind"] == "rank_report"]
    assert [{k: v for k, v in r.items() if k != "time"} for r in lines] == document["processes"]
    got = Promise(nodes=2, nproc_per_node=1, master_port=document["processes"][0]["master_port"], backend="gloo",
                  device="cpu", interface="lo", env={"HOSTILE": HOSTILE, "UNSET_HERE": None})
    assert differences("file", document["processes"], got) == []
    assert list(tmp_path.joinpath("out").iterdir()) == [report], "no temporary file is left beside the report"


# ---- namespace hosts: one Slurm cluster whose nodes also run sshd ----


@dataclass
class Hosts:
    cluster: SlurmCluster
    ssh: sshd.SshHosts

    @property
    def login(self) -> netns.Host:
        return self.cluster.ctl

    @property
    def nodes(self) -> list[netns.Host]:
        assert self.cluster.net is not None
        return [self.cluster.net[n] for n in NODE_NAMES]


@pytest.fixture(scope="module")
def hosts(slurm_pool: SlurmPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    reason = slurm_cluster.available() or sshd.available()
    if reason:
        pytest.skip(reason)
    with slurm_pool.lease(nodes=NODES) as c:
        assert c.net is not None
        ssh_folder = tmp_path_factory.mktemp("sshd")
        with sshd.SshHosts([c.net[n] for n in NODE_NAMES], c.ctl, ssh_folder) as ssh_hosts:
            yield Hosts(c, ssh_hosts)


def hostfile(folder: Path, hosts: Hosts) -> Path:
    path = folder / "hostfile"
    path.write_text("".join(f"{h.addr} slots={NPROC}\n" for h in hosts.nodes))
    return path


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_ssh(hosts: Hosts, tmp_path: Path) -> None:
    job = write_spec(tmp_path)
    started = time.monotonic()
    output = run_ok([DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(hostfile(tmp_path, hosts)),
                     *hosts.ssh.launcher_flags()], host=hosts.login, cwd=str(tmp_path))
    check("launch ssh", output, started)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rendered_ssh_launcher(hosts: Hosts, tmp_path: Path) -> None:
    job = write_spec(tmp_path)
    rendered = tmp_path / "rendered"
    run_ok([DDPKIT, "render", "ssh", "-f", str(job), "-o", str(rendered)])
    started = time.monotonic()
    env = {**os.environ, "DDPKIT_SSH_OPTS": f"-F {hosts.ssh.ssh_config}"}
    output = run_ok(["bash", str(rendered / "launch.sh"), str(hostfile(tmp_path, hosts))], host=hosts.login,
                    cwd=str(tmp_path), env=env)
    check("launch.sh", output, started)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
# srun mode's processes and variables: test_slurm_real.py's srun-mode test, in make test
@pytest.mark.parametrize("mode", ["torchrun", full_case("srun")])
def test_slurm(hosts: Hosts, tmp_path: Path, mode: str) -> None:
    job = write_spec(tmp_path, **{"slurm.mode": mode})
    run_ok([DDPKIT, "render", "slurm", "-f", str(job), "-o", str(tmp_path)])
    script = tmp_path / "targets.sbatch"
    started = time.monotonic()
    job_id = hosts.cluster.sbatch(script)
    info = hosts.cluster.wait(job_id, timeout=TIMEOUT_S)
    output = (tmp_path / f"targets-{job_id}.out").read_text(errors="replace")
    assert info.state == "COMPLETED", f"slurm {mode}: job {job_id} {info.state}\n{output[-6000:]}"
    check(f"slurm {mode}", output, started)
