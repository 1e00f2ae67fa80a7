"""Run folders and `ddpkit runs / status / logs / cancel` (docs/guides/runs.md).

Units: which run RUN names (a run id, a job name: its latest run, a Slurm
job id), and a launcher that died without recording its end shown as abandoned.
Real processes: a `ddpkit launch local` run listed as finished with its rank
lines, and a long one cancelled with `ddpkit cancel`, which must end
cancelled with the launcher's exit code 130 and leave no process running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.launch.control.backends import launched
from ddpkit.launch.supervise import proctree
from ddpkit.runs import (
    NodeLog,
    RunFolder,
    RunState,
    RunTarget,
    SlurmJob,
    StoredRun,
    UnknownRun,
    all_runs,
    resolve,
    shown_state,
)
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import TINY

ROOT = Path(__file__).resolve().parents[1]
RANK_LINES = str(ROOT / "tests" / "helpers" / "rank_lines.py")


def ddpkit(runs_dir: Path, *argv: str, timeout: float = 120, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DDPKIT_RUNS_DIR": str(runs_dir), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}",
           "OMP_NUM_THREADS": "1"}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "ddpkit.cli", *argv], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def new_run(root: Path, name: str, started: float, **update: object) -> RunFolder:
    folder = RunFolder.create(name=name, target=RunTarget.LOCAL, nodes=2, nproc_per_node=1,
                              spec_yaml=f"name: {name}\n", root=root)
    if "target" in update:  # model_copy does not validate: the word as the record's type
        update["target"] = RunTarget(update["target"])
    folder.write(folder.record().model_copy(update={"started": started, **update}))
    return folder


# ---- RUN resolution -----------------------------------------------------------------


def test_run_is_found_by_id_folder_name_latest_of_a_name_and_slurm_job_id(tmp_path: Path) -> None:
    old = new_run(tmp_path, "train", 1000.0)
    latest = new_run(tmp_path, "train", 2000.0)
    other = new_run(tmp_path, "eval", 3000.0)
    slurm = new_run(tmp_path, "big", 1500.0, target="slurm")
    slurm.set_slurm(SlurmJob(job_id=4711, script="/s/big.sbatch", output="/s/big-4711.out", tasks_per_node=1,
                             rank_per_task=False, signal="USR2", signal_grace_s=90))

    assert [r.folder for r in all_runs(tmp_path)] == [other, latest, slurm, old]  # newest first
    assert resolve(old.record().id, tmp_path).folder == old
    assert resolve(old.path.name, tmp_path).folder == old
    assert resolve("train", tmp_path).folder == latest
    assert resolve("4711", tmp_path).folder == slurm
    with pytest.raises(UnknownRun, match=r"no run '4712' in .*4 runs"):
        resolve("4712", tmp_path)


def test_unknown_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    new_run(tmp_path, "train", 1000.0)
    for command in (["status", "nosuch"], ["logs", "nosuch"], ["cancel", "nosuch"]):
        done = ddpkit(tmp_path, *command)
        assert done.returncode == ExitCode.BAD_INPUT, done.stderr
        assert done.stderr.startswith(f"ddpkit {command[0]}: no run 'nosuch' in {tmp_path}")
        assert len(done.stderr.splitlines()) == 1 and done.stdout == ""


def slurm_run(root: Path, *, srun_mode: bool) -> RunFolder:
    """A submitted 2 x 2 job whose output file srun --label wrote."""
    folder = new_run(root, "big", time.time(), target="slurm", nproc_per_node=2)
    output = root / "big-4711.out"
    output.write_text("ddpkit: job 4711 run 1 on node[1-2]\n"
                      + "".join(f"{t}: line {n} of task {t}\n" for n in (1, 2) for t in range(4 if srun_mode else 2)))
    folder.set_slurm(SlurmJob(job_id=4711, script=str(root / "big.sbatch"), output=str(output),
                              tasks_per_node=2 if srun_mode else 1, rank_per_task=srun_mode, signal="USR2",
                              signal_grace_s=90))
    return folder


def test_slurm_logs_by_node_and_rank(tmp_path: Path) -> None:
    slurm_run(tmp_path, srun_mode=True)
    rank = ddpkit(tmp_path, "logs", "4711", "--rank", "3")
    assert rank.stdout.splitlines() == ["[node1 rank3] line 1 of task 3", "[node1 rank3] line 2 of task 3"]
    node = ddpkit(tmp_path, "logs", "4711", "--node", "0", "--tail", "2")
    assert node.stdout.splitlines() == ["[node0 rank0] line 2 of task 0", "[node0 rank1] line 2 of task 1"]
    every = ddpkit(tmp_path, "logs", "big").stdout.splitlines()
    assert every[0] == "[batch] ddpkit: job 4711 run 1 on node[1-2]" and len(every) == 9, every


def test_slurm_logs_of_a_rank_in_torchrun_mode_show_its_node(tmp_path: Path) -> None:
    slurm_run(tmp_path, srun_mode=False)
    rank = ddpkit(tmp_path, "logs", "4711", "--rank", "3")
    assert rank.stdout.splitlines() == ["[node1] line 1 of task 1", "[node1] line 2 of task 1"]
    assert rank.stderr.strip() == ("ddpkit logs: torchrun mode: the job's output does not tag ranks; "
                                   "showing node 1, which holds rank 3")
    bad = ddpkit(tmp_path, "logs", "4711", "--rank", "4")
    assert (bad.returncode, bad.stderr.strip()) == (2, "ddpkit logs: --rank 4: run "
                                                    f"{all_runs(tmp_path)[0].record.id} has ranks 0-3")


def test_a_slurm_run_off_the_cluster_is_listed_and_cancel_says_why_not(tmp_path: Path) -> None:
    """A host without Slurm's client (no squeue, no scancel): `runs` and `status`
    show what is recorded; `cancel` is one line, exit 3."""
    run = slurm_run(tmp_path, srun_mode=True)
    listed = ddpkit(tmp_path, "runs", path="/nonexistent")
    assert listed.returncode == 0 and re.search(r"big\s*│\s*slurm\s*│\s*running", listed.stdout), listed
    status = ddpkit(tmp_path, "status", "4711", path="/nonexistent")
    assert "where     Slurm job 4711: squeue is not installed here" in status.stdout, status.stdout
    cancel = ddpkit(tmp_path, "cancel", "4711", path="/nonexistent")
    assert cancel.returncode == ExitCode.PREFLIGHT, cancel.stdout + cancel.stderr
    assert cancel.stderr.startswith("ddpkit cancel: scancel is not installed here") and len(
        cancel.stderr.splitlines()) == 1, cancel.stderr
    assert run.record().state == RunState.RUNNING


def test_cancel_of_a_run_whose_launcher_is_on_another_host_is_one_line(tmp_path: Path) -> None:
    folder = new_run(tmp_path, "train", time.time())
    record = folder.record()
    moved = record.launcher.model_copy(update={"host": "elsewhere"})
    folder.write(record.model_copy(update={"launcher": moved}))
    cancel = ddpkit(tmp_path, "cancel", "train")
    assert cancel.returncode == ExitCode.BAD_INPUT
    assert cancel.stderr.strip() == (f"ddpkit cancel: run {record.id}'s launcher runs on elsewhere (pid "
                                     f"{record.launcher.pid}); run `ddpkit cancel {record.id}` there")
    assert folder.events()[-1].kind == "start"  # nothing was sent


@pytest.mark.parametrize(("command", "promise"), [
    ("", "to checkpoint and stop"),  # ddpkit train, the default
    ("command: {module: ddpkit.train}", "to checkpoint and stop"),
    ("command: {script: /work/train.py}", "one without stops at once, without a checkpoint"),
    ("command: {module: my_pkg.train}", "one without stops at once, without a checkpoint"),
])
def test_cancel_promises_a_checkpoint_only_where_the_command_is_ddpkit_train(tmp_path: Path, command: str,
                                                                             promise: str) -> None:
    folder = new_run(tmp_path, "train", time.time())
    folder.spec_file.write_text(f"name: train\n{command}\n")
    said = launched._to_stop(StoredRun(folder, folder.record()))
    assert said.endswith(promise) and ("stop handler" in said) == (promise != "to checkpoint and stop"), said


def test_logs_of_a_rank_where_node_logs_do_not_tag_ranks_show_its_node(tmp_path: Path) -> None:
    """launch ssh and docker run torchrun without the rank prefix: --rank shows
    the node that holds the rank, and says so."""
    folder = new_run(tmp_path, "ssh-job", time.time(), target="ssh", nproc_per_node=2)
    logs = []
    for node in (0, 1):
        path = tmp_path / f"ssh-job.node{node}.h{node}.log"
        path.write_text("".join(f"node {node} line {n}\n" for n in (1, 2, 3)))
        logs.append(NodeLog(node=node, host=f"h{node}", path=str(path)))
    folder.set_logs(logs)
    shown = ddpkit(tmp_path, "logs", "ssh-job", "--rank", "3", "--tail", "2")
    assert shown.stdout.splitlines() == ["[node1] node 1 line 2", "[node1] node 1 line 3"]
    assert shown.stderr.strip() == ("ddpkit logs: launch ssh's node logs do not tag ranks; showing node 1, "
                                    "which holds rank 3")


def test_a_launch_whose_run_folder_cannot_be_made_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = ddpkit(tmp_path / "a-file", "launch", "local", "--nodes", "1", "--nproc-per-node", "1")
    assert done.returncode == ExitCode.PREFLIGHT, done.stdout + done.stderr
    assert done.stderr.strip() == (f"ddpkit: cannot create a run folder in {tmp_path / 'a-file'} (File exists); set "
                                   "DDPKIT_RUNS_DIR to a folder you can write (nothing was started)")
    assert done.stdout == ""


# ---- a launcher that died -------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_launcher_is_shown_abandoned(tmp_path: Path) -> None:
    folder = new_run(tmp_path, "train", time.time())
    record = folder.record()
    folder.write(record.model_copy(update={"launcher": record.launcher.model_copy(update={"pid": _dead_pid()})}))
    assert folder.record().state == RunState.RUNNING and shown_state(folder.record()) == RunState.ABANDONED

    listed = ddpkit(tmp_path, "runs")
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"{record.id}\s*│\s*train\s*│\s*local\s*│\s*abandoned\s*│", listed.stdout), listed.stdout
    status = ddpkit(tmp_path, "status", record.id)
    assert status.stdout.splitlines()[0] == f"run {record.id}: abandoned", status.stdout
    cancel = ddpkit(tmp_path, "cancel", "train")
    assert cancel.returncode == ExitCode.FAILED
    assert cancel.stdout.strip() == (f"ddpkit cancel: run {record.id} has already ended: abandoned (its launcher is gone "
                                     "and left nothing running)"), cancel.stdout


def test_a_reused_pid_is_not_the_launcher(tmp_path: Path) -> None:
    """The pid runs (it is this test's), but it started at another time than the record's launcher."""
    folder = new_run(tmp_path, "train", time.time())
    record = folder.record()
    assert shown_state(record) == RunState.RUNNING  # this process, as recorded
    ticks = record.launcher.start_ticks
    assert ticks is not None
    moved = record.launcher.model_copy(update={"start_ticks": ticks - 1})
    assert shown_state(record.model_copy(update={"launcher": moved})) == RunState.ABANDONED


# ---- real launch local runs -------------------------------------------------------------


@pytest.mark.slow
def test_a_finished_run_is_listed_and_its_rank_lines_shown(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    done = ddpkit(runs_dir, "launch", "local", "--nodes", "2", "--nproc-per-node", "2", "--grace", "3",
                  "--set", "name=lines", "--set", f"command.script={RANK_LINES}", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1] == "launch local: every node finished"

    listed = ddpkit(runs_dir, "runs")
    assert listed.returncode == 0, listed.stderr
    (run,) = all_runs(runs_dir)
    row = rf"{run.record.id}\s*│\s*lines\s*│\s*local\s*│\s*finished\s*│\s*2x2\s*│[^│]+│\s*[\d.]+s\s*│\s*0\s*│"
    assert re.search(row, listed.stdout), listed.stdout

    logs = ddpkit(runs_dir, "logs", "lines", "--rank", "1", "--tail", "3")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == [f"[node0 rank1] LINE rank=1 n={n}" for n in (3, 4, 5)]
    node1 = ddpkit(runs_dir, "logs", run.record.id, "--node", "1").stdout.splitlines()
    assert {line.split("]")[0] for line in node1 if "LINE" in line} == {"[node1 rank2", "[node1 rank3"}

    record = run.folder.record()
    assert (record.state, record.exit_code) == (RunState.FINISHED, 0)
    assert record.summary is not None and record.summary.closing == "launch local: every node finished"
    assert [(r.node, r.exit_code, r.status) for r in record.summary.rows] == [(0, "0", "ok"), (1, "0", "ok")]
    assert [e.kind for e in run.folder.events()] == ["start", "exit"]
    assert (run.folder.path / "spec.yaml").read_text().startswith("name: lines\n")


def _wait_for(what: str, check: Callable[[], bool], launcher: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert launcher.poll() is None, f"the launcher ended (exit {launcher.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def start_long_run(tmp_path: Path, runs_dir: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """A launch local run of the tiny job that trains until stopped, once
    node 0's log shows a step."""
    env = {**os.environ, "DDPKIT_RUNS_DIR": str(runs_dir), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}",
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2", "--nproc-per-node", "1",
            "--grace", "3", "--set", "name=long", "--", *TINY, "--data", "synthetic", "--synthetic-size", "64",
            "--batch-size", "4", "--epochs", "100000", "--max-steps", "1000000", "--log-every", "1", "--no-eval"]
    with open(tmp_path / "launcher.out", "w") as out:
        launcher = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True)

    def training() -> bool:
        runs = all_runs(runs_dir) if runs_dir.exists() else []
        logs = runs[0].record.logs if runs else []
        log = Path(logs[0].path) if logs else None
        return log is not None and log.exists() and re.search(r"\[rank0\]:step \d+", log.read_text()) is not None

    try:
        _wait_for("step in node 0's log", training, launcher)
    except BaseException:
        proctree.signal_all([launcher.pid, *proctree.descendants(launcher.pid)], signal.SIGKILL)
        raise
    return launcher, env


