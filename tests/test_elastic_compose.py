"""An elastic job in the rendered compose file, on the session's Docker
daemon and CPU image (tests/infra/docker_daemon.py): 3 services (nodes),
min_nodes 2, and the rendezvous store in a service of its own (rdzv), run as
the file's header says (`up -d`, `wait` for every node, `down`). Right after
the 3-node world's first checkpoint (tests/helpers/elastic_gate.py, the
repo's tests bind-mounted into the image) a node's container is lost:

- node 2 paused (`docker pause`: every process in it frozen by the cgroup
  freezer, its connections open, nothing answers): the two others must
  notice it by its heartbeats within watchdog.loss_s (the `lost` record says
  so, no stall is declared), re-form without it and finish with world size
  2, resumed from the held checkpoint. A paused container never exits, so
  `wait` would wait on it: the test waits for the two others, and `ddpkit
  status` says the job finished and names the paused one left;
- node 0 killed (`docker kill`: SIGKILL to every process in it, connections
  closed; Docker leaves a container killed by hand down): node 0 held no
  store, so the two others re-form at once and finish, and `wait` returns
  their code, 0.

`down` leaves nothing of the job on the daemon. `ddpkit logs RUN`, and
`--follow` started right after `up`, show each container's lines as `docker
compose logs` has them, behind the console's node prefix (the backend's
log_iter).

Also here, as it needs the same daemon and image: bench/elastic.py's compose
target, smoke-sized (tests/test_bench_smoke.py says what a smoke test asserts).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from ddpkit import records as records_
from ddpkit.launch.control.applied import compose_cli
from tests.helpers.elastic_gate import GATE_DIR, GATE_WORLD, held_step, release
from tests.helpers.matrix import DDPKIT, run_ok
from tests.helpers.stop_output import NOISE
from tests.helpers.tiers import one_case_in_ci
from tests.infra import docker_daemon as daemon_infra
from tests.infra.docker_daemon import REPO, Docker
from tests.test_bench_smoke import run_bench

if TYPE_CHECKING:
    from docker.models.containers import Container

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name
pytestmark = [pytest.mark.root, pytest.mark.slow]

JOB = "elastic-compose-test"  # the compose project: its containers are named and labelled by it
LOST = {"paused": 2, "killed": 0}  # any node may go: the store is the rdzv service's
LOSS_S = 10  # watchdog.loss_s's default
TRAIN = ["--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain", "--synthetic-size", "96",
         "--batch-size", "4", "--epochs", "2", "--no-eval", "--device", "cpu", "--backend", "gloo", "--lr", "0.05",
         "--base-batch", "8", "--seed", "0", "--checkpoint-every", "4", "--keep", "100", "--resume", "auto",
         "--log-every", "1"]


def write_job(folder: Path, image: str) -> Path:
    """The job as a user writes it (the defaults for loss_s and the rendezvous
    timings); the gate module comes from the repo's tests, mounted read-only."""
    spec = {
        "name": JOB, "nodes": 3, "nproc_per_node": 1, "device": "cpu", "backend": "gloo", "image": image,
        "rendezvous": {"timeout_s": 120},
        "elastic": {"min_nodes": 2, "max_restarts": 2},
        "command": {"python": "python3", "module": "tests.helpers.elastic_gate",
                    "args": [*TRAIN, "--checkpoint-dir", "/job/ckpt", "--metrics", "/job/metrics.jsonl"]},
        "env": {"PYTHONPATH": "/repo", "OMP_NUM_THREADS": "1", GATE_DIR: "/job/gate", GATE_WORLD: "3"},
        "mounts": [f"{REPO / 'tests'}:/repo/tests:ro", f"{folder / 'job'}:/job"],
    }
    (folder / "job" / "gate").mkdir(parents=True)
    path = folder / "elastic.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class Compose:
    """docker compose on the rendered file, as its header says to run it."""

    def __init__(self, docker: Docker, folder: Path, project: str = JOB) -> None:
        from docker.client import DockerClient

        self.docker, self.folder, self.project = docker, folder, project
        self.argv = [*compose_cli(), "-f", str(folder / "compose.yaml")]
        # state polls through the API: a CLI process per poll would cost a loaded machine's CPU
        self.client = DockerClient(base_url=docker.host)

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.argv, *args], env=self.docker.env, cwd=self.folder, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def container(self, service: str) -> Container:
        [container] = self.client.containers.list(all=True, filters={
            "label": [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]})
        return container

    def state(self, service: str) -> dict[str, Any]:
        return dict(self.container(service).attrs["State"])

    def exited(self, service: str, timeout: float) -> None:
        """Wait until the service's container has stopped (the daemon's own wait; raises after `timeout` s)."""
        self.container(service).wait(timeout=timeout)

    def ended(self) -> str | None:
        """Why waiting for the gate is pointless (node 0 exited), or None."""
        state = self.state("node0")
        return None if state["Running"] else f"node0 exited {state['ExitCode']}\n{self.logs('--timestamps')[-4000:]}"

    def logs(self, *flags: str) -> str:
        return self("logs", "--no-color", *flags).stdout

    def left(self) -> list[str]:
        """Containers and networks of the project still on the daemon."""
        label = {"label": f"com.docker.compose.project={self.project}"}
        return [str(c.name) for c in self.client.containers.list(all=True, filters=label)] + [
            str(n.name) for n in self.client.networks.list(filters=label)]


