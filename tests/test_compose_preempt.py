"""A pre-emption of a job run from the rendered compose file, on the
session's Docker daemon and CPU image (tests/infra/docker_daemon.py):
`docker compose stop` mid-run (SIGTERM to each container's agent, then the
file's stop_grace_period before a SIGKILL), for ddpkit train and for a
program of the user's own with `ddpkit.on_stop` (PyTorch's tutorial-style
script, tests/helpers/tutorial_ddp.py). Then `docker compose logs` as a user
reads it: no record frame, no traceback of the normal stop, no torch
chatter; one line per node from its agent (its worker checkpointed and
exited 75), the program's own lines and its stop lines; the checkpoint
written at the agreed step; `ddpkit status RUN` says the job was stopped,
and where its checkpoint is, from the records it copies from the containers;
and `ddpkit logs RUN` shows the same lines behind the console's node prefix."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddpkit import records
from tests.helpers.matrix import DDPKIT, run_ok
from tests.helpers.stop_output import NOISE
from tests.helpers.tiers import one_case_in_ci
from tests.infra import docker_daemon as daemon_infra
from tests.infra.docker_daemon import REPO, Docker
from tests.test_elastic_compose import Compose, assert_logs_show_the_containers_lines

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name
pytestmark = [pytest.mark.root, pytest.mark.slow]

JOB = "preempt-compose"
TRAIN = ["--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain", "--synthetic-size", "96",
         "--batch-size", "4", "--epochs", "1000", "--no-eval", "--device", "cpu", "--backend", "gloo",
         "--checkpoint-dir", "/job/ckpt", "--metrics", "/job/metrics.jsonl", "--log-every", "1"]
COMMANDS = {
    "train": {"python": "python3", "args": TRAIN},
    "own": {"python": "python3", "script": "/repo/tests/helpers/tutorial_ddp.py",
            "args": ["100000", "100000", "--step-sleep", "0.05", "--on-stop", "--snapshot", "/job/snap.pt"]},
}
# The program is under way on each node (its second epoch), or rank 0 (which alone prints ddpkit train's steps) is
READY = {"own": {0: r"\[GPU0\] Epoch 1 \|", 1: r"\[GPU1\] Epoch 1 \|"}, "train": {0: r"^step (?:[3-9]\d|\d{3,})/"}}
# What rank 0 says when the ranks agreed to stop: the step it names
AGREED = {"own": r"^node0-1\s+\| ddpkit: SIGTERM: every rank stops after optimizer step (\d+); "
                 r"the program's stop handlers run before the next one$",
          "train": r"^node0-1\s+\| .*stop signal received: checkpointing at step (\d+) and exiting with 75$"}
READY_S = 300  # two containers' start, torch's import and the rendezvous on a loaded 2-core machine
STOP_S = 240  # `docker compose stop`: the stop grace period is 90 s per container, stopped at once


def write_job(folder: Path, image: str, program: str) -> Path:
    spec = {"name": JOB, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo", "image": image,
            "command": COMMANDS[program], "env": {"OMP_NUM_THREADS": "1"},
            "mounts": [f"{REPO / 'tests'}:/repo/tests:ro", f"{folder / 'job'}:/job"]}
    (folder / "job").mkdir()
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def wait_until_training(compose: Compose, program: str) -> None:
    deadline = time.monotonic() + READY_S
    for node, pattern in READY[program].items():
        ready = re.compile(pattern, re.M)
        while not ready.search(compose.container(f"node{node}").logs().decode(errors="replace")):
            assert compose.ended() is None, compose.ended()
            assert time.monotonic() < deadline, f"node{node} not training within {READY_S} s\n" \
                                                f"{compose.logs()[-6000:]}"
            time.sleep(1)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("program", one_case_in_ci(["own", "train"], keep="own"))  # ~16 s each on an idle machine
def test_a_stopped_compose_job_reads_as_one_line_per_node(docker_daemon: Docker, tmp_path: Path,
                                                          program: str) -> None:
    assert docker_daemon.image is not None
    job = write_job(tmp_path, docker_daemon.image, program)
    env = {**docker_daemon.env, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")}
    run_ok([DDPKIT, "render", "compose", "-f", str(job), "-o", str(tmp_path)], env=env)
    compose = Compose(docker_daemon, tmp_path, JOB)
    try:
        up = compose("up", "-d", "--no-color", timeout=300)
        assert up.returncode == 0, up.stderr
        wait_until_training(compose, program)
        started = time.monotonic()
        stop = compose("stop", timeout=STOP_S)  # as a user stops it: SIGTERM, the file's grace, then SIGKILL
        took = time.monotonic() - started
        ended = {node: compose.state(f"node{node}") for node in (0, 1)}
        raw = compose.logs()
        status = run_ok([DDPKIT, "status", JOB], env=env)
        shown = run_ok([DDPKIT, "logs", JOB], env=env)
    finally:
        down = compose("down", "--remove-orphans", "--timeout", "5", timeout=180)
    said = raw[-6000:]
    assert stop.returncode == 0, stop.stderr
    assert down.returncode == 0 and compose.left() == [], down.stderr
    print(f"compose stop of {program}: {took:.1f} s; exit codes {[s['ExitCode'] for s in ended.values()]}")
    # `docker compose logs` as people read it: no record, no traceback of the stop, no torch chatter
    for noise in (*NOISE, records.FRAME, "failed (exitcode"):
        assert noise not in raw, f"{noise!r} in the logs\n{said}"
    # one line from each node's agent: its worker checkpointed and exited 75
    agents = re.findall(r"^node(\d)-1\s+\| ddpkit\.agent: node (\d): SIGTERM: its worker stopped \(exit 75\)$",
                        raw, re.M)
    assert sorted(agents) == [("0", "0"), ("1", "1")], said
    # rank 0 named the agreed step, and the checkpoint there is the program's own
    agreed = re.search(AGREED[program], raw, re.M)
    assert agreed, said
    step = int(agreed.group(1))
    if program == "own":
        ran = re.findall(r"^node(\d)-1\s+\| stop handler ran after step (\d+)$", raw, re.M)
        assert sorted(ran) == [("0", str(step)), ("1", str(step))], said
        assert torch.load(tmp_path / "job" / "snap.pt", map_location="cpu")["STEP"] == step
        assert re.search(r"^node1-1\s+\| \[GPU1\] Epoch 1 \| Batchsize: 32 \| Steps: 4$", raw, re.M), said
    else:
        assert (tmp_path / "job" / "ckpt" / f"ckpt-{step:08d}.pt").is_file(), sorted((tmp_path / "job").rglob("*"))
    # each container stopped of itself within the grace (a SIGKILL would read 137), with the agent's
    # code for a stop its workers checkpointed on, 75 (docs/DESIGN-NOTES.md, the grace chain)
    assert all(not s["Running"] and s["ExitCode"] == 75 and not s["OOMKilled"] for s in ended.values()), ended
    # `ddpkit status`: docker compose's codes, and what the records copied from the containers say of the stop
    assert re.search(r"^run \w{6}: cancelled, exit code 75$", status, re.M), status
    assert (f"where stopped by SIGTERM at step {step}, checkpoint at step {step}; node0 exited (75), node1 exited (75) "
            "(docker compose)") in " ".join(status.split()), status
    assert_logs_show_the_containers_lines(raw, shown)
