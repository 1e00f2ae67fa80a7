"""One spec, every target, the same ranks: proven by running each.

One job spec (3 nodes x 2 processes, gloo, CPU, a one-step ResNet on 16 px
synthetic images) runs on every target ddpkit renders or launches:
`launch local`, `launch ssh` and the rendered `launch.sh` on namespace hosts
with real sshd, real Slurm in torchrun and srun mode, the real rendered
compose file under `docker compose up`, `launch docker`, and each
Kubernetes kind with its pods emulated in Docker (tests/test_k8s_emulated.py).

Every process's rank report record (`--rank-report-json -`: rank 0 prints
one JSON line per process) is read back from the job's own output and
compared with the spec's promise (tests/helpers/rank_records.py): rank =
node_rank x nproc + local_rank, world size, master port, backend, device,
interface and socket variables, and a hostile `env:` value read from inside
every process byte for byte. Only host names, addresses, pids and the
launcher may differ; their relations are checked (one host per node, node 0
hosts the master). A difference fails with a target/field/expected/got table.

The last test checks that every target ran and agreed, and prints the
table of targets covered. Infrastructure is shared by the module: one Slurm
cluster whose namespace hosts also run the sshd hosts, and the session's
Docker daemon and image. docs/TARGETS.md describes the matrix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.launch.local import free_port
from ddpkit.specfile import load_spec
from ddpkit.targets import render
from tests.helpers.rank_records import Difference, Promise, differences, records, table
from tests.infra import docker_daemon as daemon_infra
from tests.infra import netns, rank_table, slurm_cluster, sshd
from tests.infra.docker_daemon import REPO, Docker
from tests.infra.slurm_cluster import SlurmCluster

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name

PYTHON = sys.executable
DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
NODES, NPROC = 3, 2
NODE_NAMES = [f"node{i + 1}" for i in range(NODES)]
# Quotes of both kinds, command substitution of both forms, a newline, a tab,
# variables in both forms and a literal `$$`: each would change if any shell,
# YAML file, compose file or kubelet on the way expanded or re-quoted it.
HOSTILE = "it's \"q\" $(echo INJECTED) `echo TICK` $HOME ${HOME} $$ \\n\nsecond\tline '\"'"
TRAIN_ARGS = ["--model=resnet18", "--data=synthetic", "--image-size=16", "--synthetic-size=48", "--batch-size=4",
              "--max-steps=1", "--workers=0", "--no-eval", "--progress=plain",
              "--rank-report-json=-", "--rank-report-env=HOSTILE"]
MASTER_PORT = free_port()  # one port for every target: a fixed master_port wins everywhere

TIMEOUT_S = 420
RESULTS: dict[str, list[dict[str, Any]]] = {}  # target -> its records, for the closing comparison
WALL: dict[str, float] = {}  # target -> seconds its run took
MODULE_START = time.monotonic()


def spec_dict(workdir: Path, **placement: Any) -> dict[str, Any]:
    """THE spec. `placement` says only where it runs (interpreter, image,
    ssh folders, Slurm mode, Kubernetes kind): nothing any process compares."""
    spec: dict[str, Any] = {
        "name": "targets", "image": "ddpkit:latest", "nodes": NODES, "nproc_per_node": NPROC,
        "device": "cpu", "backend": "gloo", "master_port": MASTER_PORT,
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


def write_spec(folder: Path, **placement: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec_dict(folder, **placement)))
    return path


def promise(target: str) -> Promise:
    # `launch local` runs every node on this one machine: its processes reach
    # the master (127.0.0.1) over loopback, which `auto` picks there.
    return Promise(nodes=NODES, nproc_per_node=NPROC, master_port=MASTER_PORT, backend="gloo", device="cpu",
                   interface="lo" if target == "launch local" else "eth0", env={"HOSTILE": HOSTILE})


def check(target: str, output: str, started: float) -> None:
    """Compare the target's records with the promise; keep them for the end."""
    WALL[target] = time.monotonic() - started
    got = records(output)
    RESULTS[target] = got
    diffs = differences(target, got, promise(target))
    assert not diffs, f"{target} broke the contract:\n{table(diffs)}\n--- output tail\n{output[-4000:]}"
    assert "INJECTED" not in output.replace("$(echo INJECTED)", "") and "TICK" not in output.replace(
        "`echo TICK`", ""), f"{target}: a shell ran the hostile value\n{output[-4000:]}"


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


