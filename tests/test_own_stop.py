"""Pre-emption for a program of the user's own (ddpkit/preamble/stop.py): a
stop signal runs the program's stop handler at the same optimizer step on
every rank, then each worker exits 75; without a handler the program ends as
it did without ddpkit, and says so. Real programs under `ddpkit launch local`
(2 nodes x 1 process, gloo): the PyTorch tutorial's script with its one line
`ddpkit.on_stop`, a Hugging Face `Trainer` and a Lightning `Trainer` with
ddpkit's callbacks; the launcher's SIGTERM is what `ddpkit cancel` sends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ddpkit.host import processes
from ddpkit.launch.supervise import proctree
from ddpkit.runs import resolve
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.rank_table import pid_of
from tests.test_preamble import TUTORIAL, Job
from tests.test_startup import ROOT

HELPERS = ROOT / "tests" / "helpers"
pytestmark = pytest.mark.slow
AGREED = r"ddpkit: SIGTERM: every rank stops after optimizer step (\d+)"


def stop_the_launcher(job: Job, ready: str) -> tuple[int, str]:
    job.wait_for(ready)
    job.proc.send_signal(signal.SIGTERM)
    code = job.finish(120)
    assert job.left == [], job.left
    return code, job.text


def check_what_is_read_last(text: str, said: str) -> None:
    """The summary's rows, its closing line (the console's last), run.json and
    `ddpkit status` of the run all say `said` (whether the stop checkpointed)."""
    assert text.rstrip().splitlines()[-1].endswith(f"interrupted; stopped all nodes; {said}"), text[-2000:]
    assert text.count(f"stopped, {said}") == 2, text[-2000:]  # each node's row
    found = re.search(r"\(ddpkit status (\w+)\)", text)
    assert found, text[:2000]
    record = resolve(found.group(1)).folder.record()
    assert record.summary is not None and record.summary.closing.endswith(f"; {said}"), record
    assert [row.status for row in record.summary.rows] == [f"stopped, {said}"] * 2, record.summary.rows
    status = subprocess.run([sys.executable, "-m", "ddpkit.cli", "status", found.group(1)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert status.stdout.count(f"stopped, {said}") == 2, status.stdout
    assert status.stdout.rstrip().splitlines()[-1] == record.summary.closing, status.stdout


def agreed_step(text: str) -> int:
    found = re.search(AGREED, text)
    assert found, text[-3000:]
    return int(found.group(1))


def test_on_stop_runs_on_every_rank_at_the_same_step_and_the_workers_exit_75(tmp_path: Path) -> None:
    job = Job(tmp_path, TUTORIAL, "100000", "100000", "--step-sleep", "0.02", "--on-stop",
              "--snapshot", str(tmp_path / "snap.pt"))
    code, text = stop_the_launcher(job, r"Epoch 1 \|")
    step = agreed_step(text)
    # Each rank's handler saw the program's own step counter at the agreed step: one line
    # when both printed it alike ([all 2 ranks]), one a rank otherwise.
    ran = re.findall(r"^\[(node\d rank\d|all 2 ranks)\] stop handler ran after step (\d+)$", text, re.M)
    assert {int(n) for _, n in ran} == {step} and len(ran) in (1, 2), text[-3000:]
    snapshot = torch.load(tmp_path / "snap.pt", map_location="cpu")
    assert snapshot["STEP"] == step  # written by the handler at the agreed step (the tutorial's own has no STEP)
    assert code == ExitCode.INTERRUPTED, text[-2000:]
    # The preamble's stop record: the summary says the handlers saved at that step.
    check_what_is_read_last(text, f"checkpoint at step {step}")


def test_without_a_handler_the_program_stops_at_once_and_says_no_checkpoint_was_written(tmp_path: Path) -> None:
    job = Job(tmp_path, TUTORIAL, "100000", "100000", "--step-sleep", "0.02", "--snapshot", str(tmp_path / "snap.pt"))
    code, text = stop_the_launcher(job, r"Epoch 1 \|")
    assert "the program has no stop handler (ddpkit.on_stop, or ddpkit's callback for its Trainer), so it stops " \
           "now, without a checkpoint" in text, text[-3000:]
    assert not re.search(AGREED, text)
    # The tutorial's own snapshot of epoch 0 is there; no handler wrote a step's.
    assert "STEP" not in torch.load(tmp_path / "snap.pt", map_location="cpu")
    assert code == ExitCode.INTERRUPTED, text[-2000:]
    check_what_is_read_last(text, "no checkpoint")


@pytest.mark.full  # a Trainer's agreed stop and resume: the Lightning test below; Hugging Face's callback: test_own_frameworks.py
def test_a_hugging_face_trainer_saves_its_checkpoint_at_the_agreed_step_and_resumes_from_it(tmp_path: Path) -> None:
    out = tmp_path / "hf-out"
    job = Job(tmp_path, HELPERS / "hf_trainer.py", str(out), "100000", "stop")
    code, text = stop_the_launcher(job, r"'loss'")
    step = agreed_step(text)
    assert "the program's callback saves and stops" in text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{step}"], text[-3000:]
    state = (out / f"checkpoint-{step}" / "trainer_state.json").read_text()
    assert f'"global_step": {step}' in state
    assert code == ExitCode.INTERRUPTED, text[-2000:]
    # The next start resumes from it, through the Trainer's own resume.
    epochs = step // 16 + 2  # 256 samples, 8 a rank, 2 ranks: 16 steps an epoch
    again = tmp_path / "again"
    again.mkdir()
    done = Job(again, HELPERS / "hf_trainer.py", str(out), str(epochs), "stop")
    assert done.finish(300) == 0, done.text[-3000:]
    assert f"resuming from {out / f'checkpoint-{step}'}" in done.text


def test_a_lightning_trainer_saves_last_ckpt_at_the_agreed_step(tmp_path: Path) -> None:
    root = tmp_path / "lt"
    job = Job(tmp_path, HELPERS / "lightning_trainer.py", str(root), "100000", "2", "stop")
    code, text = stop_the_launcher(job, r"ddpkit watchdog: on for this script")
    step = agreed_step(text)
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["last.ckpt"], text[-3000:]
    checkpoint = torch.load(root / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == step
    assert code == ExitCode.INTERRUPTED, text[-2000:]
    check_what_is_read_last(text, f"checkpoint at step {step}")  # the step last.ckpt holds


PROGRAM = textwrap.dedent("""
    import os, signal, sys, torch, ddpkit
    mode = sys.argv[1]
    if mode != "none":
        ddpkit.on_stop(lambda: print(f"saved before step {steps}", flush=True))
    if mode == "own":
        signal.signal(signal.SIGUSR2, lambda *_: print("own handler", flush=True))
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    for steps in range(1, 11):
        opt.step()
        if steps == 3:
            os.kill(os.getpid(), signal.SIGUSR2)
    print("finished", flush=True)
