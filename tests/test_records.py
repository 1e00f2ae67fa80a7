"""ddpkit.records: every record the job sends back, its one writer and one
reader; the agent's record of a failed worker; the launcher's reading of
framed records (kept off the console, a failed worker's code, the tail)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from ddpkit import records
from ddpkit.agent.handler import Watched
from ddpkit.launch.supervise.dedup import Dedup
from ddpkit.launch.supervise.metricsink import MetricsSink
from ddpkit.launch.supervise.nodeoutput import LinePrinter
from ddpkit.shared.agreed import METRICS_TO_LAUNCHER
from ddpkit.train.outputs.progress import Metrics

STALLED = records.StalledRank(3, 1, "h1", 77, 9, "forward", 61.0, None, frame="model.py:30 in forward")
EVERY_KIND: list[records.Record] = [
    records.Stall(61.0, 60.0, (STALLED,), (0, 1), (2,), "stderr"),
    records.Straggler("slow", 3, 1, "h1", 41, 0.3, 0.01, 30.0, 1.33, 10),
    records.NodeLost(0, "heartbeat", 10.0, "stop", (records.LostRank(2, 2, "h2", 7, 9, "backward", 11.0),)),
    records.Reformed(1, 3, 2, 3),
    records.WorkerExit(1, 0, 20011, 12),
    records.SameError(1, "train.py", 42, "ValueError: bad batch at step #", 1),
    records.AgentReport(11),
    records.Traceback(4, "RuntimeError: boom  (its traceback: the node's log)"),
    records.Cause("ddpkit train", "the data is missing on host h1", 12),
    records.Train(10, 1.5, 100.0, epoch=0, lr=0.1),
    records.Train(10, None, 100.0, loss_is="the tensor backward() was called on"),
    records.Eval(10, 0, 0.5, 1.2, 5, 10),
    records.StepTimes(10, (0.01, 0.02)),
    records.RankRow(0, 0, 0, "h0", 10, "cpu", "lo", "127.0.0.1", "2.5", None, None, "torchrun", env={"X": None}),
    records.Checkpoint(10, "/c/ckpt-10.pt"),
    records.Checkpoint(10, "/c/ckpt-10.pt", from_memory="the stop signal"),
    records.Stop("SIGUSR2", 10, "/c/ckpt-10.pt", 0),
    records.Resume(10, 1, "/c/ckpt-10.pt"),
    records.Startup({"process_start": 0.0, "first_step_done": 4.5}, {"imports": 2.0}, 4.5, "proc", 10),
    records.Summary("finished", 10, 1, 4.0, 100.0, 0.5, 1.2, None, 2, 16),
]


def test_every_kind_has_a_record_and_the_reader_reads_back_what_the_writer_wrote() -> None:
    assert {type(r) for r in EVERY_KIND} == set(records.KINDS.values())
    for record in EVERY_KIND:
        assert records.decode(records.encode(record, 12.5)) == records.Stamped(record, 12.5)
        assert records.unframe(records.frame(record)) == records.Stamped(record)


def test_a_line_starts_with_kind_version_and_time_and_an_unfilled_optional_field_is_left_out() -> None:
    text = records.encode(records.Train(10, 1.5, 100.0), 12.0)
    assert text.startswith('{"kind": "train", "v": 1, "time": 12.0, "step": 10')
    assert "epoch" not in json.loads(text) and json.loads(records.encode(records.Train(1, None, 2.0)))["loss"] is None


def test_a_record_written_before_versions_is_version_1() -> None:
    old = '{"kind": "stop", "time": 5.0, "signal": "SIGTERM", "step": 6, "checkpoint": null, "slurm_restart_count": 1}'
    assert records.decode(old) == records.Stamped(records.Stop("SIGTERM", 6, None, 1), 5.0)


@pytest.mark.parametrize(("text", "said"), [
    ('{"kind": "later"}', "unknown record kind 'later'"),
    ('{"kind": "train", "v": 2, "step": 1, "loss": 1, "images_per_s": 1}', "version 2: this reader knows version 1"),
    ('{"kind": "eval", "step": 1}', "'eval': "),
    ('{"kind": "train", "step": 1, "loss": 1, "images_per_s": 1, "colour": "red"}', "unknown field(s) colour"),
    ('{"kind": "stall", "idle_s": 1, "limit_s": 1, "stalled": 3, "waiting": [], "no_stack": [], "dumps": ""}',
     "a list expected"),
    ('{"kind": "tra', "not a record"),
    ('[1, 2]', "no kind"),
])
def test_the_reader_names_what_it_cannot_read(text: str, said: str) -> None:
    with pytest.raises(records.RecordError, match=None) as caught:
        records.decode(text)
    assert said in str(caught.value)


def test_a_file_reader_leaves_out_what_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    records.append(path, records.StepTimes(2, (0.1,)), 3.0)
    with path.open("a") as out:
        out.write('{"kind": "later", "v": 1}\n{"kind": "st')
    assert records.read_file(path) == [records.Stamped(records.StepTimes(2, (0.1,)), 3.0)]


class _Proc:
    """What Watched reads of a process."""

    def __init__(self, code: int | None) -> None:
        self.pid, self.code = 4242, code

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        return self.code or 0


def test_the_agent_says_a_failed_worker_once_and_not_one_it_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1"}
    failed = Watched(_Proc(12), env)
    assert failed.poll() == 12 and failed.wait() == 12 and failed.pid == 4242
    stopped = Watched(_Proc(-15), env)
    stopped.stopping = True
    assert stopped.wait() == -15
    assert Watched(_Proc(0), env).poll() == 0 and Watched(_Proc(None), env).poll() is None
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    [line] = err.splitlines()
    said = records.unframe(line)
    assert said is not None and said.record == records.WorkerExit(rank=5, local_rank=1, pid=4242, exitcode=12)
    assert said.time is not None and abs(said.time - time.time()) < 60  # when, on this node's clock


class _Node:
    def __init__(self, index: int) -> None:
        self.index, self.host, self.label = index, f"h{index}", f"node{index}"


def test_the_launcher_keeps_records_off_the_console_and_cuts_the_tail_at_the_failed_worker() -> None:
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    node = _Node(1)
    printer.line(node, "[rank1]:the worker's last line")  # type: ignore[arg-type]  # _Node has what line reads
    printer.line(node, records.frame(records.WorkerExit(rank=1, local_rank=0, pid=9, exitcode=12)))  # type: ignore[arg-type]
    printer.line(node, records.frame(records.WorkerExit(rank=0, local_rank=1, pid=8, exitcode=1)))  # type: ignore[arg-type]
    printer.line(node, "torchrun: failed")  # type: ignore[arg-type]
    printer.line(node, records.frame(records.AgentReport(lines=2)))  # type: ignore[arg-type]
    for line in ("Traceback (most recent call last):", "ChildFailedError", "after the report"):
        printer.line(node, line)  # type: ignore[arg-type]
    printer.line(node, "[rank1]:" + records.FRAME + '{"kind": "later"}')  # type: ignore[arg-type]  # unreadable: shown
    printer.close()
    shown = out.getvalue()
    assert records.FRAME not in shown.replace(records.FRAME + '{"kind": "later"}', "")
    assert "Traceback" not in shown and "ChildFailedError" not in shown and "[node1] after the report" in shown
    assert printer.findings.worker_code(1) == 12  # the first failed worker's
    assert printer.findings.tail(node.index) == ["[node1 rank1] the worker's last line",  # type: ignore[arg-type]
                                  "[node1] worker rank 1 (pid 9) failed (exitcode: 12)"]


def test_a_traceback_record_shows_its_exception_once_in_place_of_every_ranks_traceback() -> None:
    """Two ranks on two nodes fail alike: one line for both ranks on the console, no traceback
    line; a rank's lines after its traceback, and another rank's lines during it, still show."""
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300), Dedup(2))
    trace = ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "RuntimeError: peer gone"]
    record = records.frame(records.Traceback(lines=len(trace), line="RuntimeError: peer gone  (its traceback: log)"))
    for index in (0, 1):
        node = _Node(index)
        printer.line(node, f"[rank{index}]:{record}")  # type: ignore[arg-type]
        printer.line(node, f"[rank{index}]:{trace[0]}")  # type: ignore[arg-type]
        printer.line(node, "[rank9]:another rank goes on")  # type: ignore[arg-type]
        for line in trace[1:]:
            printer.line(node, f"[rank{index}]:{line}")  # type: ignore[arg-type]
    printer.line(_Node(0), "[rank0]:after it")  # type: ignore[arg-type]
    printer.close()
    shown = out.getvalue()
    assert shown.count("RuntimeError: peer gone") == 1 and "[all 2 ranks] RuntimeError: peer gone" in shown, shown
    assert "Traceback" not in shown and "t.py" not in shown and records.FRAME not in shown, shown
    assert "another rank goes on" in shown and "[node0 rank0] after it" in shown, shown


def test_a_traceback_no_agent_copied_is_one_line_and_an_unfinished_one_shows_as_it_came() -> None:
    """launch ssh and docker: the workers' lines reach the launcher as torch's traceback hook
    tagged them (`[rank0]: ` before each line), with no record ahead of them."""
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    trace = ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "    step()",
             "RuntimeError: Connection closed by peer"]
    for line in ["step 5", *trace, "", "At:", "  hooks.py(31): <lambda>", "after it"]:  # torch's C++ frames too
        printer.line(_Node(0), f"[rank0]: {line}")  # type: ignore[arg-type]
    for line in trace[:2]:  # rank 1 killed while its hook wrote
        printer.line(_Node(1), f"[rank1]: {line}")  # type: ignore[arg-type]
    printer.close()
    assert out.getvalue().splitlines() == [
        "[node0 rank0]  step 5",
        "[node0 rank0] RuntimeError: Connection closed by peer  (its traceback: the node's log)",
        "[node0 rank0]  after it",
        "[node1 rank1]  Traceback (most recent call last):",
        '[node1 rank1]    File "t.py", line 3, in <module>']


def test_a_line_glued_to_an_unfinished_one_is_a_line_of_its_own() -> None:
    """launch ssh, docker: the workers share the agent's stream, so a bar without its newline
    (a rank killed mid-bar) gets the agent's record or torch's warning glued to it."""
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    exit_record = records.frame(records.WorkerExit(rank=1, local_rank=0, pid=9, exitcode=3))
    printer.line(_Node(1), f"\rtrain:  0%|\rtrain: 52%|{exit_record}")  # type: ignore[arg-type]
    printer.line(_Node(1), "\rtrain:  0%|[rank1]:[W1127 reducer.cpp:1529] Warning: find_unused")  # type: ignore[arg-type]
    printer.line(_Node(0), f"[rank0]:{exit_record}")  # type: ignore[arg-type]  # torchrun's tag before a record: its own
    printer.close()
    assert out.getvalue().splitlines() == ["[node1] train: 52%|", "[node1] train:  0%|",
                                           "[node1 rank1] [W1127 reducer.cpp:1529] Warning: find_unused"]
    assert printer.findings.worker_code(1) == 3 and printer.findings.worker_code(0) == 3


def test_torchs_reverse_dns_warning_stays_off_the_console() -> None:
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    warning = ("[W1127 10:00:00.000000 77 torch/csrc/distributed/c10d/socket.cpp:1033] The hostname of the client "
               "socket cannot be retrieved. err=-3")
    printer.line(_Node(0), warning)  # type: ignore[arg-type]  # the agent's own store
    printer.line(_Node(1), "[rank1]:" + warning)  # type: ignore[arg-type]  # a worker's
    printer.line(_Node(1), "[rank1]:training")  # type: ignore[arg-type]
    printer.close()
    assert "hostname" not in out.getvalue() and "[node1 rank1] training" in out.getvalue()


def test_a_line_redrawn_with_carriage_returns_is_shown_as_a_terminal_shows_it() -> None:
    """Where no agent copied the worker's output line by line (launch ssh, docker), a bar's redraws
    arrive as one line: its last state is shown, once, with one prefix."""
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    printer.line(_Node(1), "\rtrain:   0%| | 0/40\rtrain:  50%| | 20/40\rtrain: 100%| | 40/40")  # type: ignore[arg-type]
    printer.line(_Node(1), "[rank1]:\rstep 1\rstep 2\r")  # type: ignore[arg-type]
    printer.close()
    assert out.getvalue().splitlines() == ["[node1] train: 100%| | 40/40", "[node1 rank1] step 2"]


def test_metrics_framed_for_the_launcher_are_kept_in_its_file_with_their_times(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A job told to send its metrics to the launcher (agreed.METRICS_TO_LAUNCHER)
    frames them with their time and writes no file; the launcher's MetricsSink
    keeps the kinds a metrics file holds, from any rank's line, and nothing else."""
    metrics = Metrics(Path(METRICS_TO_LAUNCHER), enabled=True)
    metrics.put(records.Train(10, 1.5, 100.0))
    metrics.put(records.StepTimes(10, (0.01, 0.02)))
    metrics.close()
    framed = capsys.readouterr().err.splitlines()
    assert [records.unframe(line).time is not None for line in framed] == [True, True], framed  # type: ignore[union-attr]
    assert not Path(METRICS_TO_LAUNCHER).exists()
    kept, warned = tmp_path / "run" / "metrics.jsonl", []
    out = io.StringIO()
    printer = LinePrinter(Console(file=out, width=300))
    printer.on_record = MetricsSink(kept, warned.append)
    node = _Node(0)
    for line in [framed[0], "[rank1]:" + framed[1], records.frame(records.WorkerExit(1, 0, 9, 12)),
                 records.frame(EVERY_KIND[1]), "a line for people"]:
        printer.line(node, line)  # type: ignore[arg-type]
    printer.close()
    stamped = records.read_file(kept)
    assert [s.record for s in stamped] == [records.Train(10, 1.5, 100.0), records.StepTimes(10, (0.01, 0.02)),
                                           EVERY_KIND[1]]  # the worker's exit is the launcher's only
    assert [s.time for s in stamped[:2]] == [records.unframe(line).time for line in framed]  # type: ignore[union-attr]
    assert records.FRAME not in out.getvalue() and "a line for people" in out.getvalue() and warned == []
    gone = MetricsSink(tmp_path / "a-file" / "metrics.jsonl", warned.append)
    (tmp_path / "a-file").write_text("not a folder")
    gone(stamped[0])
    gone(stamped[1])
    assert len(warned) == 1 and "no longer kept in" in warned[0], warned  # said once; the run goes on