def running(pids: list[int]) -> list[int]:
    """Those still running (an ended process waiting to be reaped is not)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out


@pytest.mark.slow
def test_cancel_stops_a_running_launch_local_run_and_leaves_nothing(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    launcher, env = start_long_run(tmp_path, runs_dir)
    job: list[int] = []
    try:
        job = [launcher.pid, *proctree.descendants(launcher.pid)]
        follow = subprocess.Popen([sys.executable, "-m", "ddpkit.cli", "logs", "long", "--rank", "0", "--follow"],
                                  env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = time.monotonic()
        cancel = ddpkit(runs_dir, "cancel", "long", timeout=200)
        took = time.monotonic() - started
        launcher.wait(timeout=60)
        followed, follow_err = follow.communicate(timeout=30)  # --follow ends with the run
        left = proctree.alive([pid for pid in job if pid != launcher.pid])
    finally:  # whatever went wrong, leave none of the job running
        proctree.signal_all(proctree.alive(job), signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    out = (tmp_path / "launcher.out").read_text()
    (run,) = all_runs(runs_dir)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert cancel.stdout.splitlines()[-1] == f"ddpkit cancel: run {run.record.id} cancelled (launcher exit code 130)"
    assert launcher.returncode == ExitCode.INTERRUPTED, out[-3000:]
    assert "launch local: interrupted; stopped all nodes" in out.splitlines()[-1], out[-3000:]
    assert len(job) >= 5 and left == [], f"left running: {left}"  # launcher, 2 agents, 2 workers at least
    record = run.folder.record()
    assert (record.state, record.exit_code) == (RunState.CANCELLED, ExitCode.INTERRUPTED)
    kinds = [e.kind for e in run.folder.events()]
    assert kinds[0] == "start" and kinds[-1] == "exit" and "cancel" in kinds and "interrupted" in kinds, kinds
    listed = ddpkit(runs_dir, "runs").stdout
    assert re.search(rf"{run.record.id}\s*│\s*long\s*│\s*local\s*│\s*cancelled\s*│.*│\s*130\s*│", listed), listed
    assert follow.returncode == 0, follow_err
    steps = [line for line in followed.splitlines() if re.match(r"\[node0 rank0\] step \d+", line)]
    assert steps and all(line.startswith("[node0 rank0] ") for line in followed.splitlines()), followed[-2000:]
    # What the user sees last: rank 0's last line for people in the node log, the run's end included
    # (a framed record is the launcher's, hidden by `logs`; the stop record and the trainer's
    # stdout summary interleave in the log in either order).
    tagged = [records.rank_tagged(ln) for ln in Path(record.logs[0].path).read_text().splitlines()]
    for_people = [body for tag in tagged if tag and tag[0] == 0 and not records.is_frame(body := tag[1])]
    assert followed.splitlines()[-1] == "[node0 rank0] " + for_people[-1], followed[-2000:]
    print(f"RUNS-TIMING cancel of a launch local run: {took:.1f} s")


@pytest.mark.slow
def test_a_killed_launcher_abandons_its_run_and_cancel_stops_what_it_left(tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no time to stop its nodes: torchrun's agents
    and workers (sessions of their own) train on. `runs` shows the run abandoned;
    `cancel` finds its processes by the run id in their environment."""
    runs_dir = tmp_path / "runs"
    launcher, _ = start_long_run(tmp_path, runs_dir)
    job = proctree.descendants(launcher.pid)
    try:
        launcher.kill()
        launcher.wait(timeout=30)
        assert len(running(job)) >= 4, "the nodes should outlive a killed launcher"  # 2 agents, 2 workers
        (run,) = all_runs(runs_dir)
        listed = ddpkit(runs_dir, "runs")
        assert re.search(rf"{run.record.id}\s*│\s*long\s*│\s*local\s*│\s*abandoned\s*│", listed.stdout), listed.stdout
        cancel = ddpkit(runs_dir, "cancel", "long", timeout=200)
        left = running(job)
    finally:
        proctree.signal_all(running(job), signal.SIGKILL)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert cancel.stdout.splitlines()[-1] == f"ddpkit cancel: run {run.record.id} cancelled (its launcher was gone; " \
                                             "no exit code)", cancel.stdout
    assert left == [], f"left running: {left}"
    record = run.folder.record()
    assert (record.state, record.exit_code) == (RunState.CANCELLED, None)
    again = ddpkit(runs_dir, "cancel", run.record.id)
    assert again.stdout.strip() == f"ddpkit cancel: run {run.record.id} has already ended: cancelled"


