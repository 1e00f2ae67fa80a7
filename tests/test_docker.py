"""The image and `ddpkit launch docker`: hadolint, the compose file under
`docker compose config`, and real containers on a real Docker daemon."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.rank_records import records
from tests.infra import rank_table
from tests.infra.docker_daemon import REPO, Docker, docker_daemon, remove_leftover_jobs  # noqa: F401  (fixture)

# examples/cpu-smoke.yaml under a name of this module's own: each test checks
# that no container or network of its job is left, while other modules (the
# target matrix's `make compose-test`, launch_summary) run cpu-smoke jobs on
# the same daemon from other xdist workers.
JOB = "docker-launch-test"

VENV_BIN = Path(sys.executable).parent
TINY = ["--model=tiny", "--data=synthetic", "--image-size=16", "--synthetic-size=32", "--batch-size=8",
        "--epochs=1", "--workers=0", "--no-eval"]
# The same, running long enough to be stopped from outside mid-run.
LONG = [*TINY[:-3], "--epochs=100000", "--workers=0", "--no-eval", "--log-every=1"]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(VENV_BIN)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (pip install -e '.[test]')")
    return path


def test_dockerfile_passes_hadolint_and_every_kept_warning_has_a_reason() -> None:
    dockerfile = REPO / "docker" / "Dockerfile"
    result = subprocess.run([_tool("hadolint"), "--failure-threshold", "error", "-f", "json", str(dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout or "[]") == []
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            rule = line.split("=", 1)[1]
            start = i
            while start > 0 and lines[start - 1].startswith("#"):
                start -= 1
            reason = "\n".join(lines[start:i])
            assert rule in reason and "kept" in reason, f"{rule}: no reason given in the comment above"


def test_rendered_compose_file_passes_docker_compose_config(tmp_path: Path) -> None:
    compose = _tool("docker-compose")
    for nodes in (2, 3):
        out = tmp_path / str(nodes)
        subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "compose", "-f", "examples/cpu-smoke.yaml",
                        "--nodes", str(nodes), "-o", str(out)], cwd=REPO, check=True, capture_output=True)
        result = subprocess.run([compose, "-f", str(out / "compose.yaml"), "config", "--format", "json"],
                                capture_output=True, text=True, cwd=out)
        assert result.returncode == 0, result.stderr
        services = json.loads(result.stdout)["services"]
        assert sorted(services) == [f"node{i}" for i in range(nodes)]
        for i in range(nodes):
            assert f"--node-rank={i}" in services[f"node{i}"]["command"]
            assert services[f"node{i}"]["environment"]["DDPKIT_NODE_RANK"] == str(i)


def test_launch_docker_refuses_bad_input_before_touching_docker() -> None:
    result = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "docker", "-f", "examples/cpu-smoke.yaml",
                             "--nodes", "0"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"})
    assert result.returncode == 2
    assert "nodes" in result.stderr


def _launch(docker: Docker, nodes: int, *train: str, sets: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "docker", "-f", "examples/cpu-smoke.yaml",
            "--nodes", str(nodes), "--nproc-per-node", "1", "--image", str(docker.image), "--grace", "2",
            "--set", f"name={JOB}",
            "--set", "command.args=" + json.dumps(list(train)), *(w for s in sets for w in ("--set", s))]
    return subprocess.Popen(argv, cwd=REPO, env=docker.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _leftovers(docker: Docker) -> str:
    ps = subprocess.run(["docker", "ps", "-a", "-q", "--filter", f"label=io.ddpkit.job={JOB}"],
                        env=docker.env, capture_output=True, text=True, check=True).stdout
    nets = subprocess.run(["docker", "network", "ls", "-q", "--filter", f"label=io.ddpkit.job={JOB}"],
                          env=docker.env, capture_output=True, text=True, check=True).stdout
    return ps + nets


@pytest.fixture(autouse=True)
def _no_job_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each container test (its own check that nothing is left has run
    by then): remove whatever a failed test left of its job, so that a killed
    launcher's 1000-epoch containers do not train on through the rest of the
    run on the shared daemon."""
    yield
    if "docker_daemon" in request.fixturenames:
        remove_leftover_jobs(request.getfixturevalue("docker_daemon"), job=JOB)


def _wait_running(docker: Docker, count: int) -> None:
    for _ in range(240):
        ps = subprocess.run(["docker", "ps", "-q", "--filter", f"label=io.ddpkit.job={JOB}"],
                            env=docker.env, capture_output=True, text=True).stdout.split()
        if len(ps) == count:
            return
        time.sleep(0.5)
    raise AssertionError(f"{count} containers never ran")


