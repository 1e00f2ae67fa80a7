"""A stranger on the network of a rendered compose job (the shared Docker
daemon, the CPU image), run as the file's header says: `export
DDPKIT_RUN_KEY=...` in the shell, then `docker compose up -d`. While 2
services x 1 process of `ddpkit train` train, a container of its own on the
project's network opens node0's master port and forges ddpkit's control
records under every prefix it could derive: node0 trains to its last step
and exits 0. The same verdict under the run's own prefix (the key the shell
exported) stops the job: node0 reports the forged stall and fails."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from ddpkit.launch.control.applied import compose_cli
from ddpkit.rendezvous import runkey
from tests.helpers.store_stranger import EVIL, in_container
from tests.infra.docker_daemon import REPO, Docker, docker_daemon  # noqa: F401  (fixture)

if TYPE_CHECKING:
    from docker.models.containers import Container

JOB = "compose-attack-test"  # the compose project: its containers and network are named by it
PORT = 29500  # node0's master port (compose's default), published nowhere
STEP_S, MAX_STEPS, STALL_S = 0.3, 80, 6
AFTER = 20  # steps node0 must make after the forgeries: STEP_S x AFTER is at least STALL_S
TRAIN = ["--model", "tests.helpers.stall_models:paced", "--image-size", "8", "--workers", "0", "--progress", "plain",
         "--log-every", "1", "--data", "synthetic", "--batch-size", "4", "--synthetic-size", "100000",
         "--no-eval", "--max-steps", str(MAX_STEPS)]
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(400)]


class Compose:
    """The rendered job under docker compose, started with a fresh run key in its shell."""

    def __init__(self, docker: Docker, folder: Path) -> None:
        from docker.client import DockerClient

        spec = {"name": JOB, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
                "image": docker.image, "watchdog": {"stall_s": STALL_S},
                "command": {"python": "python3", "module": "ddpkit.train", "args": TRAIN},
                "env": {"PYTHONPATH": "/repo", "STALL_TEST_STEP_S": str(STEP_S)},
                "mounts": [f"{REPO / 'tests'}:/repo/tests:ro"]}
        (folder / "job.yaml").write_text(yaml.safe_dump(spec))
        subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "compose", "-f", str(folder / "job.yaml"),
                        "-o", str(folder)], check=True, capture_output=True, cwd=REPO)
        self.docker, self.folder, self.key = docker, folder, runkey.new_key()
        self.client = DockerClient(base_url=docker.host)  # logs and state through the API, not a CLI per poll
        up = self("up", "-d")
        assert up.returncode == 0, up.stdout + up.stderr

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """docker compose in a shell that exported the run key, as the file's header says."""
        return subprocess.run([*compose_cli(), "-f", str(self.folder / "compose.yaml"), *args],
                              env={**self.docker.env, runkey.ENV: self.key}, cwd=self.folder, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def node0(self) -> Container:
        [container] = self.client.containers.list(all=True, filters={
            "label": [f"com.docker.compose.project={JOB}", "com.docker.compose.service=node0"]})
        return container

    def logs(self) -> str:
        return bytes(self.node0().logs()).decode(errors="replace")

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while max((int(s) for s in re.findall(r"\bstep (\d+)/", self.logs())), default=-1) < step:
            state = self.node0().attrs["State"]
            assert state["Running"] and time.monotonic() < deadline, \
                f"node0 never reached step {step} (exit {state['ExitCode']}):\n{self.logs()[-4000:]}"
            time.sleep(0.5)

    def steps(self) -> int:
        return max(int(s) for s in re.findall(r"\bstep (\d+)/", self.logs()))

    def stranger(self, *argv: str) -> str:
        """The stranger's client, in a container of its own on the project's network."""
        return in_container(self.docker.env, str(self.docker.image), f"{JOB}_ddpnet",
                            f"com.docker.compose.project={JOB}", "node0", str(PORT), *argv)

    def exit_code(self, timeout: float) -> int:
        return int(self.node0().wait(timeout=timeout)["StatusCode"])

    def left(self) -> list[str]:
        label = {"label": f"com.docker.compose.project={JOB}"}
        return [str(c.name) for c in self.client.containers.list(all=True, filters=label)] + [
            str(n.name) for n in self.client.networks.list(filters=label)]


@pytest.fixture
def compose(docker_daemon: Docker, tmp_path: Path) -> Iterator[Compose]:  # noqa: F811  (the imported fixture)
    job = Compose(docker_daemon, tmp_path)
    try:
        yield job
    finally:
        down = job("down", "--timeout", "2")
        assert down.returncode == 0, down.stderr
        assert job.left() == []


@pytest.mark.full  # a stranger's forgery is proven on launch local in make test
def test_forged_records_without_the_run_key_do_not_reach_the_job(compose: Compose) -> None:
    compose.wait_for_step(3)  # the watchdog is up and every rank has published
    said = compose.stranger("--job-name", JOB, "--world", "2")
    assert "forged every record" in said, said + compose.logs()[-4000:]
    compose.wait_for_step(compose.steps() + AFTER, timeout=120)  # it trains on, under the watchdog's eye
    code = compose.exit_code(300)
    logs = compose.logs()
    assert code == 0, logs[-4000:]
    assert f"step {MAX_STEPS}/" in logs and EVIL not in logs and compose.key not in logs, logs[-4000:]
    assert "watchdog: STALL" not in logs and "watchdog: LOST" not in logs and "straggler rank" not in logs


@pytest.mark.full  # the positive control runs on launch local in make test
def test_the_same_verdict_under_the_run_key_stops_the_job(compose: Compose) -> None:
    compose.wait_for_step(3)
    said = compose.stranger("--key", compose.key)
    assert "under the run's own prefix" in said, said
    code = compose.exit_code(120)
    logs = compose.logs()
    assert code != 0, logs[-4000:]
    assert f"STALL rank 1 node 1 host {EVIL} pid 1: step 0" in logs, logs[-4000:]
