"""Pre-emption on a real Slurm cluster, in both modes, with the real `ddpkit
train` (tiny model, synthetic data, gloo on the CPU, 2 nodes x 1 process).

The job gets what `--signal=B:USR2@N` delivers before the time limit:
SIGUSR2 to the batch shell only (`scancel --batch --signal=USR2`), mid-run.
The test then checks the cause, not only the outcome:
(a) the checkpoint was written because of the signal: the trainer's stop
    path alone writes the `stop` record (signal, step, checkpoint), and the
    uninterrupted run has none;
(b) the job was requeued (Restarts=1, a second run in the same output);
(c) the second run resumed at exactly the stopped step (its `resume` record);
(d) its final parameters are bitwise identical to the uninterrupted run's
    (two ranks: a sum of two floats does not depend on order, so gloo's
    all-reduce is reproducible and any difference is the resume's fault).
srun hands the signal to every process of the step, torchrun's workers
included; in torchrun mode the agent must forward it and wait for them
(contract.stop_args): with torchrun's default signal list the agent dies of
it (`task N: User defined signal 2`), and srun's --kill-on-bad-exit then
kills every rank, mid-checkpoint whenever a checkpoint takes longer than
this tiny model's. Replaces the two pre-emption tests of test_slurm_real.py,
which passed on that path without checking why a checkpoint was written.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from ddpkit import records
from tests.helpers.runs import assert_bitwise_equal, final_model, metrics, processes_in
from tests.helpers.stop_output import assert_one_line_per_node
from tests.helpers.tiers import one_case_in_ci
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(600),
              pytest.mark.root]

STEPS_PER_EPOCH, EPOCHS = 200, 4  # 1600 samples / 2 ranks / batch 4
TOTAL = STEPS_PER_EPOCH * EPOCHS
SIGNAL_AFTER = 10  # steps: the trainer's handlers are installed and training runs


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
        yield c


@dataclass
class Run:
    """One submitted job: its script, id, checkpoint folder and metrics file."""

    cluster: SlurmCluster
    script: Path
    job: int

    @property
    def folder(self) -> Path:
        return self.script.parent

    @property
    def records(self) -> list[dict]:
        return metrics(self.folder / "metrics.jsonl")

    def output(self) -> str:
        path = self.folder / f"{self.script.stem}-{self.job}.out"
        return path.read_text(errors="replace") if path.exists() else "(no output yet)"

    def kinds(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]

    def finish(self) -> slurm_cluster.JobInfo:
        info = self.cluster.wait(self.job, timeout=400)
        assert info.state == "COMPLETED", f"{info}\n{self.output()[-6000:]}"
        assert processes_in(self.folder) == [], "processes of the job left running"
        return info

    def model(self) -> dict[str, torch.Tensor]:
        return final_model(self.folder / "ckpt")


def submit(cluster: SlurmCluster, folder: Path, name: str, mode: str) -> Run:
    """Submit the job with the real CLI, as a user would (`ddpkit submit slurm`: a run folder
    under the module's runs folder, the script and the output file in `folder`)."""
    folder.mkdir(parents=True)
    args = ["--model=tiny", "--image-size=8", "--workers=0", "--progress=plain",
            "--data=synthetic", "--synthetic-size=1600", "--batch-size=4", f"--epochs={EPOCHS}", "--no-eval",
            "--log-every=1", f"--checkpoint-dir={folder / 'ckpt'}", f"--metrics={folder / 'metrics.jsonl'}",
            "--resume=auto"]
    spec = {"name": name, "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "module": "ddpkit.train", "args": args},
            # one thread: the same float results in either mode
            "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            "slurm": {"mode": mode}, "preemption": {"checkpoint_s": 20}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    out = cluster.run([sys.executable, "-m", "ddpkit.cli", "submit", "slurm", "-f", str(folder / "job.yaml"),
                       "--dir", str(folder)], cwd=ROOT, timeout=120, env=runs_env(cluster))
    assert out.returncode == 0, out.stdout + out.stderr
    job = int(out.stdout.split("submitted Slurm job ")[1].split(":")[0])
    return Run(cluster, folder / f"{name}.sbatch", job)


def runs_env(cluster: SlurmCluster) -> dict[str, str]:
    """One runs folder per cluster (module): `ddpkit status JOB` finds the job's run there."""
    return {"DDPKIT_RUNS_DIR": str(cluster.workdir / "runs")}


def assert_read_as_people_read_it(run: Run, text: str, agents: bool) -> None:
    """The job's output file, as `tail -f` shows it, holds no record: each node
    wrote its records to its own file in the job's records folder instead, where
    `ddpkit status` reads the stop back (signal, step, checkpoint). torch's stop
    lines, off the output, are in each node's log there (`agents`: torchrun mode)."""
    assert records.FRAME not in text, text[-6000:]
    folder = records.slurm_folder(run.folder, run.script.stem, run.job)
    if agents:
        for node in ("node1", "node2"):
            kept = (folder / f"{node}.log").read_text()
            assert "torch, on the stop" in kept and "death signal" in kept, kept
    kept = records.read_folder(folder)
    stops = [s.record for s in kept if isinstance(s.record, records.Stop)]
    assert stops and all(s.time is not None for s in kept), sorted(p.name for p in folder.glob("*"))
    status = run.cluster.run([sys.executable, "-m", "ddpkit.cli", "status", str(run.job)], cwd=ROOT,
                             env=runs_env(run.cluster))
    assert status.returncode == 0, status.stdout + status.stderr
    for stop in stops:
        saved = f"checkpoint at step {stop.step}" if stop.checkpoint else "no checkpoint"
        line = f"stopped   run {stop.slurm_restart_count + 1}: {stop.signal} at step {stop.step}, {saved}"
        assert line in status.stdout, status.stdout