# ---- launch local: no infrastructure ----


def test_launch_local(tmp_path: Path) -> None:
    job = write_spec(tmp_path)
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_"))}
    output = run_ok([DDPKIT, "launch", "local", "-f", str(job)], cwd=tmp_path, env=env)
    check("launch local", output, started)


def test_rank_report_flags_are_checked_and_frozen(tmp_path: Path) -> None:
    import argparse

    from ddpkit.train.config import TrainConfig
    from ddpkit.train.main import add_arguments
    from ddpkit.train.options import problems

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
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    reason = slurm_cluster.available() or sshd.available()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=NODES, prefix=f"tm{os.getpid() % 100000}") as c:
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
@pytest.mark.parametrize("mode", ["torchrun", "srun"])
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


# ---- Docker: the session's daemon and CPU image ----

IN_IMAGE = {"command.python": "python3"}  # the image's interpreter; ddpkit is installed there


def compose_cli(docker: Docker) -> list[str]:
    """Compose v2 as a docker plugin, else the binary the test extras install."""
    probe = subprocess.run(["docker", "compose", "version"], env=docker.env, capture_output=True, check=False)
    if probe.returncode == 0:
        return ["docker", "compose"]
    return [str(Path(sys.executable).with_name("docker-compose"))]


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_docker_compose(docker_daemon: Docker, tmp_path: Path) -> None:
    assert docker_daemon.image is not None
    job = write_spec(tmp_path, image=docker_daemon.image, **IN_IMAGE)
    run_ok([DDPKIT, "render", "compose", "-f", str(job), "-o", str(tmp_path)])
    compose = [*compose_cli(docker_daemon), "-f", str(tmp_path / "compose.yaml"), "-p", f"tm{os.getpid()}"]
    started = time.monotonic()
    try:
        output = run_ok([*compose, "up", "--no-color", "--exit-code-from", "node0"], env=docker_daemon.env,
                        cwd=tmp_path)
    finally:
        subprocess.run([*compose, "down", "--remove-orphans", "--timeout", "5"], env=docker_daemon.env,
                       capture_output=True, check=False, timeout=120)
    check("docker compose", output, started)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launch_docker(docker_daemon: Docker, tmp_path: Path) -> None:
    assert docker_daemon.image is not None
    job = write_spec(tmp_path, image=docker_daemon.image, **IN_IMAGE)
    started = time.monotonic()
    output = run_ok([DDPKIT, "launch", "docker", "-f", str(job)], env=docker_daemon.env, cwd=tmp_path)
    check("launch docker", output, started)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "trainjob", "jobset"])
def test_kubernetes_emulated(docker_daemon: Docker, tmp_path: Path, kind: str) -> None:
    from tests.test_k8s_emulated import pods, run_pods

    assert docker_daemon.image is not None
    spec = load_spec(write_spec(tmp_path, image=docker_daemon.image, **IN_IMAGE, **{"k8s.kind": kind}))
    (text,) = render(spec, "k8s").files.values()
    emulated = pods(spec, text)
    assert not any("$(" in a for p in emulated for a in p.argv), "an unexpanded $(VAR) reached a pod"
    started = time.monotonic()
    codes, logs = run_pods(docker_daemon, emulated)
    assert codes == [0] * NODES, "\n".join(logs)[-6000:]
    check(f"k8s {kind}", logs[0], started)
    assert rank_table.problems(logs[0], NODES * NPROC, NPROC) == [], logs[0][-6000:]  # the table users read
    # The controller's index, not only distinct pods: pod i runs node rank i.
    node_hosts = {int(r["node_rank"]): r["host"] for r in RESULTS[f"k8s {kind}"]}
    assert node_hosts == {i: p.hostname for i, p in enumerate(emulated)}, "pod i must carry node rank i"


# ---- make compose-test: the user's one-command check of the compose file ----