""")


@pytest.mark.parametrize(("mode", "code", "says"), [
    # One process: agreed after the step after the signal (4); the handler runs as step 5 begins.
    ("on_stop", ExitCode.PREEMPTED, "saved before step 5"),
    ("none", -signal.SIGUSR2, ""),  # nothing of ddpkit installed: the signal does what it always did
    ("own", 0, "own handler"),  # the program's own handler replaces ddpkit's
])
def test_one_process_without_a_launcher(tmp_path: Path, mode: str, code: int, says: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}"}
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == code, done.stdout + done.stderr
    assert says in done.stdout + done.stderr
    assert ("finished" in done.stdout) == (mode == "own")
    assert ("saved" in done.stdout) == (mode == "on_stop")


def test_a_stopped_rank_is_killed_at_once_so_a_cancelled_job_ends_without_waiting_for_the_shutdown_timeout(
        tmp_path: Path) -> None:
    """Rank 1 SIGSTOPped, then the launcher's SIGTERM (what Ctrl-C and `ddpkit cancel` send):
    the stopped worker can act on no signal and its peer waits for it in the stop agreement.
    Its agent kills it once it has stayed stopped 10 s, and says so; the peer's collective then
    fails and the job ends. (test_train_resume continues stopped workers after the signal: they
    are not killed.)
    The watchdog is set out of the way, so the bound rules out the fallback it would otherwise
    meet: torchrun's shutdown timeout, preemption.checkpoint_s plus its margin."""
    job = Job(tmp_path, TUTORIAL, "100000", "100000", "--step-sleep", "0.05", "--on-stop",
              launch=("--set", "watchdog.stall_s=600", "--set", "preemption.checkpoint_s=150"))
    try:
        job.wait_for(r"Epoch 1 \|")
        job.pids |= set(proctree.descendants(job.proc.pid))
        pid = pid_of(job.lines, 1)
        assert pid is not None and pid in job.pids, job.text
        proctree.signal_all([pid], signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not processes.is_stopped(pid):
            assert time.monotonic() < deadline, f"rank 1 (pid {pid}) never showed as stopped"
            time.sleep(0.05)
        asked = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)
        code = job.finish(240)
    finally:
        if job.proc.poll() is None:
            job.finish(10)
    took = time.monotonic() - asked
    text = job.text
    assert f"ddpkit.agent: rank 1 (pid {pid}) is stopped (SIGSTOP or a debugger) and was not continued within " \
           "10 s of SIGTERM: it cannot act on it or write a checkpoint; killed now" in text, text[-3000:]
    assert code == ExitCode.INTERRUPTED, text[-2000:]
    assert text.rstrip().endswith("launch local: interrupted; stopped all nodes; no checkpoint"), text[-2000:]
    assert took < 120, f"{took:.1f} s from SIGTERM to the launcher's end: the shutdown timeout's, not the kill's"
    assert job.left == [], job.left


RESUMING = textwrap.dedent("""
    import sys, torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(lambda *_: None)  # a hook of the program's own, after ddpkit's
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    if sys.argv[1] == "resume":
        torch.save({"p": p.detach()}, "snapshot.pt")
        p.data.copy_(torch.load("snapshot.pt")["p"])
    for _ in range(3):
        opt.step()
""")


@pytest.mark.parametrize(("mode", "restart", "says"), [
    ("resume", "1", "ddpkit: this job was requeued by Slurm (restart 1); before its first step the program loaded "
                    "snapshot.pt: it resumes from there"),
    ("fresh", "1", "ddpkit: this job was requeued by Slurm (restart 1), and the program loaded nothing with "
                   "torch.load before its first step: it starts over from step 0"),
    ("resume", "0", ""),  # the job's first run: nothing to say
])
def test_a_requeued_start_says_whether_the_program_resumed(tmp_path: Path, mode: str, restart: str, says: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}", "SLURM_RESTART_COUNT": restart, "RANK": "0"}
    program = tmp_path / "resuming.py"
    program.write_text(RESUMING)
    done = subprocess.run([sys.executable, "-m", "ddpkit.run", str(program), mode], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("ddpkit: this job was")]
    assert len(said) == (1 if says else 0) and (not says or said[0].startswith(says)), done.stderr