def as_ddpkit_logs_shows(raw: str) -> list[str]:
    """`docker compose logs` (`node1-1  | text`) as `ddpkit logs` shows it: a
    batch per service, the store's first, each line behind its node's prefix,
    with the rank where torchrun tagged it (`[rank1]:text`: `[node1 rank1] text`)."""
    by_service: dict[str, list[str]] = {}
    for line in raw.splitlines():
        found = re.match(r"^(\w+)-\d+\s+\| ?(.*)$", line)
        assert found, line
        service, text = found.groups()
        tagged = re.match(r"^\[rank(\d+)\]:(.*)$", text) if service.startswith("node") else None
        shown = f"[{service} rank{tagged.group(1)}] {tagged.group(2)}" if tagged else f"[{service}] {text}"
        by_service.setdefault(service, []).append(shown)
    order = sorted(by_service, key=lambda s: int(s[4:]) if s.startswith("node") else -1)
    return [line for service in order for line in by_service[service]]


def by_prefix(lines: list[str]) -> dict[str, list[str]]:
    """Each service's lines, in their order (`[node1] text` -> node1)."""
    out: dict[str, list[str]] = {}
    for line in lines:
        out.setdefault(line[1:line.index("]")], []).append(line)
    return out


def assert_logs_show_the_containers_lines(raw: str, shown: str, followed: str | None = None) -> None:
    """`ddpkit logs RUN` of a compose run: every node's lines as `docker
    compose logs` has them, with the console's node prefix, a node after
    another; `--follow`: each node's the same, interleaved as they came. The
    store's service may have said more since (its last line as it ends)."""
    assert records_.FRAME not in raw
    expected = as_ddpkit_logs_shows(raw)
    nodes = [line for line in expected if not line.startswith("[rdzv]")]
    assert len(nodes) > 10, expected
    for text in (shown, followed):
        if text is None:
            continue
        got = text.splitlines()
        if text is shown:
            assert [line for line in got if not line.startswith("[rdzv]")] == nodes, (text[-3000:], nodes[-30:])
        want, have = by_prefix(expected), by_prefix(got)
        store, said = have.pop("rdzv", []), want.pop("rdzv", [])
        assert have == want, (text[-3000:], nodes[-30:])
        assert store[:len(said)] == said or said[:len(store)] == store, (store, said)


def records(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "job" / "metrics.jsonl").read_text().splitlines()]


