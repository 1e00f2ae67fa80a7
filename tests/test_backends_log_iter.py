"""`log_iter`, the lines of a run's log files as its backend gives them
(the backends whose logs are files: ddpkit's own launcher's node logs and
a Slurm job's output file): the lines `ddpkit logs` prints, with the same
prefixes and the same --tail, read from real run folders and files. A
compose run's container lines get the same prefixes (their parsing here;
the real daemon's `ddpkit logs [--follow]`: tests/test_elastic_compose.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit import records
from ddpkit.launch.control.backends.launched import Launched
from ddpkit.launch.control.backends.slurm import Slurm
from ddpkit.launch.control.logs import LogRequest
from ddpkit.runs import NodeLog, RunFolder, RunState, RunTarget, SlurmJob, StoredRun


def _run(tmp_path: Path, target: RunTarget) -> RunFolder:
    return RunFolder.create(name="j", target=target, nodes=2, nproc_per_node=2, spec_yaml="", stop_grace_s=90,
                            root=tmp_path / "runs")


def _lines(backend: Launched | Slurm, run: RunFolder, request: LogRequest) -> list[str]:
    return [line for batch in backend.log_iter(StoredRun(run, run.record()), request) for line in batch]


def _printed(backend: Launched | Slurm, run: RunFolder, request: LogRequest,
             capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert backend.logs(StoredRun(run, run.record()), request) == 0
    return capsys.readouterr().out.splitlines()


def test_a_launch_runs_node_logs_as_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frame = records.frame(records.Reformed(restart=1, max_restarts=3, world=2, saved_world=3))
    logs = []
    for node in (0, 1):
        path = tmp_path / f"node{node}.log"
        path.write_text(f"agent line {node}\n[rank{2 * node}]:first\n[rank{2 * node + 1}]:{frame}\n"
                        f"[rank{2 * node + 1}]:last")  # a last line without its newline: the run has ended
        logs.append(NodeLog(node=node, host=f"h{node}", path=str(path), rank_tagged=True))
    run = _run(tmp_path, RunTarget.LOCAL)
    run.set_logs(logs)
    run.finish(0)
    backend = Launched(RunTarget.LOCAL)
    everything = _lines(backend, run, LogRequest())
    assert everything == ["[node0] agent line 0", "[node0 rank0] first", "[node0 rank1] last",
                          "[node1] agent line 1", "[node1 rank2] first", "[node1 rank3] last"]
    assert everything == _printed(backend, run, LogRequest(), capsys)
    # Followed, the run has ended: the follow ends at once, each file's unfinished last line in its last batch.
    followed = _lines(backend, run, LogRequest(follow=True))
    assert sorted(followed) == sorted(everything) and followed[-2:] == ["[node0 rank1] last", "[node1 rank3] last"]
    assert _lines(backend, run, LogRequest(rank=3)) == ["[node1 rank3] last"] == _printed(
        backend, run, LogRequest(rank=3), capsys)
    assert _lines(backend, run, LogRequest(tail=1)) == ["[node0 rank1] last", "[node1 rank3] last"]


def test_a_slurm_jobs_output_as_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "j-7.out"
    out.write_text("ddpkit: job 7 run 1\n0: zero\n1: one\n2: two\n3: three\n")
    run = _run(tmp_path, RunTarget.SLURM)
    run.set_slurm(SlurmJob(job_id=7, script=str(tmp_path / "j.sbatch"), output=str(out), tasks_per_node=2,
                           rank_per_task=True, signal="USR2", signal_grace_s=90))
    run.finish(0, state=RunState.FINISHED)
    backend = Slurm()
    everything = _lines(backend, run, LogRequest())
    assert everything == ["[batch] ddpkit: job 7 run 1", "[node0 rank0] zero", "[node0 rank1] one",
                          "[node1 rank2] two", "[node1 rank3] three"]
    assert everything == _printed(backend, run, LogRequest(), capsys)
    assert _lines(backend, run, LogRequest(node=1, tail=1)) == ["[node1 rank3] three"] == _printed(
        backend, run, LogRequest(node=1, tail=1), capsys)


def test_a_compose_containers_lines_get_the_consoles_prefixes() -> None:
    """`docker compose logs`'s `node1-1  | text` as `ddpkit logs` shows it (the real
    daemon's run: tests/test_elastic_compose.py): a node's prefix, a rank where
    torchrun tagged the line, the store's service by its name, no frame."""
    from ddpkit.launch.control.backends.compose_logs import service_line, shown

    frame = records.frame(records.Reformed(restart=1, max_restarts=3, world=2, saved_world=3))
    raw = ["node1-1  | [GPU1] Epoch 7 | Batchsize: 32 | Steps: 4", "node10-1  | [rank21]:tagged", "rdzv-1  | up",
           f"node0-1  | {frame}", f"node0-1  | [rank1]:{frame}", "node0-1  |", "no prefix"]
    parsed = [service_line(line) for line in raw]
    assert parsed == [("node1", "[GPU1] Epoch 7 | Batchsize: 32 | Steps: 4"), ("node10", "[rank21]:tagged"),
                      ("rdzv", "up"), ("node0", frame), ("node0", f"[rank1]:{frame}"), ("node0", ""), None]
    assert [shown(*p, None) for p in parsed if p] == [
        "[node1] [GPU1] Epoch 7 | Batchsize: 32 | Steps: 4", "[node10 rank21] tagged", "[rdzv] up", None, None,
        "[node0] "]
    assert shown("node10", "[rank21]:tagged", 20) is None and shown("node10", "untagged", 20) == "[node10] untagged"