# ---- where a Slurm job's state comes from -------------------------------------------------

# Stand-ins for Slurm's commands: each answers as the real one does on a
# cluster with or without accounting ($ACCOUNTING), for job 4710 still in the
# queue and 4711 and 4712 that have left it (4713: known to none), and logs
# its call.
STAND_INS = {
    "squeue": 'echo "squeue $*" >> "$CALLS"; echo "4710|RUNNING|None|node[1-2]"',
    "sacct": 'echo "sacct $*" >> "$CALLS"; echo "4711|COMPLETED|0:0|node[1-2]"; echo "4712|REQUEUED|0:0|node1"; '
             'echo "4712|TIMEOUT|0:15|node1"',
    "scontrol": '''echo "scontrol $*" >> "$CALLS"
case "$1 $2" in
  "show config") echo "AccountingStorageType   = $ACCOUNTING" ;;
  "show hostnames") echo node1; echo node2 ;;
  "show job") for j in 4711 4712 9999; do
      echo "JobId=$j JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 NodeList=node[1-2] Restarts=0"; done ;;
esac''',
}


@pytest.fixture
def slurm_stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name, body in STAND_INS.items():
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    return tmp_path / "calls"


@pytest.mark.parametrize(("accounting", "ended", "source"), [
    ("accounting_storage/slurmdbd", {4711: "COMPLETED", 4712: "TIMEOUT"}, "sacct"),
    ("accounting_storage/none", {4711: "FAILED", 4712: "FAILED"}, "scontrol"),
])
def test_the_jobs_a_command_shows_are_asked_about_once(
        slurm_stand_ins: Path, monkeypatch: pytest.MonkeyPatch, accounting: str, ended: dict[int, str],
        source: str) -> None:
    """One squeue for every job; for those it no longer lists, sacct where the
    cluster keeps accounting, else scontrol: each command once, whatever the
    number of jobs, and no node list expanded that nobody shows."""
    from ddpkit.launch.slurm.jobs import SlurmQueue

    monkeypatch.setenv("ACCOUNTING", accounting)
    queue = SlurmQueue([4710, 4711, 4712, 4713])
    found = {job: queue.get(job) for job in (4710, 4711, 4712, 4713)}
    assert {job: (f.state, f.source) for job, f in found.items() if f is not None} == {
        4710: ("RUNNING", "squeue"), **{job: (state, source) for job, state in ended.items()}}
    assert found[4713] is None
    calls = [line.split()[:2] for line in slurm_stand_ins.read_text().splitlines()]
    expected = [["squeue", "-h"], ["scontrol", "show"], *([["sacct", "-n"]] if source == "sacct" else []),
                ["scontrol", "show"]]
    assert calls == expected, calls
    squeue = slurm_stand_ins.read_text().splitlines()[0]
    assert "-j 4710,4711,4712,4713 " in squeue, squeue