def test_an_elastic_job_says_it_trained_again_and_from_which_world_size() -> None:
    from ddpkit.train.loop.elastic import reformed
    from ddpkit.train.startup.launchinfo import AgentRestarts

    assert reformed(None, 2, 3) is None  # not restarted by an elastic agent: nothing re-formed
    record = reformed(AgentRestarts(restart=1, max_restarts=3), 2, 3)
    assert record == records.Reformed(restart=1, max_restarts=3, world=2, saved_world=3) and record.before == 3
    assert records.Reformed(restart=0, max_restarts=3, world=2, saved_world=None).before == 2


def test_the_tags_on_a_line_are_read_as_torchrun_and_srun_write_them() -> None:
    from ddpkit.records import RANK_TAG_FLAG, is_frame, rank_tagged, task_labelled

    assert RANK_TAG_FLAG == "--log-line-prefix-template=[rank${rank}]:"
    assert rank_tagged("[rank12]:epoch 1 [rank3]: x") == (12, "epoch 1 [rank3]: x")
    assert rank_tagged("[rank]:x") is None and rank_tagged("[rankA]:x") is None and rank_tagged("[rank1] x") is None
    assert rank_tagged("text [rank1]:x") is None
    assert task_labelled("  3: hello: world") == (3, "hello: world")
    assert task_labelled("12:") == (12, "")
    assert task_labelled("\t0:  two spaces") == (0, " two spaces")
    assert task_labelled("batch shell: 3") is None and task_labelled(" x1: y") is None
    assert is_frame("@@ddpkit-record {}") and not is_frame("ddpkit watchdog: STALL")


