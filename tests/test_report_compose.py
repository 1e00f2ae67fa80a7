"""`ddpkit report` of a program of the user's own run from the rendered compose
file, on the session's Docker daemon and CPU image (tests/infra/docker_daemon.py):
PyTorch's tutorial-style script (tests/helpers/tutorial_ddp.py, calling nothing
of ddpkit) on 2 nodes. Its records (the preamble's step times, loss and
throughput) stay in each container's records folder, not in `docker compose
logs`, which people read; the report copies them from the containers into the
run folder and draws them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ddpkit import records
from ddpkit.launch.control.applied import compose_cli
from tests.helpers.matrix import DDPKIT, run_ok
from tests.helpers.stop_output import NOISE
from tests.infra import docker_daemon as daemon_infra
from tests.infra.docker_daemon import REPO, Docker

docker_daemon = daemon_infra.docker_daemon  # the session fixture, by its name

JOB = "tutorial-compose"


@pytest.mark.full  # tests/test_report.py::test_a_compose_runs_copied_records_are_drawn
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_users_program_under_compose_is_reported_from_its_containers_records(
        docker_daemon: Docker, tmp_path: Path) -> None:
    assert docker_daemon.image is not None
    spec = {"name": JOB, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "image": docker_daemon.image,
            "command": {"python": "python3", "script": "/repo/tests/helpers/tutorial_ddp.py",
                        "args": ["8", "1000", "--snapshot", "/tmp/snapshot.pt", "--step-sleep", "0.05"]},
            "env": {"OMP_NUM_THREADS": "1"}, "mounts": [f"{REPO / 'tests'}:/repo/tests:ro"]}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = {**docker_daemon.env, "DDPKIT_RUNS_DIR": str(tmp_path / "runs")}
    run_ok([DDPKIT, "render", "compose", "-f", str(job), "-o", str(tmp_path)], env=env)
    compose = [*compose_cli(), "-f", str(tmp_path / "compose.yaml")]
    try:
        up = subprocess.run([*compose, "up", "--no-color", "--exit-code-from", "node0"], env=docker_daemon.env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
        logs = subprocess.run([*compose, "logs", "--no-color"], env=docker_daemon.env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False).stdout
        report = subprocess.run([DDPKIT, "report", JOB], env=env, capture_output=True, text=True, timeout=300,
                                check=False)
    finally:
        subprocess.run([*compose, "down", "--remove-orphans", "--timeout", "5"], env=docker_daemon.env,
                       capture_output=True, check=False, timeout=120)
    assert up.returncode == 0, up.stdout[-6000:] + up.stderr[-3000:]
    # `docker compose logs` as people read it: the program's lines, no record, no torch chatter
    assert re.search(r"^node1-1\s+\| \[GPU1\] Epoch 7 \| Batchsize: 32 \| Steps: 4$", logs, re.M), logs[-6000:]
    for noise in (*NOISE, records.FRAME):
        assert noise not in logs, f"{noise!r} in the logs\n{logs[-6000:]}"
    # the report copied each node's records into the run folder and drew them
    said = report.stdout + report.stderr
    assert report.returncode == 0, said
    found = re.search(r"\((\d+) train and (\d+) step-time records", said)
    assert found and int(found.group(1)) > 0 and int(found.group(2)) > 0, said
    [folder] = (tmp_path / "runs").iterdir()
    # rank 0 sends the metrics (a node whose ranks kept no record has nothing to copy)
    copied = sorted(p.name for p in (folder / "records").glob("*.jsonl"))
    assert copied[0] == "node0.jsonl" and set(copied) <= {"node0.jsonl", "node1.jsonl"}, copied
    kinds = {json.loads(line)["kind"] for line in (folder / "records" / "node0.jsonl").read_text().splitlines()}
    assert {"train", "step_times"} <= kinds, kinds
    assert (folder / "report.html").is_file() and (folder / "report-curves.png").is_file()
