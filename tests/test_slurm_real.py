"""Rendered sbatch scripts, run by a real slurmctld and real slurmds.

Every test sbatches exactly the file `ddpkit render slurm -o DIR` wrote and
reads the job's own output. The job is tests/infra/slurm_probe.py: ddpkit's
real start-up and rank report, then one `PROBE {json}` line per rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.infra import slurm_cluster
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
PROBE = str(ROOT / "tests" / "infra" / "slurm_probe.py")

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def job_spec(name: str, *, mode: str = "torchrun", args: list[str] | None = None, **extra: object) -> dict:
    spec = {
        "name": name, "nodes": 2, "nproc_per_node": 2, "device": "cpu", "backend": "gloo",
        "command": {"python": PYTHON, "script": PROBE, "args": args or []},
        "env": {"TEST_NOTE": "it's $(not run) `ever`"},
        "slurm": {"mode": mode, **extra},
    }
    return spec


def render(tmp: Path, spec: dict) -> Path:
    """Write the job YAML and run the real CLI, as a user would."""
    tmp.mkdir(parents=True, exist_ok=True)
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    out = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(job), "-o", str(tmp)],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    assert out.returncode == 0 and "wrote" in out.stdout, out.stderr
    return tmp / f"{spec['name']}.sbatch"


def output(script: Path, job_id: int) -> str:
    return (script.parent / f"{script.stem}-{job_id}.out").read_text()


def probes(text: str) -> list[dict]:
    """The PROBE lines (srun --label puts 'N: ' in front)."""
    return [json.loads(line.split("PROBE ", 1)[1]) for line in text.splitlines() if "PROBE {" in line]


def check_ranks(text: str, *, launcher: str) -> None:
    seen = sorted(probes(text), key=lambda p: p["rank"])
    assert [p["rank"] for p in seen] == [0, 1, 2, 3], text
    assert {p["world"] for p in seen} == {4}
    for p in seen:
        # the node rank each process reports is its own host's SLURM_NODEID
        assert str(p["node_rank"]) == p["slurm_nodeid"], p
        assert p["host"] == p["slurmd_nodename"] == f"node{p['node_rank'] + 1}", p
        assert p["rank"] == p["node_rank"] * 2 + p["local_rank"], p
        assert p["launcher"] == launcher, p
    assert len({p["host"] for p in seen}) == 2
    assert len({p["master"] for p in seen}) == 1 and seen[0]["master"].startswith("node1:")


def test_torchrun_mode_two_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    script = render(tmp_path, job_spec("tr"))
    job = cluster.sbatch(script)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="torchrun")


def test_srun_mode_two_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    script = render(tmp_path, job_spec("sr", mode="srun"))
    job = cluster.sbatch(script)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="slurm")


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_failing_task_fails_the_whole_job(cluster: SlurmCluster, tmp_path: Path, mode: str) -> None:
    # the other ranks sleep 300 s after the failure: only --kill-on-bad-exit ends them
    script = render(tmp_path, job_spec(f"fail-{mode}", mode=mode, args=["--fail-rank=3"]))
    job = cluster.sbatch(script)
    info = cluster.wait(job, timeout=90)
    text = output(script, job)
    assert info.state == "FAILED", text
    assert "PROBE-FAIL rank=3" in text


def test_two_jobs_share_the_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    scripts = [render(tmp_path / name, job_spec(name)) for name in ("pair-a", "pair-b")]
    jobs = [cluster.sbatch(s) for s in scripts]
    # both run at the same time on the same two nodes
    running = [cluster.wait_state(j, {"RUNNING", "COMPLETED"}) for j in jobs]
    assert all(r.nodes == "node[1-2]" for r in running)
    infos = [cluster.wait(j) for j in jobs]
    texts = [output(s, j) for s, j in zip(scripts, jobs)]
    assert [i.state for i in infos] == ["COMPLETED", "COMPLETED"], texts
    ports = {probes(t)[0]["master"] for t in texts}
    assert len(ports) == 2, ports
    for text in texts:
        check_ranks(text, launcher="torchrun")


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_preemption_checkpoints_requeues_and_resumes(cluster: SlurmCluster, tmp_path: Path, mode: str) -> None:
    ckpt = tmp_path / "ckpt"
    script = render(tmp_path, job_spec(f"pre-{mode}", mode=mode, args=["--steps=30", f"--ckpt={ckpt}"]))
    job = cluster.sbatch(script)
    cluster.wait_state(job, {"RUNNING"})
    out = script.parent / f"{script.stem}-{job}.out"
    _wait_for_text(out, "PROBE-STEP 3", 90)  # signal mid-run, not before the first step
    # what Slurm does before the time limit (--signal=B:USR2@N): USR2 to the batch shell only
    sent = cluster.run(["scancel", "--signal=USR2", "--batch", str(job)])
    assert sent.returncode == 0, sent.stderr
    info = cluster.wait(job, timeout=180)
    text = out.read_text()
    assert info.state == "COMPLETED", text
    assert info.restarts == 1, info
    assert "batch shell got SIGUSR2" in text
    checkpoint = int(text.split("PROBE-CHECKPOINT step=")[1].split()[0])
    assert 3 <= checkpoint < 30
    assert f"PROBE-requeued Slurm job {job}" in text
    assert f"PROBE-START step={checkpoint} restart=1" in text  # the second run resumed
    assert "PROBE-DONE step=30" in text
    assert f"job {job} run 1 " in text and f"job {job} run 2 " in text


def _wait_for_text(path: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and needle in path.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{needle!r} not in {path}: {path.read_text() if path.exists() else '(missing)'}")
        time.sleep(0.3)


# ---- containers: stand-in runtimes on PATH -----------------------------------

APPTAINER = r"""#!/bin/bash
# Stand-in apptainer: record what it was given, then run the command the way
# `apptainer exec` would (binds and GPU flags need a real runtime; skipped).
set -euo pipefail
rec="$RECORD_DIR/apptainer-$SLURM_PROCID"
printf '%s\0' "$@" > "$rec.argv"
printf '%s\0' "SLURM_NODEID=$SLURM_NODEID" "MASTER_ADDR=$MASTER_ADDR" "TEST_NOTE=$TEST_NOTE" > "$rec.env"
[ "$1" = exec ] || { echo "stand-in apptainer: only exec" >&2; exit 2; }
shift
pwd_dir=""
while [[ "$1" == --* ]]; do
  case "$1" in
    --nv) shift ;;
    --bind) shift 2 ;;
    --pwd) pwd_dir="$2"; shift 2 ;;
    *) echo "stand-in apptainer: unknown option $1" >&2; exit 2 ;;
  esac
