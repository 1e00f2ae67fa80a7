"""The targets matrix on Docker (tests/test_targets_matrix.py says what is
compared): the rendered compose file under `docker compose up`, `launch
docker`, and `make compose-test`, the user's one-command check of the
compose file. They use the session's Docker daemon and CPU image
(tests/infra/docker_daemon.py), built once for every module and worker.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from ddpkit.launch.control.applied import compose_cli
from tests.helpers.matrix import DDPKIT, IN_IMAGE, NODES, TIMEOUT_S, check, run_ok, write_spec
from tests.infra import docker_daemon as daemon_infra
from tests.infra.docker_daemon import REPO, Docker

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name


# ---- Docker: the session's daemon and CPU image ----

@pytest.mark.full  # the compose file run: make compose-test below (its rank report); its values: test_render_hostile.py
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_docker_compose(docker_daemon: Docker, tmp_path: Path) -> None:
    assert docker_daemon.image is not None
    job = write_spec(tmp_path, image=docker_daemon.image, **IN_IMAGE)
    env = {**docker_daemon.env, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")}
    run_ok([DDPKIT, "render", "compose", "-f", str(job), "-o", str(tmp_path)], env=env)
    # The project is the file's `name:` (the job's), which `ddpkit status` and `logs` ask compose about.
    compose = [*compose_cli(), "-f", str(tmp_path / "compose.yaml")]  # as `ddpkit status` finds it
    started = time.monotonic()
    try:
        output = run_ok([*compose, "up", "--no-color", "--exit-code-from", "node0"], env=docker_daemon.env,
                        cwd=tmp_path)
        rendered_run_is_followed(env)
    finally:
        subprocess.run([*compose, "down", "--remove-orphans", "--timeout", "5"], env=docker_daemon.env,
                       capture_output=True, check=False, timeout=120)
    check("docker compose", output, started)


def rendered_run_is_followed(env: dict[str, str]) -> None:
    """The rendered run, after `up`: its state and node 0's last lines (rank 0
    prints the summary; the other nodes print a line or two) from docker
    compose itself, as `ddpkit status` and `ddpkit logs` show them."""
    status = run_ok([DDPKIT, "status", "targets"], env=env)
    assert re.search(r"^run \w{6}: finished, exit code 0$", status, re.M), status
    where = ", ".join(f"node{i} exited (0)" for i in range(NODES))
    assert f"where     {where} (docker compose)" in status, status
    logs = run_ok([DDPKIT, "logs", "targets", "--node", "0", "--tail", "3"], env=env).splitlines()
    assert len(logs) == 3 and all(line.startswith("[node0] ") for line in logs), logs  # the console's prefix
    # rank 0 summary's last line; docker merges the container's stdout and stderr as it reads them, so
    # rank 0's start-up line (stderr, written earlier) may come after the summary (stdout): CI13
    assert any(line.endswith("  checkpoint -") for line in logs), logs


@pytest.mark.full  # launch docker's ranks and rank table: test_docker.py; the contract's variables: test_contract.py
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launch_docker(docker_daemon: Docker, tmp_path: Path) -> None:
    assert docker_daemon.image is not None
    job = write_spec(tmp_path, image=docker_daemon.image, **IN_IMAGE)
    started = time.monotonic()
    output = run_ok([DDPKIT, "launch", "docker", "-f", str(job)], env=docker_daemon.env, cwd=tmp_path)
    check("launch docker", output, started)


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
    # As a user types it: the Makefile's 2 nodes x the script's 2 processes (test_docker_compose above
    # runs the matrix's 3 x 2 through compose already).
    ok = make_compose_test(docker_daemon, tmp_path / "ok")
    text = ok.stdout + ok.stderr
    assert ok.returncode == 0, text[-6000:]
    assert "compose-test: node0 exited with 0" in text
    assert "rank report check: ranks 0..3 each reported once" in text, text[-6000:]
    # A job that fails on every node: the script ends with node0's code, which make reports as the recipe's.
    bad = make_compose_test(docker_daemon, tmp_path / "bad", NODES="2", NPROC="1",
                            ARGS='["--model=no.such.module:factory", "--workers=0"]')
    text = bad.stdout + bad.stderr
    assert bad.returncode != 0, text[-6000:]
    node0 = re.search(r"compose-test: node0 exited with (\d+)", text)
    assert node0 is not None and node0.group(1) != "0", text[-6000:]
    assert "[Makefile:" in text and f"compose-test] Error {node0.group(1)}" in text, text[-6000:]