def test_ddpkit_logs_and_submit_follow_keep_records_off_the_screen(tmp_path: Path) -> None:
    """Both print the Slurm backend's lines (launch/control/logs.slurm_source)."""
    from ddpkit.launch.control.logs import LogRequest, slurm_source
    from ddpkit.runs import RunFolder, RunTarget, SlurmJob

    frame = records.frame(records.Reformed(restart=1, max_restarts=3, world=2, saved_world=3))
    out = tmp_path / "j-7.out"
    out.write_text(f"1: {frame}\n1: people read this\n")
    run = RunFolder.create(name="j", target=RunTarget.SLURM, nodes=2, nproc_per_node=1, spec_yaml="",
                           stop_grace_s=90, root=tmp_path / "runs")
    run.set_slurm(SlurmJob(job_id=7, script=str(tmp_path / "j.sbatch"), output=str(out), tasks_per_node=1,
                           rank_per_task=False, signal="USR2", signal_grace_s=90))
    source, _ = slurm_source(run.record(), LogRequest())
    assert source.read() == ["[node1] people read this"]


def test_where_records_have_a_folder_each_node_keeps_them_in_its_file_and_the_stream_gets_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The channel the job's environment names (the rendered Slurm job's folder): every
    record goes to this node's file there, with its time; stderr, which people read, gets
    none; the folder's reader merges the nodes' files by time."""
    from ddpkit.shared import envnames

    assert records.CHANNEL_VAR == envnames.DDPKIT_RECORDS
    folder = tmp_path / "job-7.records"
    monkeypatch.setenv(records.CHANNEL_VAR, str(folder))
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    before = time.time()
    records.emit(records.Stop("SIGUSR2", 10, "/c/ckpt-10.pt", 0))
    records.emit(records.WorkerExit(1, 0, 9, 12), time=5.0)
    assert capsys.readouterr().err == ""
    assert sorted(p.name for p in folder.iterdir()) == ["node2.jsonl"]
    records.append(records.node_file(folder, "node1"), records.Straggler("slow", 3, 1, "h1", 41, 0.3, 0.01, 30.0,
                                                                          1.33, 10), 7.0)
    read = records.read_folder(folder)
    assert [s.record.kind for s in read] == ["worker_exit", "straggler", "stop"]  # by time, across nodes
    assert read[0].time == 5.0 and read[2].time is not None and read[2].time >= round(before, 3) - 0.001
    assert records.read_folder(tmp_path / "no-such") == []


def test_a_records_folder_that_cannot_be_written_leaves_the_record_framed_on_the_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv(records.CHANNEL_VAR, str(tmp_path / "a-file" / "records"))
    records.emit(records.WorkerExit(1, 0, 9, 12))
    (line,) = capsys.readouterr().err.splitlines()
    assert records.unframe(line) is not None and records.unframe(line).record == records.WorkerExit(1, 0, 9, 12)  # type: ignore[union-attr]


def test_the_agents_copier_keeps_a_tracebacks_record_in_the_folder_and_its_lines_in_the_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ddpkit.agent.tailing import tail_logfile

    trace = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "    boom()",
             "RuntimeError: boom"]
    log = tmp_path / "stderr.log"
    log.write_text("step 1\n" + "".join(f"{line}\n" for line in trace))
    monkeypatch.setenv(records.CHANNEL_VAR, str(tmp_path / "records"))
    finished, dst = threading.Event(), io.StringIO()
    finished.set()
    tail_logfile("[rank3]:", str(log), dst, finished, 0.01)
    assert dst.getvalue().splitlines() == [f"[rank3]:{line}" for line in ["step 1", *trace]]
    (kept,) = records.read_folder(tmp_path / "records")
    assert isinstance(kept.record, records.Traceback) and kept.record.line.startswith("RuntimeError: boom")


def test_the_rendered_slurm_job_names_the_records_folder_its_readers_look_in(tmp_path: Path) -> None:
    """The script's DDPKIT_RECORDS, as bash expands it in a job, is `records.slurm_folder`
    (what `ddpkit status` and `ddpkit report` read), whatever the shell that ran sbatch exported."""
    import subprocess

    from ddpkit.spec.yamlfile import build_spec
    from ddpkit.targets import render

    spec = build_spec({"name": "tiny-job", "nodes": 2, "command": {"script": "train.py"}})
    [script] = render(spec, "slurm").write(tmp_path)
    (line,) = [x for x in script.read_text().splitlines() if x.startswith(f"export {records.CHANNEL_VAR}=")]
    env = {"SLURM_SUBMIT_DIR": str(tmp_path / "sub"), "SLURM_JOB_ID": "77", "PATH": "/usr/bin:/bin"}
    said = subprocess.run(["bash", "-c", f'{line}; printf %s "${records.CHANNEL_VAR}"'], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert Path(said) == records.slurm_folder(tmp_path / "sub", script.stem, 77) == tmp_path / "sub/tiny-job-77.records"
    exported = subprocess.run(["bash", "-c", f'{line}; printf %s "${records.CHANNEL_VAR}"'],
                              env={**env, records.CHANNEL_VAR: "/elsewhere"}, capture_output=True, text=True,
                              check=True).stdout
    assert exported == said


def test_ddpkit_status_reads_each_runs_stop_from_a_slurm_jobs_records_folder(tmp_path: Path) -> None:
    from ddpkit.launch.control.backends.slurm import record_lines
    from ddpkit.runs import SlurmJob

    job = SlurmJob(job_id=4711, script=str(tmp_path / "big.sbatch"), output=str(tmp_path / "big-4711.out"),
                   tasks_per_node=1, rank_per_task=False, signal="USR2", signal_grace_s=90)
    folder = records.slurm_folder(tmp_path, "big", 4711)
    assert record_lines(job) == [f"records   {folder} (none)"]  # a job rendered before the folder was
    for node in ("node1", "node2"):  # every rank of ddpkit's own stop path may say it: one line a run
        records.append(folder / f"{node}.jsonl", records.Stop("SIGUSR2", 22, "/c/ckpt-22.pt", 0), 10.0)
    records.append(folder / "node1.jsonl", records.Stop("SIGTERM", 40, None, 1), 20.0)
    assert record_lines(job) == [f"records   {folder} (3: stop)",
                                 "stopped   run 1: SIGUSR2 at step 22, checkpoint at step 22",
                                 "stopped   run 2: SIGTERM at step 40, no checkpoint"]
