"""A stranger on the network of a `launch docker` job (the shared Docker
daemon, the CPU image): while 2 containers x 1 process of `ddpkit train`
train, a third container on the job's own network, not part of the job,
opens node0's master port and forges ddpkit's control records (the
watchdog's stall verdict, a node-loss verdict, frozen heartbeats, straggler
work records, acknowledgements) under the public prefix every ddpkit used
before run keys and under every prefix it could derive (the job's name, the
run's id, an empty key): the job trains to its last step and `launch docker`
exits 0. The same verdict under the run's own prefix (the key read from the
containers' environment, as only a member of the docker group can) stops it
with exit 13."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ddpkit.launch.docker import LABEL_JOB, LABEL_RUN
from ddpkit.rendezvous import runkey
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.followed import Followed
from tests.helpers.store_stranger import EVIL, in_container
from tests.infra.docker_daemon import REPO, Docker, docker_daemon, remove_leftover_jobs  # noqa: F401  (fixture)

JOB = "docker-attack-test"  # this module's own job name on the shared daemon
PORT = 29500  # node0's master port, inside its container (compose's default)
STEP_S, MAX_STEPS, STALL_S = 0.3, 80, 6  # each step takes at least STEP_S: the job trains for 24 s at least
AFTER = 20  # steps the job must make after the forgeries: STEP_S x AFTER is at least STALL_S
TRAIN = ["--model", "tests.helpers.stall_models:paced", "--image-size", "8", "--workers", "0", "--progress", "plain",
         "--log-every", "1", "--data", "synthetic", "--batch-size", "4", "--synthetic-size", "100000",
         "--no-eval", "--max-steps", str(MAX_STEPS)]
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
def job(docker_daemon: Docker) -> Iterator[Job]:  # noqa: F811  (the imported fixture)
    """The running job; whatever a failed test left of it (the launcher, its
    containers, its network) is gone afterwards."""
    started = Job(docker_daemon)
    try:
        yield started
    finally:
        if started.out.running:
            started.out.proc.kill()
            started.out.proc.wait()
        remove_leftover_jobs(docker_daemon, job=JOB)


class Job:
    """`launch docker` of the paced model; the repository mounted read-only
    for the test's model factory (and the stranger's client)."""

    def __init__(self, docker: Docker) -> None:
        self.docker = docker
        self.network = self.run_id = ""
        sets = [f"name={JOB}", "nodes=2", "nproc_per_node=1", f"watchdog.stall_s={STALL_S}",
                "command.module=ddpkit.train", "command.args=" + json.dumps(TRAIN), f"mounts=[{REPO}:/repo:ro]",
                "env=" + json.dumps({"PYTHONPATH": "/repo", "STALL_TEST_STEP_S": str(STEP_S)})]
        argv = [sys.executable, "-m", "ddpkit.cli", "launch", "docker", "-f", "examples/cpu-smoke.yaml",
                "--image", str(docker.image), "--grace", "3", *(w for s in sets for w in ("--set", s))]
        self.out = Followed(subprocess.Popen(argv, cwd=REPO, env=docker.env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True))

    def started(self) -> Job:
        self.network = self.out.wait_for(r"on network (\S+), master node0").group(1)
        self.run_id = self.out.wait_for(r"\(ddpkit status (\S+)\)").group(1)
        self.out.wait_for(r"\bstep 3/")  # the watchdog is up and every rank has published
        return self

    def _docker(self, *argv: str, timeout: float = 60) -> str:
        done = subprocess.run(["docker", *argv], env=self.docker.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"docker {' '.join(argv)}: {done.stdout}{done.stderr}"
        return done.stdout

    def stranger(self, *argv: str) -> str:
        """The stranger's client, in a container of its own on the job's network."""
        return in_container(self.docker.env, str(self.docker.image), self.network, f"{LABEL_JOB}={JOB}", "node0",
                            str(PORT), *argv)

    def key(self) -> str:
        """The run key, from the environment Docker holds for each container of the run."""
        ids = self._docker("ps", "-q", "--filter", f"label={LABEL_RUN}={self.run_id}").split()
        assert len(ids) == 2, ids
        keys = set()
        for line in self._docker("inspect", "--format", "{{json .Config.Env}}", *ids).splitlines():
            keys |= {e.split("=", 1)[1] for e in json.loads(line) if e.startswith(f"{runkey.ENV}=")}
        assert len(keys) == 1, f"every container of the run holds one key: {len(keys)} found"
        return keys.pop()

    def leftovers(self) -> str:
        return self._docker("ps", "-a", "-q", "--filter", f"label={LABEL_JOB}={JOB}") + \
            self._docker("network", "ls", "-q", "--filter", f"label={LABEL_JOB}={JOB}")


@pytest.mark.full  # a stranger's forgery is proven on launch local in make test
def test_forged_records_without_the_run_key_do_not_reach_the_job(job: Job) -> None:
    job.started()
    key = job.key()
    said = job.stranger("--job-name", JOB, "--run-id", job.run_id, "--world", "2")
    assert "forged every record" in said, said + job.out.text[-4000:]
    assert job.out.running, f"launch docker ended during the forgery:\n{job.out.text[-4000:]}"
    last = max(job.out.steps())
    job.out.wait_for(rf"\bstep {last + AFTER}/", timeout=120)  # it trained on, under the watchdog's eye
    code = job.out.finish(300)
    text = job.out.text
    assert code == ExitCode.OK, text[-4000:]
    assert f"step {MAX_STEPS}/" in text and EVIL not in text and key not in text, text[-4000:]
    assert "watchdog: STALL" not in text and "watchdog: LOST" not in text and "straggler rank" not in text, text
    assert job.leftovers() == ""


@pytest.mark.full  # the positive control runs on launch local in make test
def test_the_same_verdict_under_the_run_key_stops_the_job(job: Job) -> None:
    job.started()
    said = job.stranger("--key", job.key())
    assert "under the run's own prefix" in said, said
    code = job.out.finish(120)
    text = job.out.text
    assert code == ExitCode.STALLED, text[-4000:]
    assert f"STALL rank 1 node 1 host {EVIL} pid 1: step 0" in text, text[-4000:]
    assert f"launch docker: the hang watchdog found stalled rank(s): rank 1 (node 1, {EVIL})" in text, text[-4000:]
    assert job.leftovers() == ""
