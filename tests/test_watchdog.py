"""The hang watchdog's parts without a job: the judge's rule, the heartbeat
format, the settings and the job environment, the report, the store
protocol (a real TCPStore), and the supervisor's reading of the report."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from ddpkit import records
from ddpkit.contract import RowKey, target_env
from ddpkit.launch.supervise.nodeoutput import LinePrinter
from ddpkit.launch.supervise.nodestate import NodeState, NodeTrack
from ddpkit.launch.supervise.outcome import Outcome
from ddpkit.launch.supervise.summary import SummaryStatus, node_status
from ddpkit.launch.supervise.supervisor import Supervisor
from ddpkit.shared import envnames
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.spec import JobSpec
from ddpkit.train.watchdog import stacks, stall, stall_report
from ddpkit.train.watchdog.stall_model import FACTOR, PULSE, Beat, Judge, Phase, Settings, in_phase, monitors, progress

S = Settings(stall_s=10.0)


def beat(rank: int, seq: int, beats: int, step: int = 5, phase: Phase = Phase.BACKWARD, step_s: float = 0.5,
         node: int = 0, warm: bool = True) -> Beat:
    return Beat(rank, seq, beats, step, phase, step_s, warm, node, 1000 + rank, f"host{node}")


def run(judge: Judge, rounds: list[tuple[float, list[Beat | None]]]) -> list[object]:
    return [judge.observe(beats, now) for now, beats in rounds]


def test_progress_of_any_rank_keeps_it_quiet_and_no_progress_past_the_limit_is_a_stall() -> None:
    judge = Judge(2, S)
    # both ranks publish every second; rank 1 waits (no progress) from t=1 while
    # rank 0 works on until t=20 (a rank-0-only task): then neither progresses
    rounds = [judge.observe([beat(0, t, min(t, 20)), beat(1, t, min(t, 1))], float(t)) for t in range(33)]
    assert rounds[:31] == [None] * 31  # at t=30, 10 s without progress is not yet more than 10 s
    verdict = rounds[31]
    assert verdict is not None and verdict.limit_s == 10.0 and verdict.idle_s == 11.0


def test_a_frozen_rank_is_named_over_the_ranks_that_wait_for_it() -> None:
    judge = Judge(3, S)
    for t in range(13):
        frozen = beat(2, min(t, 1), min(t, 1), node=1)  # SIGSTOP at t=1: no heartbeat, no progress
        verdict = judge.observe([beat(0, t, 3), beat(1, t, 3), frozen], float(t))
    assert verdict is not None
    assert [(s.beat.rank, s.frozen_s) for s in verdict.suspects] == [(2, 11.0)]
    assert verdict.waiting == (0, 1)


def test_without_a_frozen_rank_the_one_furthest_behind_is_named() -> None:
    judge = Judge(3, S)
    for t in range(13):
        verdict = judge.observe([beat(0, t, 3), beat(1, t, 3, phase=Phase.FORWARD), beat(2, t, 3, step=5)], float(t))
    assert verdict is not None and [s.beat.rank for s in verdict.suspects] == [1]
    assert all(s.frozen_s is None for s in verdict.suspects)


def test_the_limit_follows_the_slowest_step_and_the_first_steps_get_first_step_s() -> None:
    slow = Judge(1, S)
    assert run(slow, [(0, [beat(0, 0, 0, step_s=4.0)]), (19, [beat(0, 1, 0, step_s=4.0)])]) == [None, None]
    assert slow.limit_s() == FACTOR * 4.0
    first = Judge(1, S)  # in its first step: 5 x stall_s
    cold = {"step": 0, "step_s": 0.0, "warm": False}
    assert run(first, [(0, [beat(0, 0, 0, **cold)]), (49, [beat(0, 1, 0, **cold)])]) == [None, None]
    assert first.observe([beat(0, 2, 0, **cold)], 51.0) is not None
    warm = Judge(1, S)  # one step done, no step time measured yet: stall_s
    assert run(warm, [(0, [beat(0, 0, 1, step=1, step_s=0.0)]), (11, [beat(0, 1, 1, step=1, step_s=0.0)])])[1] \
        is not None


@pytest.mark.parametrize("phase", [Phase.SETUP, Phase.DONE])
def test_setup_and_done_are_not_judged(phase: Phase) -> None:
    judge = Judge(1, S)
    assert run(judge, [(0, [beat(0, 0, 0, phase=phase)]), (100, [beat(0, 1, 0, phase=phase)])]) == [None, None]


def test_a_rank_still_in_start_up_while_the_others_wait_in_their_first_step_is_named() -> None:
    """Rank 1's checkpoint read never returns: its heartbeat goes on (the watchdog's thread), its phase
    stays setup; rank 0 waits in its first step's all-reduce. After first_step_s (5 x 10 s) of nobody's
    progress, rank 1 is named, not rank 0 that waits for it."""
    cold = {"step": 0, "step_s": 0.0, "warm": False}
    judge = Judge(2, S)
    verdicts = [judge.observe([beat(0, t, 1, **cold), beat(1, t, 0, phase=Phase.SETUP, **cold)], float(t))
                for t in range(52)]
    assert verdicts[:51] == [None] * 51 and verdicts[51] is not None
    assert [s.beat.rank for s in verdicts[51].suspects] == [1] and verdicts[51].waiting == (0,)
    # the control: rank 1's start-up ends at t=30 and both train on; no verdict
    judge = Judge(2, S)
    late = [judge.observe([beat(0, t, 1 if t < 30 else t, **cold),
                           beat(1, t, 0 if t < 30 else t, phase=Phase.SETUP if t < 30 else Phase.FORWARD, **cold)],
                          float(t)) for t in range(60)]
    assert late == [None] * 60


def test_a_rank_in_start_up_that_moves_keeps_the_ranks_that_wait_for_it_from_a_stall() -> None:
    """The control of the test above: rank 1's checkpoint read is slow, but it
    moves (signs of life: its beats grow) for 80 s, longer than first_step_s; no verdict.
    When it stops moving, the verdict comes first_step_s after its last sign of life."""
    cold = {"step": 0, "step_s": 0.0, "warm": False}
    judge = Judge(2, S)
    verdicts = [judge.observe([beat(0, t, 1, phase=Phase.SYNC, **cold),
                               beat(1, t, min(t, 80), phase=Phase.SETUP, **cold)], float(t)) for t in range(132)]
    assert verdicts[:131] == [None] * 131
    assert verdicts[131] is not None and [s.beat.rank for s in verdicts[131].suspects] == [1]


def test_a_rank_in_start_up_that_moves_is_named_slow_once_when_the_others_waited_past_the_limit() -> None:
    cold = {"step": 0, "step_s": 0.0, "warm": False}
    judge = Judge(3, S)  # first_step_s: 50 s
    named = []
    for t in range(80):
        judge.observe([beat(0, t, 1, phase=Phase.SYNC, **cold), beat(1, t, t, phase=Phase.SETUP, **cold),
                       beat(2, t, 1, phase=Phase.SYNC, **cold)], float(t))
        waited, slow = judge.slow_starters(float(t))
        named += [(t, waited, b.rank) for b in slow]
    assert named == [(51, 51.0, 1)]
    line = stall_report.slow_start_line(beat(1, 0, 0, node=1), 51.0)
    assert line == ("ddpkit watchdog: rank 1 (node 1, host1) is still starting up 51s after the others began to "
                    "wait for it; it moves, so it is slow, not stuck: the job goes on")


def test_a_checkpoint_write_gets_the_longer_limit() -> None:
    judge = Judge(1, S)
    rounds = [(0.0, [beat(0, 0, 0, phase=Phase.CHECKPOINT)]), (30.0, [beat(0, 1, 0, phase=Phase.CHECKPOINT)])]
    assert run(judge, rounds) == [None, None]


def test_a_rank_not_yet_published_is_waited_for_then_listed() -> None:
    judge = Judge(2, S)
    verdicts = run(judge, [(0, [beat(0, 0, 1), None]), (11, [beat(0, 1, 1), None])])
    assert verdicts[0] is None and verdicts[1] is not None and verdicts[1].waiting == (1,)


def test_heartbeat_round_trip_and_monitors() -> None:
    b = Beat(7, 3, 99, 12, Phase.EVAL, 0.0123, False, 2, 4242, "gpu-node 7")
    assert Beat.decode(7, b.encode()) == Beat(7, 3, 99, 12, Phase.EVAL, 0.0123, False, 2, 4242, "gpu-node 7")
    assert monitors(1, 1) == (0,) and monitors(4, 4) == (0, 1) and monitors(16, 8) == (0, 8)


def test_pulse_api() -> None:
    PULSE.phase = Phase.SETUP
    before = PULSE.beats
    progress(3)
    assert (PULSE.step, PULSE.phase, PULSE.beats) == (3, Phase.TRAIN, before + 1)
    with in_phase(Phase.EVAL):
        assert PULSE.phase is Phase.EVAL
    assert PULSE.phase is Phase.TRAIN and PULSE.beats == before + 3


def test_settings_from_env() -> None:
    assert Settings.from_env({}) == Settings(60.0, None)
    got = Settings.from_env({envnames.DDPKIT_WATCHDOG_STALL_S: "8", envnames.DDPKIT_WATCHDOG_FIRST_STEP_S: "30"})
    assert (got.stall_s, got.first_step_limit, got.enabled) == (8.0, 30.0, True)
    assert not Settings.from_env({envnames.DDPKIT_WATCHDOG_STALL_S: "0"}).enabled
    with pytest.raises(ValueError, match="DDPKIT_WATCHDOG_STALL_S='soon'"):
        Settings.from_env({envnames.DDPKIT_WATCHDOG_STALL_S: "soon"})


def test_job_env_carries_the_spec_and_turns_the_flight_recorder_on_with_nccl() -> None:
    spec = JobSpec.model_validate({"name": "j", "watchdog": {"stall_s": 30, "first_step_s": 600}})
    env = target_env(spec, RowKey.SLURM)
    assert env[envnames.DDPKIT_WATCHDOG_STALL_S] == "30" and env[envnames.DDPKIT_WATCHDOG_FIRST_STEP_S] == "600"
    assert env[envnames.TORCH_NCCL_TRACE_BUFFER_SIZE] == "2000" and env[envnames.TORCH_NCCL_DUMP_ON_TIMEOUT] == "1"
    cpu = JobSpec.model_validate({"name": "j", "device": "cpu", "watchdog": {"enabled": False}})
    env = target_env(cpu, RowKey.LOCAL)
    assert env[envnames.DDPKIT_WATCHDOG_STALL_S] == "0" and envnames.TORCH_NCCL_TRACE_BUFFER_SIZE not in env
    mine = JobSpec.model_validate({"name": "j", "env": {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}})
    assert target_env(mine, RowKey.SLURM)[envnames.TORCH_NCCL_TRACE_BUFFER_SIZE] == "50"  # the user's value wins


def test_spec_refuses_a_stall_limit_below_a_second() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        JobSpec.model_validate({"name": "j", "watchdog": {"stall_s": 0.5}})


def _record(*suspects: dict, frozen: tuple[int, ...] = (), waiting: tuple[int, ...] = ()) -> dict:
    return {"by": 0, "idle_s": 12.0, "limit_s": 10.0, "suspects": list(suspects), "frozen": list(frozen),
            "waiting": list(waiting)}


def _suspect(rank: int, frozen_s: float | None = None) -> dict:
    return {"rank": rank, "node": rank // 2, "host": f"h{rank // 2}", "pid": 100 + rank, "step": 5,
            "phase": "forward", "idle_s": 12.0, "frozen_s": frozen_s}


def test_refine_keeps_the_rank_running_its_own_code_over_ranks_inside_torch() -> None:
    record = _record(_suspect(0), _suspect(1), _suspect(2))
    acks = {0: stall_report.Ack("torch/nn/parallel/distributed.py:1 in forward", True, None),
            1: stall_report.Ack("model.py:3 in forward", False, None),
            2: stall_report.Ack("torch/nn/parallel/distributed.py:1 in forward", True, None)}
    assert [s["rank"] for s in stall_report.refine(record, acks)] == [1]
    assert [s["rank"] for s in stall_report.refine(record, {})] == [0, 1, 2]  # no stacks: no way to tell


def test_the_stall_record_carries_each_named_ranks_frame_and_the_ranks_without_stacks() -> None:
    record = _record(_suspect(0), _suspect(1))
    acks = {1: stall_report.Ack("model.py:3 in forward", False, "/logs/stall-rank1.txt")}
    report = stall_report.stall_record(record, acks, 3, "here")
    assert [(s.rank, s.frame, s.dump) for s in report.stalled] == [(1, "model.py:3 in forward", "/logs/stall-rank1.txt")]
    assert report.no_stack == (0, 2) and report.dumps == "here"
    assert report.stalled[0].detail == "step 5, phase forward, at model.py:3 in forward"
    assert records.decode(records.encode(report)).record == report


def test_report_lines_name_the_rank_and_where_the_dumps_are(tmp_path: Path) -> None:
    record = _record(_suspect(3, frozen_s=9.0), frozen=(3,), waiting=tuple(range(3)) + tuple(range(4, 9)))
    acks = {r: stall_report.Ack("torch/x.py:1 in wait", True, f"{tmp_path}/logs/node{r // 2}/stall-rank{r}.txt")
            for r in range(9) if r != 3}
    report = stall_report.stall_record(record, acks, 9, stall_report.dump_place(acks, nccl=True))
    lines = stall_report.report_lines(report, [s["rank"] for s in record["suspects"]])
    assert lines[0].startswith("ddpkit watchdog: the job stalled: no progress for 12s (limit 10s); stalled rank(s): 3")
    assert lines[1].startswith("ddpkit watchdog: STALL rank 3 node 1 host h1 pid 103: step 5, phase forward, frozen")
    assert lines[2] == "ddpkit watchdog: 8 rank(s) waited for them: 0-2, 4-8"
    assert lines[3] == (f"ddpkit watchdog: stacks of every rank: {tmp_path}/logs/node<N>/stall-rank<R>.txt; "
                        f"NCCL flight recorder: {tmp_path}/logs/node<N>/nccl-trace-rank<R>.pkl")
    assert len(lines) == 4


def test_the_place_of_the_stacks_says_which_ranks_had_no_file() -> None:
    acks = {0: stall_report.Ack("a.py:1 in f", False, "/run/logs/node0/stall-rank0.txt"),
            1: stall_report.Ack("a.py:1 in f", False, None)}
    assert stall_report.dump_place(acks, nccl=False) == "/run/logs/node<N>/stall-rank<R>.txt; rank(s) 1: on their stderr"
    assert stall_report.dump_place({1: acks[1]}, nccl=False).startswith("each rank's stderr")


def test_the_stacks_go_to_the_nodes_log_folder_that_torchrun_was_given(tmp_path: Path) -> None:
    error = "attempt_0/1/error.json"
    assert stacks.stack_folder(None, {envnames.TORCHELASTIC_ERROR_FILE: f"{tmp_path}/logs/node1/job_x1/{error}"}) \
        == tmp_path / "logs" / "node1"
    assert stacks.stack_folder(tmp_path, {envnames.TORCHELASTIC_ERROR_FILE: f"/x/node1/job_x1/{error}"}) == tmp_path
    # torchrun without --log-dir keeps its logs in a temporary folder of its own: nobody would look there
    assert stacks.stack_folder(None, {envnames.TORCHELASTIC_ERROR_FILE: f"/tmp/torchelastic_ab/job_x1/{error}"}) is None
    assert stacks.stack_folder(None, {}) is None
    # ... so where the launcher keeps no folder on the rank's host (launch ssh, Slurm), the job's working folder
    temporary = {envnames.TORCHELASTIC_ERROR_FILE: f"/tmp/torchelastic_ab/job_x1/{error}"}
    assert stacks.stack_folder(None, {**temporary, envnames.TORCHELASTIC_RUN_ID: "job/7", envnames.GROUP_RANK: "1"}) \
        == Path.cwd() / "ddpkit-stacks" / "job_7" / "node1"
    acks = {1: stall_report.Ack("a.py:1 in f", False, "/w/ddpkit-stacks/job_7/node1/stall-rank1.txt")}
    assert stall_report.dump_place(acks, nccl=False) == \
        "/w/ddpkit-stacks/job_7/node<N>/stall-rank<R>.txt (each on its node's host)"


def _spin_until(spinning: threading.Event, got: list) -> None:
    spinning.set()
    while not got:  # no call in the loop: the innermost frame is this one, whenever it is sampled
        pass


def test_main_frame_names_the_main_threads_line() -> None:
    """As on a stall: the watchdog's thread asks, the main thread is busy elsewhere."""
    spinning, got = threading.Event(), []

    def ask() -> None:
        spinning.wait()
        got.append(stacks.main_frame())

    threading.Thread(target=ask).start()
    _spin_until(spinning, got)
    [(frame, in_torch)] = got
    assert "test_watchdog.py" in frame and "in _spin_until" in frame and not in_torch


