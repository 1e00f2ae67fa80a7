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

The set-up starts as soon as a worker has collected a test that needs it
(set_up_in_background, from conftest's collection hook: a process of its
own, under the same lock), and conftest hands out the modules that need it
after the first few minutes' worth of others: the cold set-up overlaps the
tests instead of holding up every worker that reaches a Docker test (on the
2-core CI machine all three did, each waiting out the whole set-up).
Whatever is left of it is paid before the first test that needs it starts
its clock (conftest's pytest_runtest_protocol calls prepare() outside
pytest-timeout's limit): the cold build took 2.5 minutes on the idle 2-core machine and 6 to 10
in whole-suite runs, which a test's own limit is not meant to hold. Its steps carry their own limits
(WHEELHOUSE_LIMIT_S, BUILD_LIMIT_S), and so does the wait for another worker's
build (LOCK_LIMIT_S): a stuck build fails, it never hangs the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
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
RECORD = STATE / "run.json"  # {"run", "host", "pid", "image", "seconds"}: what this run set up, and how long it took
WHEELHOUSE_LIMIT_S = 900  # `make wheelhouse`: about 90 s in a suite run, copying 3 GB of wheels
BUILD_LIMIT_S = 1800  # docker/build.sh cpu, stand-in base included: 2.5 to 10 minutes here
BUILD_LOG = STATE / "build.log"  # the image build's output, for when it fails
FAILED = STATE / "failed.json"  # {"run": ..., "why": ...}: this run's set-up failed; not tried again
LOCK_LIMIT_S = WHEELHOUSE_LIMIT_S + BUILD_LIMIT_S + 300  # another worker's set-up, start to end
BACKGROUND = STATE / "background.json"  # {"run", "pid"}: the set-up process set_up_in_background started
BACKGROUND_LOG = STATE / "background.log"  # that process's own output (the build's is BUILD_LOG)
# The cold set-up on the idle 2-core machine: what conftest lets the other
# modules run first, per worker, before it hands out one that needs Docker.
COLD_SET_UP_S = 330.0


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
    """`make wheelhouse` + docker/build.sh cpu (offline, stand-in base when
    needed). Their output goes to BUILD_LOG (it runs outside any test's
    capture); a failure names the step and ends with the log's last lines."""
    env = docker.env | {"OFFLINE": "1"}
    with BUILD_LOG.open("w") as log:
        for argv, limit in ((["make", "-s", "wheelhouse"], WHEELHOUSE_LIMIT_S),
                            (["bash", "docker/build.sh", "cpu", IMAGE], BUILD_LIMIT_S)):
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            try:
                done = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                      timeout=limit, check=True)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
                tail = "\n".join(BUILD_LOG.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"{' '.join(argv)}: {err}; the end of {BUILD_LOG}:\n{tail}") from None
            log.write(done.stdout)
    return done.stdout.strip().splitlines()[-1]


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
    lock), read back from RECORD by every later one, in any worker. A set-up
    that failed is not tried again in the same run (FAILED says why): every
    test that needs it fails at once, naming the cause."""
    STATE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(STATE / "setup.lock"), timeout=LOCK_LIMIT_S):
        failed = json.loads(FAILED.read_text()) if FAILED.exists() else {}
        if failed.get("run") == run:
            raise RuntimeError(f"the Docker set-up failed earlier in this run: {failed['why']}")
        if RECORD.exists():
            record = json.loads(RECORD.read_text())
            if record["run"] == run and _answers(record["host"]):
                return Docker(record["host"], record["pid"], record["image"])
        started = time.monotonic()
        daemon = start_daemon()
        try:
            remove_leftover_jobs(daemon)
            daemon.image = build_image(daemon)
        except BaseException as err:
            stop_daemon(daemon)
            FAILED.write_text(json.dumps({"run": run, "why": f"{type(err).__name__}: {err}"}))
            raise
        RECORD.write_text(json.dumps({"run": run, "host": daemon.host, "pid": daemon.pid, "image": daemon.image,
                                      "seconds": round(time.monotonic() - started, 1)}))
        return daemon


def set_up_in_background(run: str) -> None:
    """Start `run`'s set-up in a process of its own, once per run (the first
    caller wins; later ones return at once), unless Docker cannot be used
    here. It takes the set-up lock, so a test that needs the image before it
    is done waits for it in prepare() as it would for another worker."""
    STATE.mkdir(parents=True, exist_ok=True)
    if _background_of(run) is not None or _why_not() is not None:
        return
    with FileLock(str(STATE / "background.lock"), timeout=60):
        if _background_of(run) is not None:
            return
        with BACKGROUND_LOG.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tests.infra.docker_daemon", run], cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        BACKGROUND.write_text(json.dumps({"run": run, "pid": proc.pid}))


def _background_of(run: str) -> int | None:
    """The pid of `run`'s background set-up process, if one was started."""
    try:
        record = json.loads(BACKGROUND.read_text())
    except (OSError, ValueError):
        return None
    return int(record["pid"]) if record.get("run") == run else None


def _end_background(run: str) -> None:
    """A set-up still running at the end of the run (it was interrupted, or
    no selected test came to need it yet): ended with its build, and the
    daemon it started, by the daemon's pidfile."""
    pid = _background_of(run)
    BACKGROUND.unlink(missing_ok=True)
    if pid is None:
        return
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return  # done: the record, if any, says what it left running
    os.killpg(pid, signal.SIGKILL)
    pidfile = STATE / "dockerd.pid"
    try:
        daemon = int(pidfile.read_text().strip())
        is_dockerd = Path(f"/proc/{daemon}/comm").read_text().strip() == "dockerd"
    except (OSError, ValueError):
        return
    if is_dockerd and not RECORD.exists():
        stop_daemon(Docker("", daemon))


def setup_seconds(run: str) -> float | None:
    """How long `run`'s set-up took, when it did one (for the run's time table:
    it ran outside every test)."""
    if not RECORD.exists():
        return None
    record = json.loads(RECORD.read_text())
    return float(record["seconds"]) if record["run"] == run else None


_prepared = False  # this process has waited for the set-up once: later tests find it done (or FAILED)


def prepare(item: pytest.Item) -> None:
    """Set up the daemon and image for a test that uses them, before its
    clock starts (conftest); once per process, as the session fixture reads
    it. A failure is left to the fixture, which reports it inside the test,
    against that test (FAILED: without building again)."""
    global _prepared
    if _prepared or "docker_daemon" not in getattr(item, "fixturenames", ()) or _why_not() is not None:
        return
    _prepared = True
    try:
        _set_up_for(os.environ[RUN_VAR])
    except Exception:  # reported by the fixture, in the test
        return


def stop_if_started_by(run: str) -> None:
    """Stop the daemon `run` started, once nothing of that run uses it
    (conftest calls this in the main pytest process at the very end, after
    every xdist worker has finished)."""
    _end_background(run)
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


if __name__ == "__main__":
    # set_up_in_background's process: a failure is recorded in FAILED, which
    # every test that needs the image then reports.
    try:
        _set_up_for(sys.argv[1])
    except Exception as err:
        print(f"docker set-up: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
