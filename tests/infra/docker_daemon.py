"""A Docker daemon and the ddpkit CPU image for the container tests.

Uses the daemon DOCKER_HOST (or the default socket) names when one answers;
otherwise, as root with Debian's docker.io installed, starts its own dockerd
(own data root, exec root, socket and pidfile under /tmp) and stops it by
its PID at the end of the session. The image is built once per session by
docker/build.sh, the same path `make image-cpu` takes: a stand-in base from
mmdebstrap when the base cannot be pulled, wheels from docker/wheelhouse.

Under pytest-xdist the workers share that one daemon and image: the first
worker to need it starts the daemon and builds the image while holding a
file lock, and records the run it did it for (RUN_VAR, set once by the
controller); the others find the record and use both. The controller stops
the daemon when every worker is done (stop_if_started_by, from conftest).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
STATE = Path("/tmp/ddpkit-test-dockerd")
IMAGE = "ddpkit:cpu-test"
RUN_VAR = "DDPKIT_TEST_RUN"  # one value per pytest run, the same in every xdist worker
RECORD = STATE / "run.json"  # {"run": ..., "host": ..., "pid": ..., "image": ...}: what this run set up


@dataclass
class Docker:
    host: str  # a DOCKER_HOST value
    pid: int | None  # the dockerd we started, None when it was already running
    image: str | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}


def _answers(host: str) -> bool:
    probe = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], env={**os.environ, "DOCKER_HOST": host},
                           capture_output=True, text=True, timeout=30)
    return probe.returncode == 0


def _why_not() -> str | None:
    if shutil.which("docker") is None:
        return "docker CLI not installed (.ci/system-deps.sh installs docker.io)"
    if os.geteuid() != 0 and not _answers(os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")):
        return "no Docker daemon answers and starting dockerd needs root"
    if shutil.which("dockerd") is None and not _answers(os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")):
        return "no Docker daemon answers and dockerd is not installed"
    return None


def start_daemon() -> Docker:
    existing = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if _answers(existing):
        return Docker(existing, None)
    STATE.mkdir(parents=True, exist_ok=True)
    sock = STATE / "docker.sock"
    log = (STATE / "dockerd.log").open("ab")
    proc = subprocess.Popen(
        ["dockerd", f"--data-root={STATE / 'root'}", f"--exec-root={STATE / 'exec'}",
         f"--pidfile={STATE / 'dockerd.pid'}", f"--host=unix://{sock}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    docker = Docker(f"unix://{sock}", proc.pid)
    for _ in range(120):
        if proc.poll() is not None:
            raise RuntimeError(f"dockerd exited with {proc.returncode}; see {STATE / 'dockerd.log'}")
        if sock.exists() and _answers(docker.host):
            return docker
        time.sleep(0.5)
    stop_daemon(docker)
    raise RuntimeError(f"dockerd did not answer within 60s; see {STATE / 'dockerd.log'}")


def stop_daemon(docker: Docker) -> None:
    """Stop the dockerd this module started, by its PID, and wait for it."""
    if docker.pid is None:
        return
    try:
        os.kill(docker.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(60):
        try:
            os.kill(docker.pid, 0)
        except ProcessLookupError:
            return
        try:
            os.waitpid(docker.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.5)
    os.kill(docker.pid, signal.SIGKILL)


def build_image(docker: Docker) -> str:
    """`make wheelhouse` + docker/build.sh cpu (offline, stand-in base when needed)."""
    subprocess.run(["make", "-s", "wheelhouse"], cwd=REPO, env=docker.env, check=True,
                   stdout=subprocess.DEVNULL)
    env = docker.env | {"OFFLINE": "1"}
    out = subprocess.run(["bash", "docker/build.sh", "cpu", IMAGE], cwd=REPO, env=env, check=True,
                         stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def remove_leftover_jobs(docker: Docker, job: str | None = None) -> None:
    """Containers and networks of ddpkit jobs (of every job, or of `job`) an
    earlier, interrupted session or a failed test left in the data root (it
    outlives the daemon to keep the image cache): the tests check that a
    launch leaves nothing behind, so start from none."""
    label = "label=io.ddpkit.job" + (f"={job}" if job else "")
    for kind, remove in (("ps", ["rm", "-f"]), ("network ls", ["network", "rm"])):
        ids = subprocess.run(["docker", *kind.split(), *(["-a"] if kind == "ps" else []), "-q", "--filter", label],
                             env=docker.env, capture_output=True, text=True, check=True).stdout.split()
        if ids:
            subprocess.run(["docker", *remove, *ids], env=docker.env, capture_output=True, check=True)


def _set_up_for(run: str) -> Docker:
    """The daemon and image of `run`: set up by the first caller (under the
    lock), read back from RECORD by every later one, in any worker."""
    STATE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(STATE / "setup.lock")):
        if RECORD.exists():
            record = json.loads(RECORD.read_text())
            if record["run"] == run and _answers(record["host"]):
                return Docker(record["host"], record["pid"], record["image"])
        daemon = start_daemon()
        try:
            remove_leftover_jobs(daemon)
            daemon.image = build_image(daemon)
        except BaseException:
            stop_daemon(daemon)
            raise
        RECORD.write_text(json.dumps({"run": run, "host": daemon.host, "pid": daemon.pid, "image": daemon.image}))
        return daemon


def stop_if_started_by(run: str) -> None:
    """Stop the daemon `run` started, once nothing of that run uses it
    (conftest calls this in the main pytest process at the very end, after
    every xdist worker has finished)."""
    if not RECORD.exists():
        return
    record = json.loads(RECORD.read_text())
    if record["run"] == run:
        stop_daemon(Docker(record["host"], record["pid"], record["image"]))
        RECORD.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def docker_daemon() -> Iterator[Docker]:
    """A running daemon (started here if need be) with the CPU image built,
    shared by every test module and xdist worker of this run (RUN_VAR names
    it: conftest sets it before any worker starts). Test modules import this
    fixture by name."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    yield _set_up_for(os.environ[RUN_VAR])