class _Exited(Exception):
    pass


def _exit(code: int) -> None:
    raise _Exited(code)


def test_the_store_protocol_two_ranks_one_stalled(tmp_path: Path) -> None:
    """Two watchdogs on a real TCPStore, ticked by hand with a clock of the
    test's own: rank 0 (monitor) declares, both dump and acknowledge, rank 0
    reports and releases, both exit STALLED."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dogs = [stall.Watchdog(stall.open_store("127.0.0.1", server.port),
                           stall.Identity(r, 2, 2, 0, "here", 5000 + r), Settings(stall_s=5.0, first_step_s=5.0),
                           stall.Outputs(tmp_path, tmp_path / "m.jsonl"), exit=_exit) for r in (0, 1)]
    PULSE.phase, PULSE.step = Phase.FORWARD, 4
    for t in range(8):  # nobody's beats change: the limit (5 s) passes at t=6
        for dog in dogs[::-1]:
            dog.publish(float(t))
        verdict = dogs[0]._check(float(t))
    assert verdict is not None and [s.beat.rank for s in verdict.suspects] == [0, 1]
    dogs[0].store.compare_set(stall.STALL_KEY, "", json.dumps(stall_report.verdict_record(verdict, 0)))
    codes: dict[int, object] = {}

    def act(dog: stall.Watchdog) -> None:
        try:
            dog.tick(8.0)
        except _Exited as exc:
            codes[dog.ident.rank] = exc.args[0]

    threads = [threading.Thread(target=act, args=(dog,)) for dog in dogs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert codes == {0: ExitCode.STALLED, 1: ExitCode.STALLED}
    [stamped] = records.read_file(tmp_path / "m.jsonl")
    report = stamped.record
    assert isinstance(report, records.Stall) and report.no_stack == () and stamped.time is not None
    assert {s.rank for s in report.stalled} == {0, 1} and all(s.dump for s in report.stalled)
    assert "Thread 0x" in (tmp_path / "stall-rank1.txt").read_text()


class _Node:
    """What LinePrinter and summary.node_status read of a node."""

    def __init__(self, index: int) -> None:
        self.index, self.host, self.label = index, f"h{index}", f"node{index}"

    def exit_code(self) -> int | None:
        return 1


def test_the_supervisor_reads_the_report_status_stalled_and_exit_13() -> None:
    from rich.console import Console

    console = Console(file=open("/dev/null", "w"), width=200)  # noqa: SIM115  (closed with the test process)
    nodes = [_Node(0), _Node(1)]
    sup = Supervisor(nodes, console, 1.0)  # type: ignore[arg-type]  # _Node has what these calls read
    stalled = records.StalledRank(3, 1, "h1", 77, 9, "forward", 9.0, frozen_s=9.0)
    sup.printer.line(nodes[0], "[rank0]:" + records.frame(records.Stall(9.0, 8.0, (stalled,), (), (), "stderr")))
    outcome = Outcome(nodes=[NodeTrack(n, NodeState.FAILED) for n in nodes],  # type: ignore[arg-type]
                      first_failure=nodes[0], stalled=sup.findings.stalled_ranks())  # type: ignore[arg-type]
    assert outcome.code == ExitCode.STALLED
    assert [node_status(n, outcome) for n in nodes] == [SummaryStatus.STOPPED, SummaryStatus.STALLED]  # type: ignore[arg-type]
    assert "stalled rank(s): rank 3 (node 1, h1)" in sup.closing_line(outcome, type("T", (), {"title": "x"})())  # type: ignore[arg-type]
    assert isinstance(sup.printer, LinePrinter)


def test_a_script_job_is_told_that_stall_detection_needs_its_call_only_without_the_preamble() -> None:
    script = JobSpec.model_validate({"name": "j", "command": {"script": "train.py"}})
    assert script.watchdog.script_note(script.command, script.preamble.progress) is None  # the preamble reports
    bare = JobSpec.model_validate({"name": "j", "command": {"script": "train.py"}, "preamble": {"progress": False}})
    assert "ddpkit.watchdog.progress(step)" in (bare.watchdog.script_note(bare.command, bare.preamble.progress) or "")
    default = JobSpec.model_validate({"name": "j"})
    assert default.watchdog.script_note(default.command, default.preamble.progress) is None  # ddpkit train reports


@pytest.mark.parametrize("target", ["slurm", "k8s", "ssh", "compose"])
def test_rendering_a_script_job_without_the_preamble_says_stall_detection_needs_its_call(
        target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rendered target has no ddpkit launcher to print the note at start-up,
    so `ddpkit render` says it when the files are written; the doctor and
    ddpkit's own trainer get no note."""
    from ddpkit.cli import main

    base = ["render", target, "--nodes", "2", "-o", str(tmp_path)]
    assert main([*base, "--set", "command.script=train.py", "--set", "preamble.progress=false"]) == 0
    assert "ddpkit render: stall detection is off: preamble.progress is false, so only a script that calls " \
        "ddpkit.watchdog.progress(step) is watched" in capsys.readouterr().err
    assert main([*base, "--set", "command.script=train.py"]) == 0  # the preamble reports the script's steps
    assert main([*base, "--set", "command.script=train.py", "--doctor"]) == 0
    assert main(base) == 0
    assert "stall detection" not in capsys.readouterr().err


def test_a_frozen_ranks_stale_first_step_does_not_stretch_the_limit() -> None:
    """SIGSTOP can catch a rank whose last heartbeat was from its first step,
    while its peers, which could only finish steps with it, are warm."""
    judge = Judge(2, S)
    for t in range(12):
        verdict = judge.observe([beat(0, t, 3), beat(1, 0, 0, step=0, step_s=0.0, warm=False)], float(t))
    assert verdict is not None and [s.beat.rank for s in verdict.suspects] == [1] and verdict.limit_s == 10.0


def test_a_second_watchdog_of_the_same_round_gets_the_rounds_token_and_a_new_round_a_new_one() -> None:
    """An elastic job's records go under a token of the round, which rank 0
    draws. A program's start-up watchdog and then ddpkit train's (taking over
    in the same process) both ask for it: one token per round, or rank 0's
    and rank 1's records (the last-step writer's claim among them) never meet."""
    from ddpkit.train.watchdog.control_store import _round_token

    rounds = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    first = [_round_token(rounds[0], 0), _round_token(rounds[0], 0), _round_token(rounds[0], 1)]
    assert len(set(first)) == 1 and len(first[0]) == 16
    assert _round_token(rounds[1], 0) != first[0]  # the control: a new round's store, a new token
