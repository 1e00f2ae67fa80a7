"""A program of the user's own, run as it is, gets ddpkit's preamble (the
rank table, progress for the hang watchdog, the interface) with no change to
its code: the PyTorch tutorial's multi-node script (tests/helpers/tutorial_ddp.py)
under `ddpkit launch local`, its workers forked by ddpkit.agent's zygote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddpkit.launch.local import free_port
from ddpkit.launch.supervise import proctree
from ddpkit.run import torchrun_env
from ddpkit.shared.agreed import slurm_port_for_job
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.train.watchdog.straggler import SUSTAIN_STEPS
from tests.helpers.rank_table import pid_of
from tests.test_launch_local import _gone, clean_env, launch_argv
from tests.test_startup import ROOT

TUTORIAL = ROOT / "tests" / "helpers" / "tutorial_ddp.py"
STALL_S = 6
ALL_OFF = ["--set", "preamble.interface=false", "--set", "preamble.rank_report=false",
           "--set", "preamble.progress=false", "--set", "preamble.metrics=false"]
pytestmark = pytest.mark.slow


class Job:
    """`ddpkit launch local` of a script in the background, its output collected line by line."""

    def __init__(self, tmp: Path, script: Path, *args: str, launch: tuple[str, ...] = ()) -> None:
        argv = launch_argv("--nodes", "2", "--nproc-per-node", "1", "--grace", "5", "--set", f"command.script={script}",
                           "--set", f"watchdog.stall_s={STALL_S}", *launch, "--", *args)
        self.proc = subprocess.Popen(argv, env=clean_env(PYTHONPATH=str(ROOT / "src")), cwd=tmp,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self.pids: set[int] = set()
        self.left: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        with self._seen:
            while not any(re.search(pattern, line) for line in self.lines):
                if self.proc.poll() is not None or not self._seen.wait(max(deadline - time.monotonic(), 0)):
                    raise AssertionError(f"never saw {pattern!r}:\n{self.text}")

    def finish(self, timeout: float) -> int:
        """The launcher's exit code; `left` holds the job's processes it left
        running (none, when it ended the job as it should). Whatever happens,
        nothing is left afterwards."""
        try:
            return self.proc.wait(timeout)
        finally:
            self.pids |= set(proctree.descendants(self.proc.pid))
            self.left = [pid for pid in sorted(self.pids) if not _gone(pid)]
            proctree.signal_all(self.left, signal.SIGCONT)
            proctree.signal_all(self.left, signal.SIGKILL)


def run(tmp: Path, *args: str, launch: tuple[str, ...] = (), script: Path = TUTORIAL) -> tuple[int, str]:
    job = Job(tmp, script, *args, launch=launch)
    code = job.finish(300)
    time.sleep(0.1)  # the reader thread takes the last lines
    return code, job.text


def test_the_tutorial_script_gets_the_rank_table_and_trains_the_same_weights_without_it(tmp_path: Path) -> None:
    """3 epochs of 16 steps a rank: the rank table, the watchdog, and metrics records
    that `ddpkit report` draws (a `train` record and a step-time window every 10 steps and at exit)."""
    code, text = run(tmp_path, "3", "1", "--batch_size", "8", "--final", str(tmp_path / "with.pt"),
                     "--snapshot", "with-snapshot.pt")
    assert code == 0, text
    assert pid_of(text.splitlines(), 0) is not None and pid_of(text.splitlines(), 1) is not None, text
    assert "rank report: 2 processes" in text
    assert "ddpkit watchdog: on for this script" in text  # its optimizer steps were counted
    assert "stall detection is off" not in text
    assert text.rstrip().endswith("launch local: every node finished"), text[-500:]
    [run_id] = re.findall(r"\(ddpkit status (\w+)\)", text)
    page = subprocess.run([sys.executable, "-m", "ddpkit.cli", "report", run_id, "-o", str(tmp_path / "page.html")],
                          env=clean_env(PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    # 48 steps: train records and step-time windows at 10-40 and at exit for the last 8 (48); a window
    # is written once both ranks published it, the last one waited for at exit
    assert re.search(r"\(5 train and 5 step-time records", page.stdout), page.stdout

    code, bare = run(tmp_path, "3", "1", "--batch_size", "8", "--final", str(tmp_path / "without.pt"),
                     "--snapshot", "bare.pt", launch=tuple(ALL_OFF))
    assert code == 0, bare
    assert "rank report" not in bare and "ddpkit watchdog: on" not in bare
    assert "stall detection is off: preamble.progress is false" in bare
    with_, without = torch.load(tmp_path / "with.pt"), torch.load(tmp_path / "without.pt")
    assert with_.keys() == without.keys()
    assert all(torch.equal(with_[k], without[k]) for k in with_), "the preamble changed what the program computed"


def freeze_rank_1_and_expect_the_stall(job: Job) -> None:
    """Once the job trains and its rank table is out, SIGSTOP rank 1's worker:
    the launcher must end within stall_s plus its grace with exit 13, rank 1
    named, and nothing of the job left running."""
    try:
        job.wait_for(r"ddpkit watchdog: on for this script")  # stderr: the table on stdout may come after it
        job.wait_for(r"│ 1\s+│ 0\s+│ 1\s+│")
        job.pids |= set(proctree.descendants(job.proc.pid))
        pid = pid_of(job.lines, 1)
        assert pid is not None and pid in job.pids, job.text
        stopped = time.monotonic()
        proctree.signal_all([pid], signal.SIGSTOP)
        code = job.finish(STALL_S + 200)
    finally:
        if job.proc.poll() is None:
            job.finish(10)
    took = time.monotonic() - stopped
    text = job.text
    assert code == ExitCode.STALLED, text
    assert re.search(r"STALL rank 1 node 1 host \S+ pid \d+: step \d+, phase train", text), text
    assert took < STALL_S + 150, f"{took:.1f} s from SIGSTOP to the launcher's end"
    assert job.left == [], "a process of the job outlived it"
    stacks_are_in_files_and_the_console_says_where(text)


def stacks_are_in_files_and_the_console_says_where(text: str) -> None:
    """The console as the user reads it: no stack (faulthandler's lines), one line naming the
    files in the run folder; rank 0, which waited, wrote its own."""
    folder = run_folder(text)
    [where] = [line for line in text.splitlines() if "stacks of every rank" in line]
    assert where.endswith(f"stacks of every rank: {folder}/logs/node<N>/stall-rank<R>.txt"), where
    assert "Thread 0x" not in text and not re.search(r'File "[^"]+", line \d+ in ', text), "stacks on the console"
    assert "Thread 0x" in (folder / "logs" / "node0" / "stall-rank0.txt").read_text()


def test_a_frozen_rank_of_the_tutorial_script_is_named_and_the_job_stopped(tmp_path: Path) -> None:
    freeze_rank_1_and_expect_the_stall(Job(tmp_path, TUTORIAL, "1000", "1000", "--step-sleep", "0.05"))


NEVER_TRAINS = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
time.sleep(float(__import__("sys").argv[1]))  # no optimizer, no step: never judged
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.full  # no stall on a long first step or evaluation: test_watchdog_local.py
def test_a_long_evaluation_and_a_program_that_never_trains_are_no_stall(tmp_path: Path) -> None:
    code, text = run(tmp_path, "2", "1", "--eval-seconds", str(2 * STALL_S + 3))
    assert code == 0, text
    assert "ddpkit watchdog: on for this script" in text and "STALL" not in text
    program = tmp_path / "never_trains.py"
    program.write_text(NEVER_TRAINS)
    code, text = run(tmp_path, str(2 * STALL_S), script=program)
    assert code == 0, text
    assert "rank report: 2 processes" in text and "ddpkit watchdog: on" not in text and "STALL" not in text


SLOW_FROM, SLOW_S = 20, 0.6  # the judge's rule: 30 steps and 20 s slow (train/watchdog/straggler.py)


def run_folder(text: str) -> Path:
    [run_id] = re.findall(r"\(ddpkit status (\w+)\)", text)
    [folder] = Path(os.environ["DDPKIT_RUNS_DIR"]).glob(f"*-{run_id}")
    return folder


def test_a_rank_slower_in_its_forward_is_named_a_straggler_and_none_before(tmp_path: Path) -> None:
    """The tutorial script, each step followed by 0.1 s of sleep on both ranks
    (not their own work: the judge sees two balanced ranks for SLOW_FROM
    steps); from step SLOW_FROM rank 1's model sleeps SLOW_S in its forward.
    Rank 1 is named with ddpkit train's line, record and summary column, no
    rank before SLOW_FROM, and rank 0, which waits for it in the all-reduce,
    never."""
    code, text = run(tmp_path, "4", "100", "--batch_size", "8", "--step-sleep", "0.1",
                     "--slow-forward", f"1:{SLOW_S}:{SLOW_FROM}", "--snapshot", "slow.pt")
    assert code == 0, text
    records = [json.loads(line) for line in (run_folder(text) / "metrics.jsonl").read_text().splitlines()]
    stragglers = [r for r in records if r["kind"] == "straggler"]
    assert [(r["rank"], r["state"], r["node"]) for r in stragglers] == [(1, "slow", 1)], (stragglers, text)
    [named] = stragglers
    assert named["step"] >= SLOW_FROM + SUSTAIN_STEPS and named["own_s"] >= SLOW_S, named
    assert named["median_s"] < SLOW_S / 5, named
    assert re.search(r"\[node0 rank0\] ddpkit watchdog: STRAGGLER rank 1 node 1 host \S+-node1: \d\.\d{3}s of "
                     r"own work a step against the job's median 0\.\d+s", text), text
    assert text.count("ddpkit watchdog: STRAGGLER") == 1, text
    assert re.search(r"node1\s*│\s*0\s*│\s*ok\s*│.*│\s*rank 1 \(\S+-node1\): \d\.\d{3}s of own", text), text
    assert not re.search(r"node0\s*│\s*0\s*│\s*ok\s*│.*│\s*rank \d", text), text
    events = [json.loads(line) for line in (run_folder(text) / "events.jsonl").read_text().splitlines()]
    assert [e.get("node") for e in events if e["kind"] == "straggler"] == [1], events


def test_the_runner_runs_a_program_as_python_would(tmp_path: Path) -> None:
    """`python -m ddpkit.run`: argv, __main__, the exit code, the program's own traceback."""
    (tmp_path / "prog.py").write_text(
        "import sys\nprint('argv', sys.argv, __name__, sys.path[0] == __file__.rsplit('/', 1)[0])\n"
        "if sys.argv[1] == 'exit':\n    sys.exit(7)\nraise ValueError('from the program')\n")
    env = {**clean_env(), "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "ddpkit.run", str(tmp_path / "prog.py"), "exit"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    assert f"argv ['{tmp_path / 'prog.py'}', 'exit'] __main__ True" in done.stdout
    done = subprocess.run([sys.executable, "-m", "ddpkit.run", str(tmp_path / "prog.py"), "raise"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    trace = done.stderr[done.stderr.index("Traceback"):]
    assert 'prog.py", line 5, in <module>' in trace and "ValueError: from the program" in trace
    assert "runpy" not in trace and "ddpkit" not in trace
    done = subprocess.run([sys.executable, "-m", "ddpkit.run"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == ExitCode.BAD_INPUT and done.stderr.startswith("usage: python -m ddpkit.run")


FORGED_VERSION = """\
import dataclasses, os
import torch.distributed as dist
from ddpkit.preamble import ranks

real = ranks.own_row
ranks.own_row = lambda env: dataclasses.replace(real(env), torch="2.0.0-other") if env["RANK"] == "1" else real(env)
dist.init_process_group("gloo")
print("TRAINING", flush=True)  # never: the report ends every rank first
"""


def test_rows_that_do_not_form_one_job_end_the_job_with_exit_4_and_every_rank_says_why(tmp_path: Path) -> None:
    """The checks of `ddpkit train`'s rank report, for a program of the user's own: a rank whose
    torch differs (forged from inside the program) stops every rank before its first step."""
    (tmp_path / "forged.py").write_text(FORGED_VERSION)
    argv = [sys.executable, "-m", "ddpkit.agent", "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(tmp_path / "forged.py")]
    done = subprocess.run(argv, env=clean_env(PYTHONPATH=str(ROOT / "src")), cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    text = done.stdout + done.stderr
    # ddpkit's agent passes its first failed worker's code on where it is one of ddpkit's (torchrun's: 1)
    assert done.returncode == ExitCode.STARTUP and "TRAINING" not in text, text
    # torchrun lists the ranks that had exited when it looked (one or both), and stops the rest
    codes = re.findall(r"exitcode\s+: (-?\d+)", done.stderr)
    assert codes and set(codes) == {str(int(ExitCode.STARTUP))}, text
    assert text.count("ddpkit: rank report: torch/CUDA/NCCL versions differ") == 2, text
    assert "2.0.0-other" in done.stdout  # rank 0's table shows the row that differs


def test_an_srun_task_gets_torchruns_variables_from_slurms() -> None:
    slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2",
             "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_ID": "1234", "MASTER_ADDR": "n1"}
    got = torchrun_env(slurm)
    assert got == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
                   "MASTER_ADDR": "n1", "MASTER_PORT": str(slurm_port_for_job(1234))}
    assert torchrun_env({**slurm, "RANK": "5"}) == {}  # torchrun's own (or the user's) win
    assert torchrun_env({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) == {}  # the batch script itself