def first_step_after(recs: list[dict[str, Any]], since: dict[str, Any]) -> float:
    """Wall-clock time of the survivors' first step after their resume (at or after the record `since`)."""
    resume = next(i for i in range(recs.index(since), len(recs)) if recs[i]["kind"] == "resume")
    return float(next(r for r in recs[resume:] if r["kind"] == "train")["time"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss", one_case_in_ci(["paused", "killed"], keep="paused"))
def test_the_job_finishes_on_the_two_that_remain(docker_daemon: Docker, tmp_path: Path, loss: str) -> None:
    assert docker_daemon.image is not None
    job = write_job(tmp_path, docker_daemon.image)
    env = {**docker_daemon.env, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")}
    run_ok([DDPKIT, "render", "compose", "-f", str(job), "-o", str(tmp_path)], env=env)
    header = (tmp_path / "compose.yaml").read_text()
    assert ("# Run: docker compose -f compose.yaml up -d && docker compose -f compose.yaml wait node0 node1 node2; "
            "docker compose -f compose.yaml down") in header
    compose = Compose(docker_daemon, tmp_path)
    gate = tmp_path / "job" / "gate"
    lost_node = LOST[loss]
    survivors = [f"node{i}" for i in range(3) if i != lost_node]
    follow: subprocess.Popen[str] | None = None
    try:
        up = compose("up", "-d", "--no-color", timeout=300)
        assert up.returncode == 0, up.stderr
        follow = subprocess.Popen([DDPKIT, "logs", JOB, "--follow"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        step = held_step(gate, 3, compose.ended)
        lost = compose.container(f"node{lost_node}")
        if loss == "paused":
            lost.pause()  # docker pause
        else:
            lost.kill()  # docker kill: SIGKILL
        lost_at = time.time()
        release(gate, 3)
        if loss == "killed":
            waited = compose("wait", "node0", "node1", "node2", timeout=420)  # as the header says
        else:
            for node in survivors:  # the paused one never exits: `wait` would wait on it
                compose.exited(node, timeout=420)
        ended = {node: compose.state(node) for node in survivors}
        output = compose.logs("--timestamps")
        raw = compose.logs()
        status = run_ok([DDPKIT, "status", JOB], env=env)
        shown = run_ok([DDPKIT, "logs", JOB], env=env)
        followed, follow_err = follow.communicate(timeout=120)  # it ends once `ddpkit status` would say finished
    finally:
        if follow is not None and follow.poll() is None:
            follow.kill()
            follow.communicate()
        down = compose("down", "--remove-orphans", "--timeout", "5", timeout=180)
    said = output[-6000:]
    if loss == "killed":
        # `wait` waits for the containers still running (node 0 was gone by then) and returns the last one's code
        assert waited.returncode == 0, waited.stdout + waited.stderr + said
        assert waited.stdout.count("exited with status code 0") == 2, waited.stdout
    assert all(s["ExitCode"] == 0 and not s["Running"] for s in ended.values()), (ended, said)
    assert down.returncode == 0 and compose.left() == [], down.stderr
    # `ddpkit status`: a node that exited 0 ends an elastic job well; what is still there is named
    assert re.search(r"^run \w{6}: finished, exit code 0$", status, re.M), status
    where = " ".join(status.split())  # the line may wrap at the console's width
    if loss == "paused":
        assert ("rdzv running, node0 exited (0), node1 exited (0), node2 paused (docker compose); "
                "rdzv, node2 left: ") in where, status
    else:
        assert ("rdzv running, node0 exited (137), node1 exited (0), node2 exited (0) (docker compose); "
                "rdzv left: ") in where, status
    # the two others re-formed without the lost node and went on from the held checkpoint with world size 2
    assert f"ckpt-{step:08d}.pt at step {step}" in output, said
    # `docker compose logs` as people read it: the nodes' records stayed in their containers
    # (DDPKIT_RECORDS), none framed among the lines, the lost node's verdict included
    for noise in (*NOISE, records_.FRAME):  # nor a traceback or torch chatter of the survivors' re-forming
        assert noise not in output, f"{noise!r} in the logs\n{said}"
    assert re.search(r"elastic: restart \d of at most 2; world size 3 -> 2", output), said
    assert follow.returncode == 0, follow_err
    assert_logs_show_the_containers_lines(raw, shown, followed)
    recs = records(tmp_path)
    assert not [r for r in recs if r["kind"] == "stall"], recs
    assert recs[-1]["kind"] == "summary", recs[-3:]  # rank 0 of the 2-node world ended the run
    resume = next(r for r in recs if r["kind"] == "resume" and r["time"] > lost_at)
    took = first_step_after(recs, resume) - lost_at
    print(f"{loss} node {lost_node}: {took:.1f}s from the loss to the others' first step")
    if loss == "paused":
        # found by its heartbeats (kept in the rdzv service's store), not by a collective timing out (30 min)
        [record] = [r for r in recs if r["kind"] == "lost"]
        assert {r["node"] for r in record["lost"]} == {lost_node} and record["action"] == "re-form", record
        assert record["noticed_by"] == "heartbeat" and record["loss_s"] == LOSS_S, record
        assert took < LOSS_S + 290, took


@pytest.mark.full  # the benches' longer smokes: make test-full
@pytest.mark.timeout(600)
def test_the_recovery_bench_times_a_container_cut_off_its_network(docker_daemon: Docker, tmp_path: Path) -> None:
    """bench/elastic.py on compose: node 2's container disconnected from the job's network (the
    link kind; the tests above pause and kill it), ddpkit's fast path."""
    assert docker_daemon.image is not None
    run_bench("bench.elastic", "--targets", "compose", "--losses", "link", "--variants", "ddpkit-fast",
              "--repeats", "1", "--samples", "1600", "--checkpoint-every", "4", "--image", docker_daemon.image,
              "--out", str(tmp_path), env=docker_daemon.env)
    data = json.loads((tmp_path / "elastic.json").read_text())
    (run,) = data["runs"]
    assert (run["target"], run["variant"], run["loss"]) == ("compose", "ddpkit-fast", "link"), run
    assert run["loss_to_first_step_s"] > 0 and 0 <= run["steps_lost"] <= run["killed_at_step"], run
    assert run["restart_s"]["to new workers"] > 0, run
    assert not data["skipped"] and data["medians"]["compose"]["link"]["ddpkit-fast"]["runs"] == 1, data
    assert subprocess.run(["docker", "ps", "-a", "-q", "--filter", "label=com.docker.compose.project=bench"],
                          env=docker_daemon.env, capture_output=True, text=True, check=True).stdout == ""