def test_one_job_left_the_queue_is_read_by_its_id(slurm_stand_ins: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.launch.slurm.jobs import queue_state

    monkeypatch.setenv("ACCOUNTING", "accounting_storage/none")
    found = queue_state(4711)
    assert found is not None and (found.state, found.source, found.exit_status) == ("FAILED", "scontrol", 3)
    assert slurm_stand_ins.read_text().splitlines()[-1] == "scontrol show job -o 4711"


def test_runs_asks_slurm_once_for_every_active_job(tmp_path: Path, slurm_stand_ins: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`ddpkit runs` over three active Slurm runs and one recorded as ended:
    three Slurm commands in all, the ended one not asked about."""
    runs_dir = tmp_path / "runs"
    for job in (4710, 4711, 4712, 4713):
        folder = new_run(runs_dir, f"j{job}", time.time(), target="slurm")
        folder.set_slurm(SlurmJob(job_id=job, script="/s", output="/o", tasks_per_node=1, rank_per_task=False,
                                  signal="USR2", signal_grace_s=90))
        if job == 4713:
            folder.finish(0)
    monkeypatch.setenv("ACCOUNTING", "accounting_storage/slurmdbd")
    listed = ddpkit(runs_dir, "runs")  # PATH: the stand-ins
    assert listed.returncode == 0, listed.stderr
    for job, state in ((4710, "running"), (4711, "finished"), (4712, "failed"), (4713, "finished")):
        assert re.search(rf"j{job}\s*│\s*slurm\s*│\s*{state}\s*│", listed.stdout), listed.stdout
    calls = slurm_stand_ins.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["squeue", "scontrol", "sacct"], calls
    assert "-j 4710,4711,4712 " in calls[0], calls
    # A job's end Slurm reported is kept in its record: Slurm forgets it.
    ended = {r.record.name: (r.record.state, r.record.exit_code) for r in all_runs(runs_dir)}
    assert ended["j4712"] == (RunState.FAILED, 15 + 128) and ended["j4711"] == (RunState.FINISHED, 0)
