"""No Docker daemon: `launch docker`, docker/build.sh and
docker/compose-test.sh (so `make image-cpu` / `make compose-test`) stop at
once with one line naming the DOCKER_HOST they tried and how to start the
daemon, exit 3, instead of "Cannot connect to the Docker daemon" twice and
minutes of a stand-in base image build. No root, no daemon: DOCKER_HOST
points at a socket path where nothing listens."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.shared.exitcodes import ExitCode

REPO = Path(__file__).resolve().parents[1]
HINT = "start it (sudo systemctl start docker, or sudo dockerd &) or set DOCKER_HOST to a running daemon"


@pytest.fixture(params=["missing", "not-listening"])
def dead_host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A socket path with no file, or a bound socket nobody listens on (connection refused)."""
    path = tmp_path / "docker.sock"
    if request.param == "missing":
        yield f"unix://{path}"
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    try:
        yield f"unix://{path}"
    finally:
        sock.close()


def run(argv: list[str], host: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "DOCKER_HOST": host, "PYTHONPATH": f"{REPO / 'src'}"}
    env.pop("DOCKER_CONTEXT", None)
    began = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - began


def test_launch_docker_says_which_daemon_it_tried_in_one_line(dead_host: str) -> None:
    done, _ = run([sys.executable, "-m", "ddpkit.cli", "launch", "docker", "-f", "examples/cpu-smoke.yaml"], dead_host)
    assert done.returncode == ExitCode.PREFLIGHT, done.stderr
    assert done.stderr.splitlines() == [
        f"ddpkit launch docker: cannot reach the Docker daemon at DOCKER_HOST={dead_host}; {HINT}; "
        "nothing was started"], done.stderr


@pytest.mark.parametrize("script", [["docker/build.sh", "cpu"], ["docker/compose-test.sh"]])
def test_the_image_scripts_stop_before_any_pull_or_build(dead_host: str, script: list[str], tmp_path: Path) -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH: the check says so instead (test_no_docker_client_is_one_line)")
    done, took = run(["bash", *script], dead_host)
    who = Path(script[0]).name.removesuffix(".sh")
    who = "build.sh" if who == "build" else who
    assert done.returncode == ExitCode.PREFLIGHT, done.stderr
    assert done.stderr.splitlines() == [
        f"{who}: cannot reach the Docker daemon at DOCKER_HOST={dead_host}; {HINT}; nothing was started"], done.stderr
    assert "stand-in" not in done.stderr and "Cannot connect" not in done.stderr
    assert took < 30, f"took {took:.1f}s: something ran before the check"


def test_no_docker_client_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER": str(tmp_path / "no-such-docker")}
    done = subprocess.run(["bash", "docker/daemon-check.sh", "make"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == ExitCode.PREFLIGHT
    assert done.stderr.splitlines() == [f"make: no Docker client '{tmp_path / 'no-such-docker'}' on PATH; install "
                                        "Docker (or set DOCKER to the client); nothing was started"]