def make_compose_test(docker: Docker, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`make compose-test` on the session's image (already built: SKIP_BUILD)."""
    assert docker.image is not None
    run_env = docker.env | {"IMAGE": docker.image, "SKIP_BUILD": "1", "OUT": str(out), **env}
    return subprocess.run(["make", "--no-print-directory", "compose-test"], cwd=REPO, env=run_env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_compose_test_runs_and_exits_with_node0s_code(docker_daemon: Docker, tmp_path: Path) -> None:
    ok = make_compose_test(docker_daemon, tmp_path / "ok", NODES=str(NODES))
    text = ok.stdout + ok.stderr
    assert ok.returncode == 0, text[-6000:]
    assert "compose-test: node0 exited with 0" in text
    assert f"rank report check: ranks 0..{NODES * 2 - 1} each reported once" in text, text[-6000:]
    # A job that fails on every node: the script ends with node0's code, which make reports as the recipe's.
    bad = make_compose_test(docker_daemon, tmp_path / "bad", NODES="2", NPROC="1",
                            ARGS='["--model=no.such.module:factory", "--workers=0"]')
    text = bad.stdout + bad.stderr
    assert bad.returncode != 0, text[-6000:]
    node0 = re.search(r"compose-test: node0 exited with (\d+)", text)
    assert node0 is not None and node0.group(1) != "0", text[-6000:]
    assert "[Makefile:" in text and f"compose-test] Error {node0.group(1)}" in text, text[-6000:]


# ---- the closing comparison ----

TARGETS = ["launch local", "launch ssh", "launch.sh", "slurm torchrun", "slurm srun", "docker compose",
           "launch docker", "k8s pytorchjob", "k8s indexed-job", "k8s trainjob", "k8s jobset"]


def _comparable(record: dict[str, Any], target: str) -> dict[str, Any]:
    """A record without what may differ (hosts, addresses, pids, launcher;
    the interface where `launch local` rightly uses loopback)."""
    left_out = {"host", "address", "pid", "launcher", "master_addr", "torch", "cuda", "nccl", "kind"}
    if target == "launch local":
        left_out |= {"interface", "nccl_socket_ifname", "gloo_socket_ifname"}
    return {k: v for k, v in record.items() if k not in left_out}


@pytest.mark.root
@pytest.mark.slow
def test_every_target_ran_and_all_agree(request: pytest.FixtureRequest) -> None:
    """Every target's records equal the first target's in every compared
    field; prints the table of targets covered with their wall time."""
    module = request.node.nodeid.split("::")[0]
    selected = {item.name for item in request.session.items if item.nodeid.startswith(module)}
    if len(selected) < len(TARGETS) + 1:  # each target's test, and this one
        pytest.skip("only part of the matrix was selected (-k / -m); nothing to compare across every target")
    missing = [t for t in TARGETS if t not in RESULTS]
    assert not missing, f"targets that did not run or failed before reporting: {missing}"
    reference_target = TARGETS[0]
    diffs: list[Difference] = []
    for target in TARGETS[1:]:
        for ref, got in zip(RESULTS[reference_target], RESULTS[target], strict=True):
            a, b = _comparable(ref, reference_target), _comparable(got, target)
            for key in sorted(set(a) & set(b)):
                if a[key] != b[key]:
                    diffs.append(Difference(target, f"rank {got['rank']} {key}", repr(a[key]), repr(b[key])))
    assert not diffs, table(diffs)
    lines = [f"{'target':16} {'processes':>9} {'launcher':10} {'host of node 0':24} {'seconds':>7}"]
    for target in TARGETS:
        rows = RESULTS[target]
        lines.append(f"{target:16} {len(rows):>9} {rows[0]['launcher']:10} {rows[0]['host']:24} {WALL[target]:>7.1f}")
    lines.append(f"module wall time so far: {time.monotonic() - MODULE_START:.0f} s")
    summary = "\n".join(lines)
    (REPO / ".pytest_cache").mkdir(exist_ok=True)
    (REPO / ".pytest_cache" / "targets-matrix.txt").write_text(summary + "\n")
    print("\n" + summary)