def _wait_training(docker: Docker, node: str, timeout: float = 300) -> None:
    """Until `node` printed a progress line: its process group formed and a
    step is done, so the others now meet a dead peer inside a collective."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label=io.ddpkit.job={JOB}", "--filter",
                              f"name={node}"], env=docker.env, capture_output=True, text=True).stdout.split()
        if ids:
            logs = subprocess.run(["docker", "logs", ids[0]], env=docker.env, capture_output=True, text=True)
            if re.search(r"step \d+/\d+ epoch", logs.stdout + logs.stderr):
                return
        time.sleep(0.5)
    raise AssertionError(f"{node} printed no progress line within {timeout:g}s")


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_docker_runs_every_rank_once_and_cleans_up(docker_daemon: Docker, tmp_path: Path) -> None:  # noqa: F811  (the imported fixture)
    # The job's checkpoints go to a host folder through the spec's mounts: (the image runs as a non-root user).
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt.chmod(0o777)
    proc = _launch(docker_daemon, 2, *TINY, "--checkpoint-dir=/ckpt", "--resume=auto", sets=(f"mounts=[{ckpt}:/ckpt]",))
    out, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, out
    assert (ckpt / "latest").read_text().strip().startswith("ckpt-"), "the checkpoint reached the host folder"
    assert "warning" not in out, "a mounted checkpoint folder is not warned about"
    assert rank_table.problems(out, 2, 1) == [], out
    hosts = {r.node_rank: r.host for r in rank_table.rows(out)}
    assert hosts == {0: "node0", 1: "node1"}
    # Only rank 0 prints (rank 1 writes its log file): node1 shows up in the table above.
    assert "[node0] ddpkit train finished" in out
    assert _leftovers(docker_daemon) == ""


@pytest.mark.full  # secrets on stdin: launch local, ssh and Slurm (test_secrets.py, test_launch_ssh.py, test_slurm_real.py)
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_docker_hands_a_secret_to_every_rank(docker_daemon: Docker, tmp_path: Path) -> None:  # noqa: F811
    """Issue 29 item 8: the value goes from this environment to the Docker API
    with each container's environment, and reaches every rank as it is."""
    value = "it's \"q\" $(echo PWNED) `id` ${HOME} \\ 9d2e-docker-secret\nline two\t"
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "examples" / "cpu-smoke.yaml").read_text() + "\nsecrets: [RUN_SECRET]\n")
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "docker", "-f", str(job), "--nodes", "2",
            "--nproc-per-node", "1", "--image", str(docker_daemon.image), "--grace", "2", "--set", f"name={JOB}",
            "--set", "command.args=" + json.dumps([*TINY, "--rank-report-json=-", "--rank-report-env=RUN_SECRET"])]
    done = subprocess.run(argv, cwd=REPO, env={**docker_daemon.env, "RUN_SECRET": value}, capture_output=True,
                          text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["env"] for r in records(done.stdout)] == [{"RUN_SECRET": value}] * 2
    assert _leftovers(docker_daemon) == ""


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_docker_fails_fast_when_one_container_dies(docker_daemon: Docker) -> None:  # noqa: F811  (the imported fixture)
    # A long job; node1 is killed from outside once both run: node0 would
    # otherwise wait in its next collective for the full timeout.
    proc = _launch(docker_daemon, 2, *LONG)
    try:
        _wait_running(docker_daemon, 2)
        _wait_training(docker_daemon, "node0")
        name = subprocess.run(["docker", "ps", "-q", "--filter", f"label=io.ddpkit.job={JOB}",
                               "--filter", "name=node1"], env=docker_daemon.env, capture_output=True,
                              text=True, check=True).stdout.split()
        assert len(name) == 1
        subprocess.run(["docker", "kill", name[0]], env=docker_daemon.env, check=True, capture_output=True)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 137, out
    assert "failed first: exit status 137; every other node was stopped" in " ".join(out.split()), out
    assert _leftovers(docker_daemon) == ""


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launch_docker_ctrl_c_removes_everything(docker_daemon: Docker) -> None:  # noqa: F811  (the imported fixture)
    proc = _launch(docker_daemon, 2, *LONG)
    try:
        _wait_running(docker_daemon, 2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted; stopped and removed all containers" in out
    assert _leftovers(docker_daemon) == ""