@pytest.fixture(scope="module")
def reference(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted job (srun mode; the two modes train the same ranks on
    the same samples). Submitted once, awaited by each test after its own job
    was signalled, so it runs alongside the first pre-empted job."""
    return submit(cluster, tmp_path_factory.mktemp("ref") / "job", "ref", "srun")


def wait_for_step(run: Run, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in run.kinds("train")):
        info = run.cluster.job(run.job)
        assert not info.finished, f"{info}\n{run.output()[-6000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s\n{run.output()[-6000:]}"
        time.sleep(0.2)


@pytest.mark.parametrize("mode", one_case_in_ci(["torchrun", "srun"], keep="torchrun"))
def test_preempted_job_checkpoints_on_the_signal_requeues_and_resumes_bitwise(
        cluster: SlurmCluster, tmp_path: Path, reference: Run, mode: str) -> None:
    run = submit(cluster, tmp_path / "job", f"pre-{mode}", mode)
    wait_for_step(run, SIGNAL_AFTER)
    signalled = time.time()
    sent = cluster.run(["scancel", "--batch", "--signal=USR2", str(run.job)])
    assert sent.returncode == 0, sent.stderr
    info = run.finish()
    done = time.time()
    text = run.output()

    # (a) the stop path wrote the checkpoint, at the step it names
    (stop,) = run.kinds("stop")
    assert stop["signal"] == "SIGUSR2" and stop["slurm_restart_count"] == 0, stop
    stopped = stop["step"]
    assert SIGNAL_AFTER <= stopped < TOTAL, f"stopped at {stopped}: the signal did not land mid-run"
    assert stop["checkpoint"] == str(run.folder / "ckpt" / f"ckpt-{stopped:08d}.pt")
    first_run = run.records[:run.records.index(next(r for r in run.records if r["kind"] == "stop"))]
    assert [r["step"] for r in first_run if r["kind"] == "checkpoint"] == [stopped]  # no other checkpoint first
    assert "batch shell got SIGUSR2" in text
    # srun hands the signal to every process of the step (its proctrack), workers included; what
    # torchrun's flag changes is the agent: it forwards SIGUSR2 and waits for the workers instead
    # of dying of it, which --kill-on-bad-exit would turn into a SIGKILL of every rank.
    assert "User defined signal 2" not in text, text[-6000:]
    assert_one_line_per_node(text, "SIGUSR2" if mode == "torchrun" else None)
    assert_read_as_people_read_it(run, text, agents=mode == "torchrun")

    # (b) requeued: a second run of the same job
    assert info.restarts == 1, info
    assert f"requeueing Slurm job {run.job} (scontrol requeue)" in text, text[-6000:]
    assert f"job {run.job} run 1 " in text and f"job {run.job} run 2 " in text

    # (c) the second run resumed at exactly the stopped step, after the stop
    (resume,) = run.kinds("resume")
    assert resume["step"] == stopped and resume["checkpoint"].endswith(f"ckpt-{stopped:08d}.pt"), resume
    assert run.records.index(resume) > run.records.index(stop)
    assert [r["status"] for r in run.kinds("summary")][-1] == "finished"
    assert run.kinds("summary")[-1]["steps"] == TOTAL
    print(f"PREEMPT-TIMING slurm {mode}: signal -> stop record {stop['time'] - signalled:.1f} s, "
          f"-> resumed {resume['time'] - signalled:.1f} s, -> job completed {done - signalled:.1f} s")

    # (d) the same parameters as the job nobody interrupted
    reference.finish()
    assert reference.kinds("stop") == [] and reference.kinds("resume") == []
    normal = reference.output()  # a run nobody stopped, as people read it: ddpkit's lines, no record, no chatter
    assert records.FRAME not in normal and "ddpkit train finished: 800 steps" in normal, normal[-6000:]
    assert_one_line_per_node(normal, None)
    assert [r["steps"] for r in reference.kinds("summary")] == [TOTAL]
    assert_bitwise_equal(reference.model(), run.model())


def test_a_users_scancel_cancels_the_job_it_does_not_requeue_it(cluster: SlurmCluster, tmp_path: Path) -> None:
    """`scancel JOB` (SIGTERM to the batch shell and the step) must end the job: the trainer still
    checkpoints on SIGTERM, but requeues only after preemption.signal (USR2 here). Before, it ran
    `scontrol requeue` on any stop signal and the cancelled job came back and trained to the end."""
    run = submit(cluster, tmp_path / "job", "cancelled", "torchrun")
    wait_for_step(run, SIGNAL_AFTER)
    cancelled = cluster.run(["scancel", str(run.job)])
    assert cancelled.returncode == 0, cancelled.stderr
    info = run.cluster.wait(run.job, timeout=300)
    text = run.output()
    assert info.state == "CANCELLED" and info.restarts == 0, f"{info}\n{text[-6000:]}"
    # it stopped because of the signal: the trainer's stop path wrote the stop record, and said why it did not requeue
    (stop,) = run.kinds("stop")
    assert stop["signal"] == "SIGTERM", stop
    assert f"not requeueing Slurm job {run.job}: stopped by SIGTERM, and it requeues itself on SIGUSR2 only" in text, \
        text[-6000:]
    assert "requeueing Slurm job" not in text.replace("not requeueing Slurm job", ""), text[-6000:]
    assert run.kinds("resume") == [] and f"job {run.job} run 2 " not in text
    assert_one_line_per_node(text, "SIGTERM")
    assert_read_as_people_read_it(run, text, agents=True)
    assert processes_in(run.folder) == [], "processes of the job left running"
