"""bench/chaos.py: the chaos run's plan and bookkeeping (no processes), and its
short version on `launch ssh` (three namespace hosts with sshd): three
episodes that crash, freeze, cut off and kill a worker of nodes including node
0, during a checkpoint write, two at once, and during rank 0's last-step write;
and bench/chaos_slurm.py's on a real Slurm cluster: a worker's crash during a
checkpoint write, a node's trainer crashed, and the batch host lost while rank
0 writes the last step (requeued, resumed). The job must end well (exit 0,
COMPLETED) and with the weights of a fault-free run that changed world size
at the same steps, bit for bit; no checkpoint corrupt, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench import chaos
from bench.chaos import MOMENTS, Episode, World

from tests.infra import netns, slurm_cluster, sshd

ROOT = Path(__file__).resolve().parents[1]
SSH_SEED, SSH_EPISODES = 3, 3  # checkpoint: crash n1; back-to-back: freeze n2 + worker n0; last-step: link, crash
SLURM_SEED = 4  # a worker of node 1 at a checkpoint; node 2's trainer; the batch host while rank 0 writes
# A stuck job is stopped by the bench itself, which then prints the job's state; the test's own limit
# comes after that and the fault-free reference, and before pytest's (600 s).
DEADLINE_S, LIMIT_S = 400, 560


def run_chaos(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The bench, as a user runs it; what it printed, also where it ran past the test's limit."""
    argv = [sys.executable, "-m", module, *args, "--deadline-s", str(DEADLINE_S)]
    try:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"{module} ran past {LIMIT_S} s; it printed:\n{out[-8000:]}")


def test_the_plan_takes_every_moment_and_node_0() -> None:
    for seed in range(20):
        episodes = chaos.plan(seed, 5, list(chaos.KINDS))
        assert sorted(e.moment for e in episodes) == sorted(MOMENTS), seed
        assert any(0 in e.nodes or e.moment == "last-step" for e in episodes), seed
        for e in episodes:
            assert len(e.kinds) == len(e.nodes) == (1 if e.moment in ("step", "checkpoint") else 2), e
            if e.moment == "back-to-back":
                assert e.nodes[0] != e.nodes[1], e
    assert chaos.plan(7, 4, ["crash"]) == chaos.plan(7, 4, ["crash"])  # the seed decides
    assert not any("link" in e.kinds for e in chaos.plan(1, 10, ["crash", "worker"]))


def test_the_ssh_short_version_is_the_plan_the_test_says() -> None:
    episodes = chaos.plan(SSH_SEED, SSH_EPISODES, list(chaos.KINDS))
    assert episodes == [Episode("checkpoint", ("crash",), (1,), 7),
                        Episode("back-to-back", ("freeze", "worker"), (2, 0), 5),
                        Episode("last-step", ("link", "crash"), (None, None), 7)]


def test_steps_trained_twice_and_the_reference_segments() -> None:
    records = [{"kind": "train", "step": s, "time": float(s)} for s in range(1, 13)]
    records.insert(11, {"kind": "checkpoint", "step": 10, "time": 10.5})
    records += [{"kind": "resume", "step": 10, "world_size": 2, "time": 20.0},  # steps 11, 12 again
                {"kind": "train", "step": 11, "time": 21.0},
                {"kind": "resume", "step": 11, "world_size": 3, "time": 22.0},  # nothing lost
                {"kind": "resume", "step": 11, "world_size": 2, "time": 23.0},  # that run trained nothing
                {"kind": "train", "step": 12, "time": 24.0}]
    assert chaos.steps_trained_twice(records) == 2
    worlds = chaos.worlds(records, 3)
    assert [(w.start, w.size) for w in worlds] == [(0, 3), (10, 2), (11, 3), (11, 2)]
    assert [(w.start, w.size) for w in chaos.segments(worlds)] == [(0, 3), (10, 2), (11, 2)]
    assert chaos.trained_after(records, 20.5) == 24.0 and chaos.trained_after(records, 19.0, 2) == 21.0
    assert chaos.trained_after(records, 19.0, 3) is None
    assert chaos.segments([World(0, 3, 0.0)]) == [World(0, 3, 0.0)]


@pytest.mark.full  # a long chaos run; a fault costs time, never work: test_elastic_train.py (bitwise) in make test
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(bool(netns.available() or sshd.available()), reason=str(netns.available() or sshd.available()))
def test_chaos_on_launch_ssh_costs_time_never_work(tmp_path: Path) -> None:
    # 600 steps: the job still trains when the last episode's node is back (a cut-off node takes up to
    # about 20 s to return, while the two others train some 8 steps a second; the last episode starts
    # near step 100). A job that ends first fails the run ("the job ended before 3 nodes trained again").
    done = run_chaos("bench.chaos", "--target", "ssh", "--seed", str(SSH_SEED), "--episodes", str(SSH_EPISODES),
                     "--steps", "600", "--out", str(tmp_path))
    said = done.stdout[-20000:] + done.stderr[-4000:]  # the deadline report, whole
    assert (tmp_path / "chaos-ssh.json").exists(), said
    result = json.loads((tmp_path / "chaos-ssh.json").read_text())
    out = result["outcome"]
    assert out["exit_code"] == 0, said
    assert out["closing"].startswith("launch ssh: every node finished; node ") and "rejoined after it failed" \
        in out["closing"], said
    assert [e["moment"] for e in out["episodes"]] == ["checkpoint", "back-to-back", "last-step"], said
    assert all(e["to_full_world_s"] is not None for e in out["episodes"]), said
    assert any(node == 0 for e in out["episodes"] for _, node in e["faults"]), said
    assert out["bitwise_equal"] is True, said
    assert out["corrupt"] == [] and out["left_running"] == [], said
    assert result["passed"] and done.returncode == 0, said
    assert "episodes survived: 3 of 3" in done.stdout and "bitwise equal" in done.stdout, said


@pytest.mark.full  # a long chaos run; a fault costs time, never work: test_elastic_train.py (bitwise) in make test
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(bool(slurm_cluster.available()), reason=str(slurm_cluster.available()))
def test_chaos_on_slurm_costs_time_never_work(tmp_path: Path) -> None:
    from bench import chaos_slurm

    assert [(e.moment, e.kinds, e.nodes) for e in chaos_slurm.plan(SLURM_SEED)] == [
        ("checkpoint", ("worker",), (1,)), ("step", ("crash",), (2,)), ("last-step", ("host",), (0,))]
    done = run_chaos("bench.chaos_slurm", "--seed", str(SLURM_SEED), "--steps", "300", "--out", str(tmp_path))
    said = done.stdout[-20000:] + done.stderr[-4000:]  # the deadline report, whole
    assert (tmp_path / "chaos-slurm.json").exists(), said
    out = json.loads((tmp_path / "chaos-slurm.json").read_text())["outcome"]
    assert out["exit_code"] == 0 and out["closing"].endswith("COMPLETED, exit code 0:0, restarts 1"), said
    assert [len(e["faults"]) for e in out["episodes"]] == [1, 1, 2], said
    # the world went 3, then 2 after the crash, then 3 again after the requeue
    assert [w["size"] for w in out["worlds"]][-2:] == [2, 3], said
    assert out["bitwise_equal"] is True and out["corrupt"] == [] and out["left_running"] == [], said
    assert done.returncode == 0 and "episodes survived: 3 of 3" in done.stdout, said
