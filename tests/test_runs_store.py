"""The run store's own parts (ddpkit.runs): run.json changed under the
folder's lock, so a launcher and `ddpkit status` writing at once keep both
changes; the one log tailer (`Tail`), whose partial line waits for its
newline; and the run commands' one error-to-line mapper."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from filelock import FileLock

from ddpkit.launch.control.common import RunCommandError, ToolMissing, exit_line
from ddpkit.runs import NodeLog, NodeRow, RunFolder, RunSummary, RunTarget, SlurmJob, StoredRun, Tail, UnknownRun
from ddpkit.runs import folder as run_folder
from ddpkit.shared.exitcodes import ExitCode

ROUNDS = 150
E_ACUTE = "\u00e9".encode()  # two bytes in UTF-8


def _job(n: int) -> SlurmJob:
    return SlurmJob(job_id=n, script="/s", output="/o", tasks_per_node=1, rank_per_task=False, signal="USR2",
                    signal_grace_s=90)


def _set_logs(path: str) -> None:
    folder = RunFolder(Path(path))
    for n in range(ROUNDS):
        folder.set_logs([NodeLog(node=0, host="h", path=f"/log{n}")])


def _set_slurm(path: str) -> None:
    folder = RunFolder(Path(path))
    for n in range(ROUNDS):
        folder.set_slurm(_job(n))


def test_two_writers_at_once_keep_both_changes(tmp_path: Path) -> None:
    """Each read-modify-write holds the lock: without it, one writer's
    record read before the other's write puts back the field it changed."""
    folder = RunFolder.create(name="race", target="slurm", nodes=1, nproc_per_node=1, spec_yaml="name: race\n",
                              root=tmp_path)
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=f, args=(str(folder.path),)) for f in (_set_logs, _set_slurm)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
    assert [w.exitcode for w in writers] == [0, 0]
    record = folder.record()
    assert record.logs == [NodeLog(node=0, host="h", path=f"/log{ROUNDS - 1}")]
    assert record.slurm == _job(ROUNDS - 1)


def test_an_older_run_json_says_none_where_it_said_lost_for_no_exit_status(tmp_path: Path) -> None:
    """The summary's exit-code cell of a node that ended without an exit
    status says `none`; a run.json written when it said `lost` (now only a
    node the watchdog found silent) reads as `none`, and is written back so."""
    folder = RunFolder.create(name="old", target="ssh", nodes=2, nproc_per_node=1, spec_yaml="name: old\n",
                              root=tmp_path)
    rows = [NodeRow(node=0, exit_code="0", status="ok", host="a"),
            NodeRow(node=1, exit_code="none", status="failed first", host="b")]
    folder.finish(1, RunSummary(title="launch ssh", elapsed_s=1.0, rows=rows, closing="x"))
    run_json = folder.path / "run.json"
    older = run_json.read_text().replace('"exit_code": "none"', '"exit_code": "lost"')
    assert '"lost"' in older
    run_json.write_text(older)
    summary = folder.record().summary
    assert summary is not None and [r.exit_code for r in summary.rows] == ["0", "none"]
    folder.update(exit_code=1)
    assert '"lost"' not in run_json.read_text()


def test_one_target_vocabulary_keyed_to_the_backends(tmp_path: Path) -> None:
    """A run's target is a RunTarget: run.json holds its word, every target
    has its backend, `ddpkit render`'s words are targets, and a run.json
    with a word that is none is not read as a run."""
    from ddpkit.launch.control.applied import RENDER_TARGETS, recorded_target
    from ddpkit.launch.control.backends import Backends
    from ddpkit.launch.control.backends.compose import Compose
    from ddpkit.launch.control.backends.kubectl import Kubectl
    from ddpkit.launch.control.backends.launched import Launched
    from ddpkit.launch.control.backends.slurm import Slurm
    from ddpkit.launch.slurm.jobs import SlurmQueue
    from ddpkit.targets import TARGETS

    kinds = {RunTarget.LOCAL: Launched, RunTarget.DOCKER: Launched, RunTarget.SSH: Launched, RunTarget.SLURM: Slurm,
             RunTarget.K8S: Kubectl, RunTarget.COMPOSE: Compose}
    assert set(kinds) == set(RunTarget)
    backends = Backends(SlurmQueue([]))
    for target, kind in kinds.items():
        folder = RunFolder.create(name=f"t-{target}", target=target, nodes=1, nproc_per_node=1, spec_yaml="",
                                  root=tmp_path)
        assert f'"target": "{target.value}"' in (folder.path / "run.json").read_text()
        record = folder.record()
        assert record.target is target and f"{record.target}" == target.value
        backend = backends.of(StoredRun(folder, record))
        assert isinstance(backend, kind), (target, backend)
        if isinstance(backend, Launched):
            assert backend.launcher == f"launch {target.value}"
    assert set(TARGETS) <= {t.value for t in RunTarget}, TARGETS
    assert {t.value for t in RENDER_TARGETS} <= set(TARGETS)
    assert recorded_target("k8s") is RunTarget.K8S and recorded_target("slurm") is None
    other = tmp_path / "t-local-other"
    other.mkdir()
    (other / "run.json").write_text(folder.path.joinpath("run.json").read_text().replace('"compose"', '"nomad"'))
    with pytest.raises(ValueError, match="target"):
        RunFolder(other).record()


def test_a_lock_held_too_long_is_an_os_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = RunFolder.create(name="held", target="local", nodes=1, nproc_per_node=1, spec_yaml="name: held\n",
                              root=tmp_path)
    monkeypatch.setattr(run_folder, "LOCK_S", 0.2)
    with FileLock(folder.path / run_folder.LOCK), pytest.raises(OSError, match="held for over 0.2 s"):
        folder.finish(0)
    assert folder.finish(0).exit_code == 0  # free again: the end is written


def test_tail_returns_complete_lines_and_keeps_the_partial_one(tmp_path: Path) -> None:
    path = tmp_path / "node0.log"
    tail = Tail(path)
    assert tail.read() == []  # no file yet
    path.write_bytes(b"one\ntw")
    assert tail.read() == ["one"]
    with path.open("ab") as out:
        out.write(b"o\nthr" + E_ACUTE[:1])  # a character cut in two
    assert tail.read() == ["two"]
    with path.open("ab") as out:
        out.write(E_ACUTE[1:] + b"e\nlast")
    assert tail.read() == ["thr\u00e9e"]
    assert tail.read() == []
    assert tail.rest() == ["last"] and tail.rest() == []


@pytest.mark.parametrize(("error", "line", "code"), [
    (UnknownRun("no run 'x'"), "no run 'x'", ExitCode.BAD_INPUT),
    (RunCommandError("refused", ExitCode.FAILED), "refused", ExitCode.FAILED),
    (ToolMissing("kubectl", "kubectl logs -l a=b"), "kubectl is not installed here; where it is, run: kubectl logs "
                                                     "-l a=b", ExitCode.PREFLIGHT),
    (FileNotFoundError(2, "No such file", "scancel"), "scancel is not installed here: run this on a host that has "
                                                      "it (a Slurm login node)", ExitCode.PREFLIGHT),
    (PermissionError(13, "Permission denied"), "[Errno 13] Permission denied", ExitCode.FAILED),
])
def test_every_error_a_run_command_meets_is_one_line_and_its_exit_code(error: Exception, line: str,
                                                                       code: int) -> None:
    assert exit_line(error) == (line, code)


def test_an_error_no_run_command_expects_is_not_hidden() -> None:
    assert exit_line(ValueError("a bug")) is None