done
shift  # the image
if [ -n "$pwd_dir" ]; then cd "$pwd_dir"; fi
exec "$@"
"""

SRUN_PYXIS = r"""#!/bin/bash
# Stand-in for srun with the pyxis plugin: record the argv, then run the real
# srun without the --container-* options (the workdir becomes --chdir).
set -euo pipefail
printf '%s\0' "$@" > "$RECORD_DIR/srun.argv"
args=()
for a in "$@"; do
  case "$a" in
    --container-image=*|--container-mounts=*) ;;
    --container-workdir=*) args+=("--chdir=${a#--container-workdir=}") ;;
    *) args+=("$a") ;;
  esac
done
exec /usr/bin/srun "${args[@]}"
"""


def _stand_in(tmp: Path, name: str, text: str) -> Path:
    folder = tmp / "standin"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return folder


def _records(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def test_apptainer_receives_image_binds_and_env(cluster: SlurmCluster, tmp_path: Path) -> None:
    container = {"runtime": "apptainer", "mounts": [f"{tmp_path}:/data:ro"], "workdir": str(tmp_path)}
    spec = job_spec("appt", mode="srun", container=container)
    spec["image"] = "docker://registry.example/ddpkit:1.0"
    script = render(tmp_path, spec)
    folder = _stand_in(tmp_path, "apptainer", APPTAINER)
    env = {"PATH": f"{folder}:{cluster.env()['PATH']}", "RECORD_DIR": str(tmp_path)}
    job = cluster.sbatch(script, env=env)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="slurm")
    for rank in range(4):
        argv = _records(tmp_path / f"apptainer-{rank}.argv")
        assert argv[:6] == ["exec", "--bind", f"{tmp_path}:/data:ro", "--pwd", str(tmp_path),
                            "docker://registry.example/ddpkit:1.0"], argv
        assert "--nv" not in argv  # CPU job: no GPU flag
        assert argv[6:] == [PYTHON, PROBE]
        env_seen = dict(e.split("=", 1) for e in _records(tmp_path / f"apptainer-{rank}.env"))
        assert env_seen == {"SLURM_NODEID": str(rank // 2), "MASTER_ADDR": "node1",
                            "TEST_NOTE": "it's $(not run) `ever`"}


def test_pyxis_options_reach_srun(cluster: SlurmCluster, tmp_path: Path) -> None:
    container = {"runtime": "pyxis", "mounts": ["/data:/data", f"{tmp_path}:/w:ro"], "workdir": str(tmp_path)}
    spec = job_spec("pyx", container=container)
    spec["image"] = "nvcr.io#nvidia/pytorch:24.05-py3"
    script = render(tmp_path, spec)
    folder = _stand_in(tmp_path, "srun", SRUN_PYXIS)
    env = {"PATH": f"{folder}:{cluster.env()['PATH']}", "RECORD_DIR": str(tmp_path)}
    job = cluster.sbatch(script, env=env)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="torchrun")
    argv = _records(tmp_path / "srun.argv")
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in argv
    assert f"--container-mounts=/data:/data,{tmp_path}:/w:ro" in argv
    assert f"--container-workdir={tmp_path}" in argv
    assert "--kill-on-bad-exit=1" in argv and "--ntasks-per-node=1" in argv
    assert argv[-3:-1] == ["bash", "-c"] and '--node-rank="${SLURM_NODEID}"' in argv[-1]


def test_no_daemons_leak(tmp_path: Path) -> None:
    """A cluster that comes up and goes down leaves no process behind."""
    with SlurmCluster(tmp_path / "c", prefix=f"sx{os.getpid() % 100000}") as c:
        pids = [h.pids() for h in c.net.hosts]  # type: ignore[union-attr]
        assert all(pids[1:]), "every node runs a slurmd"
        names = [h.ns for h in c.net.hosts]  # type: ignore[union-attr]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


# ---- ddpkit submit slurm ---------------------------------------------------------


def submit(cluster: SlurmCluster, tmp: Path, spec: dict, *flags: str) -> subprocess.CompletedProcess[str]:
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    return cluster.run(["ddpkit", "submit", "slurm", "-f", str(job), "--dir", str(tmp / "run"), *flags],
                       cwd=tmp, timeout=180)


def test_submit_follow_streams_node_logs_and_exits_zero(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-ok"), "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    assert f"output {tmp_path / 'run' / f'sub-ok-{job_id}.out'}" in done.stdout
    assert (tmp_path / "run" / "sub-ok.sbatch").exists()
    lines = done.stdout.splitlines()
    for node in ("node1", "node2"):
        node_probes = [json.loads(x.split("PROBE ", 1)[1]) for x in lines if x.startswith(f"[{node}] PROBE {{")]
        assert len(node_probes) == 2 and {p["host"] for p in node_probes} == {node}, done.stdout
    assert any(x.startswith("[batch] ddpkit: job") for x in lines)
    assert f"job {job_id} ended COMPLETED" in done.stderr


def test_submit_follow_exits_with_the_failed_state(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-fail", mode="srun", args=["--fail-rank=1"]), "--follow")
    assert done.returncode != 0
    assert "[node1] PROBE-FAIL rank=1" in done.stdout
    assert "ended FAILED" in done.stderr


def test_submit_shows_sbatch_errors_as_they_are(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-bad", partition="nosuch"))
    assert done.returncode != 0
    assert "sbatch: error:" in done.stderr and "invalid partition" in done.stderr.lower(), done.stderr
    assert "submitted" not in done.stdout


def test_submit_without_follow_returns_at_once(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-bg"))
    assert done.returncode == 0, done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    assert cluster.wait(job_id).state == "COMPLETED"


def test_trainer_preempted_requeued_and_resumed(cluster: SlurmCluster, tmp_path: Path) -> None:
    """The same path with the real `ddpkit train` (tiny model, synthetic data)."""
    ckpt = tmp_path / "ckpt"
    spec = job_spec("pre-train", args=[
        "--model=tests.helpers.tiny:cnn", "--data=synthetic", "--image-size=8", "--synthetic-size=1600",
        "--batch-size=4", "--epochs=6", "--no-eval", f"--checkpoint-dir={ckpt}", "--resume=auto"])
    spec["command"] = {"python": PYTHON, "module": "ddpkit.train", "args": spec["command"]["args"]}
    spec["env"]["PYTHONPATH"] = str(ROOT)  # for tests.helpers.tiny
    script = render(tmp_path, spec)
    job = cluster.sbatch(script)
    out = script.parent / f"{script.stem}-{job}.out"
    # signal once training runs: a signal before the trainer installs its
    # handlers kills the workers outright (then the batch shell requeues
    # without a checkpoint, which is not what this test is about)
    _wait_for_text(out, "step 20/", 120)
    assert cluster.run(["scancel", "--signal=USR2", "--batch", str(job)]).returncode == 0
    info = cluster.wait(job, timeout=240)
    text = out.read_text()
    assert info.state == "COMPLETED" and info.restarts == 1, text
    assert "stop signal received: checkpointing at step" in text
    assert f"requeued Slurm job {job}" in text
    stopped = int(text.split("checkpointing at step ")[1].split()[0])
    assert stopped > 0
    assert f"at step {stopped} " in text.split(f"job {job} run 2 ")[1]  # "resumed from ... at step N (epoch ..."
    assert "ddpkit train preempted" in text and "ddpkit train finished" in text


# ---- checks against the real cluster before and after sbatch -----------------------


def squeue_ids(cluster: SlurmCluster) -> set[str]:
    return set(cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split())


@pytest.mark.parametrize(("name", "spec_extra", "flags", "expected"), [
    ("chk-nodes", {}, ("--nodes", "3"), "the job asks for 3 nodes but partition 'debug' has 2; pass --nodes 2"),
    ("chk-gpus", {"device": "cuda", "backend": "gloo"}, (), "no node of partition 'debug' has GPU gres"),
    ("chk-cpus", {"slurm_cpus": 6}, (), "asks for 12 CPUs per node but the nodes of partition 'debug' have at most 8"),
])
def test_submit_refuses_a_job_the_cluster_can_never_run(cluster: SlurmCluster, tmp_path: Path, name: str,
                                                        spec_extra: dict, flags: tuple[str, ...], expected: str) -> None:
    before = squeue_ids(cluster)
    spec = job_spec(name, mode="srun")
    cpus = spec_extra.pop("slurm_cpus", None)
    spec.update(spec_extra)
    if cpus:
        spec["slurm"]["cpus_per_process"] = cpus
    done = submit(cluster, tmp_path, spec, "--follow", *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "can never run on this cluster (nothing was submitted)" in done.stderr and expected in done.stderr
    assert "submitted" not in done.stdout and "Traceback" not in done.stderr
    assert squeue_ids(cluster) == before and not (tmp_path / "run").exists()


def test_submit_refuses_a_time_above_the_partition_limit(cluster: SlurmCluster, tmp_path: Path) -> None:
    cluster.run(["scontrol", "update", "PartitionName=debug", "MaxTime=00:30:00"])
    try:
        done = submit(cluster, tmp_path, job_spec("chk-time", time="01:00:00"), "--follow")
    finally:
        cluster.run(["scontrol", "update", "PartitionName=debug", "MaxTime=INFINITE"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "slurm.time: 01:00:00 is above partition 'debug''s limit of 00:30:00" in done.stderr


def test_follow_gives_up_on_a_job_that_can_never_start(cluster: SlurmCluster, tmp_path: Path) -> None:
    """--no-check lets it through; Slurm then holds it for a partition limit, which --follow
    reports and, since waiting cannot clear it, cancels."""
    cluster.run(["scontrol", "update", "PartitionName=debug", "MaxNodes=1"])
    try:
        started = time.monotonic()
        done = submit(cluster, tmp_path, job_spec("chk-pend"), "--follow", "--no-check")
        elapsed = time.monotonic() - started
    finally:
        cluster.run(["scontrol", "update", "PartitionName=debug", "MaxNodes=UNLIMITED"])
    assert done.returncode == 3, done.stdout + done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    # slurmctld names the broken limit PartitionConfig or PartitionNodeLimit depending on when it looks.
    reason = re.search(rf"job {job_id} PENDING \((\w+)\)", done.stderr)
    assert reason and reason.group(1) in {"PartitionConfig", "PartitionNodeLimit"}, done.stderr
    assert f"job {job_id} can never start: Slurm holds it with reason {reason.group(1)}" in done.stderr
    assert elapsed < 30, elapsed
    assert cluster.wait(job_id, timeout=30).state == "CANCELLED"


def test_follow_shows_the_state_as_it_changes(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("chk-states"), "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    assert f"ddpkit: job {job_id} RUNNING" in done.stderr or f"ddpkit: job {job_id} COMPLETED" in done.stderr
