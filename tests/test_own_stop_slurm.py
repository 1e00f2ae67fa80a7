"""Pre-emption of a Hugging Face and a Lightning `Trainer` program on a real
Slurm cluster (2 nodes x 1 process, torchrun mode, gloo on the CPU), with
ddpkit's callback added to each (ddpkit/frameworks): the time limit's
warning (`--signal=B:USR2@N`: SIGUSR2 to the batch shell, sent here with
`scancel --batch --signal=USR2`) reaches every worker through torchrun; every
rank agrees on one optimizer step, the framework saves its own checkpoint
there, rank 0 requeues the job, and the second run resumes from that
checkpoint through the framework's own resume."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from ddpkit import records
from tests.helpers.runs import processes_in
from tests.helpers.stop_output import assert_one_line_per_node
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
HELPERS = ROOT / "tests" / "helpers"
AGREED = r"ddpkit: SIGUSR2: every rank stops after optimizer step (\d+); the program's callback saves and stops"

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(600),
              pytest.mark.root]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


def submit(cluster: SlurmCluster, folder: Path, name: str, script: Path, args: list[str]) -> tuple[Path, int]:
    """Submit the job with the real CLI (`ddpkit submit slurm`, a run folder in the cluster's
    runs folder); the script in `folder` and the job id."""
    folder.mkdir(parents=True)
    spec = {"name": name, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "script": str(script), "args": args},
            "env": {"OMP_NUM_THREADS": "1"}, "preemption": {"checkpoint_s": 20}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    out = cluster.run([sys.executable, "-m", "ddpkit.cli", "submit", "slurm", "-f", str(folder / "job.yaml"),
                       "--dir", str(folder)], cwd=ROOT, timeout=120, env=runs_env(cluster))
    assert out.returncode == 0, out.stdout + out.stderr
    return folder / f"{name}.sbatch", int(out.stdout.split("submitted Slurm job ")[1].split(":")[0])


def runs_env(cluster: SlurmCluster) -> dict[str, str]:
    return {"DDPKIT_RUNS_DIR": str(cluster.workdir / "runs")}


def assert_records_kept_apart_and_reported(cluster: SlurmCluster, script: Path, job: int, text: str) -> None:
    """The output file holds no record; the job's records folder holds the program's
    metrics (its preamble's) and the stop, and `ddpkit report JOB` draws them."""
    assert records.FRAME not in text, text[-6000:]
    kept = records.read_folder(records.slurm_folder(script.parent, script.stem, job))
    kinds = {s.record.kind for s in kept}
    assert {"train", "step_times", "stop"} <= kinds, kinds
    report = cluster.run([sys.executable, "-m", "ddpkit.cli", "report", str(job)], cwd=ROOT, timeout=180,
                         env=runs_env(cluster))
    trained = sum(s.record.kind == "train" for s in kept)
    assert report.returncode == 0 and f"({trained} train and " in report.stdout + report.stderr, \
        report.stdout + report.stderr


def output(script: Path, job: int) -> str:
    path = script.parent / f"{script.stem}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output yet)"


def preempt_when(cluster: SlurmCluster, script: Path, job: int, ready: str, agreed: str = AGREED) -> tuple[int, str]:
    """Once the job printed `ready`, send the time limit's warning; wait for the job's end.
    The agreed step and the whole output."""
    deadline = time.monotonic() + 240
    while ready not in output(script, job):
        assert not cluster.job(job).finished, output(script, job)[-6000:]
        assert time.monotonic() < deadline, f"never saw {ready!r}\n{output(script, job)[-6000:]}"
        time.sleep(0.2)
    sent = cluster.run(["scancel", "--batch", "--signal=USR2", str(job)])
    assert sent.returncode == 0, sent.stderr
    info = cluster.wait(job, timeout=400)
    text = output(script, job)
    assert info.state == "COMPLETED" and info.restarts == 1, f"{info}\n{text[-6000:]}"
    assert f"requeueing Slurm job {job} (scontrol requeue)" in text, text[-6000:]
    assert f"job {job} run 1 " in text and f"job {job} run 2 " in text
    assert processes_in(script.parent) == [], "processes of the job left running"
    found = re.search(agreed, text)
    assert found, text[-6000:]
    assert_one_line_per_node(text, "SIGUSR2")
    assert_records_kept_apart_and_reported(cluster, script, job, text)
    return int(found.group(1)), text


@pytest.mark.full  # a Trainer's stop and resume: test_own_stop.py; pre-emption and requeue on Slurm: test_preempt_slurm.py
def test_a_hugging_face_trainer_is_preempted_requeued_and_resumes_from_its_checkpoint(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job" / "hf-out"
    script, job = submit(cluster, tmp_path / "job", "hf-stop", HELPERS / "hf_trainer.py", [str(out), "30", "stop"])
    step, text = preempt_when(cluster, script, job, "'loss'")
    # the stop's checkpoint, and the one the Trainer writes at the end of training (16 steps an epoch)
    assert {p.name for p in out.glob("checkpoint-*")} == {f"checkpoint-{step}", "checkpoint-480"}, text[-6000:]
    assert f'"global_step": {step}' in (out / f"checkpoint-{step}" / "trainer_state.json").read_text()
    assert f"resuming from {out / f'checkpoint-{step}'}" in text, text[-6000:]
    said = [line for line in text.splitlines() if "ddpkit: this job was requeued by Slurm (restart 1)" in line]
    assert len(said) == 1 and f"checkpoint-{step}" in said[0] and said[0].endswith("it resumes from there"), said


@pytest.mark.full  # a Trainer's stop and resume: test_own_stop.py; pre-emption and requeue on Slurm: test_preempt_slurm.py
def test_a_lightning_trainer_is_preempted_requeued_and_resumes_from_last_ckpt(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    root = tmp_path / "job" / "lt"
    script, job = submit(cluster, tmp_path / "job", "lt-stop", HELPERS / "lightning_trainer.py",
                         [str(root), "60", "2", "stop"])
    step, text = preempt_when(cluster, script, job, "ddpkit watchdog: on for this script")
    last = root / "ckpt" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step
    assert f"Restoring states from the checkpoint path at {last}" in text, text[-6000:]
    said = [line for line in text.splitlines() if "ddpkit: this job was requeued by Slurm (restart 1)" in line]
    assert len(said) == 1 and str(last) in said[0] and said[0].endswith("it resumes from there"), said


@pytest.mark.full  # a program's own stop handler pre-empted and resumed: test_own_stop.py; on Slurm: test_preempt_slurm.py
def test_the_tutorial_script_is_preempted_requeued_resumes_and_its_run_is_reported(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """PyTorch's multi-node tutorial script with its one line of ddpkit (`ddpkit.on_stop`): the
    output file, read as people read it, holds one line per node for the stop and no record, torch
    chatter or traceback; `ddpkit report JOB` draws its step times, loss and throughput."""
    snapshot = tmp_path / "snapshot.pt"
    script, job = submit(cluster, tmp_path / "job", "tutorial-stop", HELPERS / "tutorial_ddp.py",
                         ["60", "1000", "--snapshot", str(snapshot), "--step-sleep", "0.05", "--on-stop"])
    step, text = preempt_when(cluster, script, job, "ddpkit watchdog: on for this script",
                              agreed=r"ddpkit: SIGUSR2: every rank stops after optimizer step (\d+); "
                                     r"the program's stop handlers run before the next one")
    print(f"TUTORIAL-PREEMPTED {len(text.splitlines())} lines\n{text}")
    assert sorted(re.findall(rf"^(\d+): stop handler ran after step {step}$", text, re.MULTILINE)) == ["0", "1"], \
        text[-6000:]
    assert re.search(r"^\d+: Resuming training from snapshot at Epoch \d+$", text, re.MULTILINE), text[-6000:]
