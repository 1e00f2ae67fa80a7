"""Rendered sbatch scripts, run by a real slurmctld and real slurmds.

Every test sbatches exactly the file `ddpkit render slurm -o DIR` wrote and
reads the job's own output. The job is tests/infra/slurm_probe.py: ddpkit's
real start-up and rank report, then one `PROBE {json}` line per rank."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpkit.cli import main as cli_main
from ddpkit.runs import RunState, all_runs
from tests.helpers.runs import processes_in
from tests.helpers.tiers import full_case, one_case_in_ci
from tests.infra import slurm_cluster
from tests.infra.shared import SlurmPool
from tests.infra.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv" / "bin" / "python")
PROBE = str(ROOT / "tests" / "infra" / "slurm_probe.py")

_reason = slurm_cluster.available()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.timeout(300), pytest.mark.root]


@pytest.fixture(scope="module")
def cluster(slurm_pool: SlurmPool) -> Iterator[SlurmCluster]:
    with slurm_pool.lease(nodes=2) as c:
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


@pytest.mark.full  # both modes run in the targets matrix
def test_torchrun_mode_two_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    script = render(tmp_path, job_spec("tr"))
    job = cluster.sbatch(script)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="torchrun")


@pytest.mark.full  # both modes run in the targets matrix
def test_srun_mode_two_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    script = render(tmp_path, job_spec("sr", mode="srun"))
    job = cluster.sbatch(script)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    # a script of the user's own runs under ddpkit.run, which gave it torchrun's variables from Slurm's
    check_ranks(text, launcher="torchrun")


def test_srun_mode_gives_a_torchrun_program_torchruns_variables(cluster: SlurmCluster, tmp_path: Path) -> None:
    """A program that reads only RANK, LOCAL_RANK, WORLD_SIZE, ... runs unchanged
    as one srun task per process, and gets ddpkit's rank table before its first step."""
    spec = job_spec("envonly", mode="srun")
    spec["command"]["script"] = str(ROOT / "tests" / "helpers" / "env_only_ddp.py")
    script = render(tmp_path, spec)
    assert "-m ddpkit.run" in script.read_text()
    job = cluster.sbatch(script)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    seen = sorted((json.loads(line.split("ENVPROBE ", 1)[1]) for line in text.splitlines() if "ENVPROBE {" in line),
                  key=lambda p: int(p["RANK"]))
    assert [p["RANK"] for p in seen] == ["0", "1", "2", "3"], text
    for p in seen:
        assert p["RANK"] == p["SLURM_PROCID"] and p["LOCAL_RANK"] == p["SLURM_LOCALID"], p
        assert p["GROUP_RANK"] == p["SLURM_NODEID"] and p["host"] == f"node{int(p['GROUP_RANK']) + 1}", p
        assert (p["WORLD_SIZE"], p["LOCAL_WORLD_SIZE"], p["sum"]) == ("4", "2", 6.0), p
    assert len({(p["MASTER_ADDR"], p["MASTER_PORT"]) for p in seen}) == 1 and seen[0]["MASTER_ADDR"] == "node1"
    assert "rank report: 4 processes" in text and text.count("│ srun") == 4, text


@pytest.mark.parametrize("mode", one_case_in_ci(["torchrun", "srun"], keep="torchrun"))
def test_failing_task_fails_the_whole_job(cluster: SlurmCluster, tmp_path: Path, mode: str) -> None:
    # the other ranks sleep 300 s after the failure: only --kill-on-bad-exit ends them before (15-25 s idle)
    script = render(tmp_path, job_spec(f"fail-{mode}", mode=mode, args=["--fail-rank=3"]))
    job = cluster.sbatch(script)
    info = cluster.wait(job, timeout=200)
    text = output(script, job)
    assert info.state == "FAILED", text
    assert "PROBE-FAIL rank=3" in text
    if mode == "torchrun":
        # the failed rank's code, not the 143 of the node srun stopped with SIGTERM (the agents' failure
        # files, the batch script's first failure); torch's report in the node's log, one line here
        assert info.exit_code == "1:0", f"{info}\n{text[-6000:]}"
        assert re.search(r"^1: ddpkit\.agent: node 1: worker rank 3 failed \(exit code 1\); torch's report: \S+/"
                         r"fail-torchrun-\d+\.records/node2\.log$", text, re.MULTILINE), text[-6000:]
        assert "ChildFailedError" not in text and "Traceback" not in text, text[-6000:]


@pytest.mark.full  # a port per job: test_render_slurm.py's port rule, in bash and Python
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


# Pre-emption (both modes, the real trainer, the cause checked): tests/test_preempt_slurm.py.


# ---- containers: stand-in runtimes on PATH -----------------------------------

APPTAINER = r"""#!/bin/bash
# Stand-in apptainer: record what it was given, check the image and binds
# against apptainer's documented forms (`apptainer help exec`: a URI with a
# scheme, or a local image file; `--bind src[:dest[:opts]]`, src must exist),
# then run the command the way `apptainer exec` would (binds and GPU flags
# need a real runtime; not applied).
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
    --bind)
      src="${2%%:*}"
      [[ "$src" == /* && -e "$src" ]] || { echo "FATAL: bind source $src: no such absolute path" >&2; exit 255; }
      shift 2 ;;
    --pwd) pwd_dir="$2"; shift 2 ;;
    *) echo "stand-in apptainer: unknown option $1" >&2; exit 2 ;;
  esac
done
image="$1"
schemes='^(docker|library|oras|shub|https?)://[^/]|^(docker-archive|docker-daemon|oci|oci-archive):'
if [[ "$image" =~ $schemes ]]; then
  :
elif [ ! -f "$image" ]; then
  # what apptainer does with a scheme-less word: it is a local image path
  echo "FATAL: could not open image $PWD/$image: failed to retrieve path for $image: no such file" >&2
  exit 255
fi
shift
if [ -n "$pwd_dir" ]; then cd "$pwd_dir"; fi
exec "$@"
"""

# enroot's parser of the URI pyxis hands it (docker://<--container-image>), from
# enroot's src/docker.sh (docker::import): docker://[USER@][REGISTRY#]IMAGE[:TAG]
ENROOT_URI = (r"^docker://(([[:alnum:]_.!~*\'()%\;:\&=+$,-@]+)@)?(([^#]+)#)?([[:lower:][:digit:]/._-]+)"
              r"(:([[:alnum:]._:-]+))?$")

SRUN_PYXIS = r"""#!/bin/bash
# Stand-in for srun with the pyxis plugin: record the argv, check the
# container options as pyxis and enroot read them (--container-image is an
# enroot URI without its scheme, or a squashfs path starting with / or ./;
# --container-mounts SRC:DST[:FLAGS],... with absolute paths), then run the
# real srun without the --container-* options (the workdir becomes --chdir).
set -euo pipefail
printf '%s\0' "$@" > "$RECORD_DIR/srun.argv"
args=()
for a in "$@"; do
  case "$a" in
    --container-image=*)
      image="${a#--container-image=}"
      if [[ "$image" == /* || "$image" == ./* ]]; then
        [ -f "$image" ] || { echo "pyxis: could not find squashfs $image" >&2; exit 2; }
      elif ! [[ "docker://$image" =~ ENROOT_URI_RE ]]; then
        echo "[ERROR] Invalid image reference: docker://$image" >&2; exit 2
      elif [[ -z "${BASH_REMATCH[4]}" && "${BASH_REMATCH[5]%%/*}" == *.* ]]; then
        # no REGISTRY#: enroot pulls from Docker Hub, where a host name is no repository
        echo "[ERROR] docker://$image: enroot would pull ${BASH_REMATCH[5]} from registry-1.docker.io" >&2; exit 2
      fi ;;
    --container-mounts=*)
      IFS=, read -r -a mounts <<< "${a#--container-mounts=}"
      for m in "${mounts[@]}"; do
        IFS=: read -r src dst _ <<< "$m"
        [[ "$src" == /* && "$dst" == /* ]] || { echo "pyxis: mount $m: paths must be absolute" >&2; exit 2; }
      done ;;
    --container-workdir=*) args+=("--chdir=${a#--container-workdir=}") ;;
    *) args+=("$a") ;;
  esac
done
exec /usr/bin/srun "${args[@]}"
""".replace("ENROOT_URI_RE", ENROOT_URI)


def _stand_in(tmp: Path, name: str, text: str) -> Path:
    folder = tmp / "standin"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return folder


def _records(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def _local_image(tmp: Path, name: str) -> str:
    path = tmp / name
    path.write_bytes(b"stand-in image")
    return str(path)


# Each image form's translation is checked without a cluster (test_render_slurm.py); one reaches a real job in CI.
@pytest.mark.parametrize(("image", "expected"), [
    full_case("docker://registry.example/ddpkit:1.0", "docker://registry.example/ddpkit:1.0"),
    ("ghcr.io/org/img:tag", "docker://ghcr.io/org/img:tag"),
    full_case("nvcr.io#nvidia/pytorch:24.05-py3", "docker://nvcr.io/nvidia/pytorch:24.05-py3"),
    full_case("LOCAL/ddpkit.sif", "LOCAL/ddpkit.sif"),
])
def test_apptainer_receives_image_binds_and_env(cluster: SlurmCluster, tmp_path: Path, image: str,
                                                expected: str) -> None:
    if image.startswith("LOCAL/"):
        image = expected = _local_image(tmp_path, image.split("/", 1)[1])
    container = {"runtime": "apptainer", "mounts": [f"{tmp_path}:/data:ro"], "workdir": str(tmp_path)}
    spec = job_spec("appt", mode="srun", container=container)
    spec["image"] = image
    script = render(tmp_path, spec)
    folder = _stand_in(tmp_path, "apptainer", APPTAINER)
    env = {"PATH": f"{folder}:{cluster.env()['PATH']}", "RECORD_DIR": str(tmp_path)}
    job = cluster.sbatch(script, env=env)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="torchrun")  # the script ran under ddpkit.run: torchrun's variables from Slurm's
    for rank in range(4):
        argv = _records(tmp_path / f"apptainer-{rank}.argv")
        assert argv[:6] == ["exec", "--bind", f"{tmp_path}:/data:ro", "--pwd", str(tmp_path), expected], argv
        assert "--nv" not in argv  # CPU job: no GPU flag
        assert argv[6:] == [PYTHON, "-m", "ddpkit.run", PROBE]
        env_seen = dict(e.split("=", 1) for e in _records(tmp_path / f"apptainer-{rank}.env"))
        assert env_seen == {"SLURM_NODEID": str(rank // 2), "MASTER_ADDR": "node1",
                            "TEST_NOTE": "it's $(not run) `ever`"}


@pytest.mark.parametrize(("image", "expected"), [
    full_case("nvcr.io#nvidia/pytorch:24.05-py3", "nvcr.io#nvidia/pytorch:24.05-py3"),
    ("ghcr.io/org/img:tag", "ghcr.io#org/img:tag"),
    full_case("docker.io/library/ubuntu:22.04", "library/ubuntu:22.04"),
    full_case("LOCAL/ddpkit.sqsh", "LOCAL/ddpkit.sqsh"),
])
def test_pyxis_options_reach_srun(cluster: SlurmCluster, tmp_path: Path, image: str, expected: str) -> None:
    if image.startswith("LOCAL/"):
        image = expected = _local_image(tmp_path, image.split("/", 1)[1])
    container = {"runtime": "pyxis", "mounts": ["/data:/data", f"{tmp_path}:/w:ro"], "workdir": str(tmp_path)}
    spec = job_spec("pyx", container=container)
    spec["image"] = image
    script = render(tmp_path, spec)
    folder = _stand_in(tmp_path, "srun", SRUN_PYXIS)
    env = {"PATH": f"{folder}:{cluster.env()['PATH']}", "RECORD_DIR": str(tmp_path)}
    job = cluster.sbatch(script, env=env)
    info = cluster.wait(job)
    text = output(script, job)
    assert info.state == "COMPLETED", text
    check_ranks(text, launcher="torchrun")
    argv = _records(tmp_path / "srun.argv")
    assert [a for a in argv if a.startswith("--container-image=")] == [f"--container-image={expected}"]
    assert f"--container-mounts=/data:/data,{tmp_path}:/w:ro" in argv
    assert f"--container-workdir={tmp_path}" in argv
    assert "--kill-on-bad-exit=1" in argv and "--ntasks-per-node=1" in argv
    assert argv[-3:-1] == ["bash", "-c"] and '--node-rank="${SLURM_NODEID}"' in argv[-1]


@pytest.mark.parametrize(("stand_in", "argv", "error"), [
    # what ddpkit used to pass: a Docker reference, which enroot does not parse
    ("srun", ["--container-image=ghcr.io/org/img:tag", "true"], "enroot would pull ghcr.io/org/img from registry-1.docker.io"),
    ("srun", ["--container-image=ghcr.io/Org/img:tag", "true"], "Invalid image reference"),
    ("srun", ["--container-image=nvcr.io#nvidia/pytorch:24.05", "--container-mounts=data:/data", "true"],
     "paths must be absolute"),
    ("apptainer", ["exec", "ghcr.io/org/img:tag", "true"], "could not open image"),
])
def test_stand_ins_refuse_what_the_runtime_refuses(tmp_path: Path, stand_in: str, argv: list[str], error: str) -> None:
    """The stand-ins fail a job whose container arguments the real runtime
    would not take, so the tests above can fail."""
    text = SRUN_PYXIS if stand_in == "srun" else APPTAINER
    folder = _stand_in(tmp_path, stand_in, text)
    env = {"PATH": "/usr/bin:/bin", "RECORD_DIR": str(tmp_path), "SLURM_PROCID": "0", "SLURM_NODEID": "0",
           "MASTER_ADDR": "x", "TEST_NOTE": "x"}
    done = subprocess.run([str(folder / stand_in), *argv], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode != 0 and error in done.stderr, done.stderr


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
                       cwd=tmp, timeout=180, env={"DDPKIT_RUNS_DIR": str(tmp / "runs")})


def test_submit_follow_streams_node_logs_and_exits_zero(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-ok"), "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    assert f"output {tmp_path / 'run' / f'sub-ok-{job_id}.out'}" in done.stdout
    assert (tmp_path / "run" / "sub-ok.sbatch").exists()
    lines = done.stdout.splitlines()
    # `ddpkit logs`' prefixes: the job's node index (node0 runs on host node1), not the host.
    for index, host in enumerate(("node1", "node2")):
        node_probes = [json.loads(x.split("PROBE ", 1)[1]) for x in lines if x.startswith(f"[node{index}] PROBE {{")]
        assert len(node_probes) == 2 and {p["host"] for p in node_probes} == {host}, done.stdout
    assert any(x.startswith("[batch] ddpkit: job") for x in lines)
    assert f"job {job_id} ended COMPLETED" in done.stderr
    (run,) = all_runs(tmp_path / "runs")  # --follow recorded the end
    record = run.folder.record()
    assert record.slurm is not None and record.slurm.job_id == job_id
    assert (record.state, record.exit_code) == (RunState.FINISHED, 0)
    assert (run.folder.rendered_dir / "sub-ok.sbatch").read_text() == (tmp_path / "run" / "sub-ok.sbatch").read_text()


# Unique (the tail) and hostile: quotes, substitutions, a newline, blanks.
SECRET = "  it's \"q\" $(echo PWNED) `id` ${HOME} \\ 3b9f-slurm-secret-c04e\nline two\t\n"
# One write per line: the job runs unbuffered (PYTHONUNBUFFERED=1), where print()
# writes its pieces one by one and two ranks of a node interleaved them.
DIGEST_SCRIPT = """import hashlib, os
value = os.environ.get("RUN_SECRET")
digest = hashlib.sha256(value.encode()).hexdigest() if value is not None else "UNSET"
os.write(1, f"SECRET-DIGEST {os.environ['RANK']} {digest}\\n".encode())
"""


def test_submit_hands_a_secret_to_every_rank_and_writes_it_nowhere(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Issue 29 item 8: `secrets:` on Slurm. sbatch exports this environment,
    srun and torchrun pass it on; each rank prints a digest of what it got, so
    the value never lands in the job's output either. (slurmctld keeps every
    job's exported environment in its own state folder, as for any variable:
    that is Slurm's, readable by the Slurm user only, and not scanned here.)"""
    script = tmp_path / "digest.py"
    script.write_text(DIGEST_SCRIPT)
    spec = job_spec("sub-secret") | {"command": {"python": PYTHON, "script": str(script)}, "secrets": ["RUN_SECRET"]}
    job = tmp_path / "sub-secret.yaml"
    job.write_text(yaml.safe_dump(spec))
    done = cluster.run(["ddpkit", "submit", "slurm", "-f", str(job), "--dir", str(tmp_path / "run"), "--follow"],
                       cwd=tmp_path, timeout=180, env={"RUN_SECRET": SECRET})
    assert done.returncode == 0, done.stdout + done.stderr
    digests = sorted(line.split("SECRET-DIGEST ", 1)[1] for line in done.stdout.splitlines() if "SECRET-DIGEST " in line)
    want = hashlib.sha256(SECRET.encode()).hexdigest()
    assert digests == [f"{rank} {want}" for rank in range(4)], done.stdout
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".out" for p in files) and any(p.suffix == ".sbatch" for p in files)
    assert [p for p in files if b"3b9f-slurm-secret" in p.read_bytes()] == []


@pytest.mark.full  # a failed job's state and code: test_failing_task_fails_the_whole_job
def test_submit_follow_exits_with_the_failed_state(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-fail", mode="srun", args=["--fail-rank=1"]), "--follow")
    assert done.returncode != 0
    assert "[node0 rank1] PROBE-FAIL rank=1" in done.stdout
    assert "ended FAILED" in done.stderr


def test_submit_shows_sbatch_errors_as_they_are(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-bad", partition="nosuch"))
    assert done.returncode != 0
    assert "sbatch: error:" in done.stderr and "invalid partition" in done.stderr.lower(), done.stderr
    assert "submitted" not in done.stdout
    assert all_runs(tmp_path / "runs") == []  # no run for a job that was not submitted


@pytest.mark.full  # submit and status: the run test below
def test_submit_without_follow_returns_at_once(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("sub-bg"))
    assert done.returncode == 0, done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    assert cluster.wait(job_id).state == "COMPLETED"


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
    # given up at the first poll that shows the reason (POLL_S), not left queued until the 180 s the
    # subprocess is given; the CLI's start and slurmctld's first pass take a loaded 2-core machine a while
    assert elapsed < 120, elapsed
    assert cluster.wait(job_id, timeout=30).state == "CANCELLED"


@pytest.mark.full  # --follow's lines and exit code: test_submit_follow_streams_node_logs_and_exits_zero
def test_follow_shows_the_state_as_it_changes(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = submit(cluster, tmp_path, job_spec("chk-states"), "--follow")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    assert f"ddpkit: job {job_id} RUNNING" in done.stderr or f"ddpkit: job {job_id} COMPLETED" in done.stderr


# ---- ddpkit runs / status / logs / cancel on a submitted job (docs/guides/runs.md) ---------------


def test_submitted_job_is_a_run_that_status_reads_and_cancel_checkpoints(cluster: SlurmCluster,
                                                                         tmp_path: Path) -> None:
    """`submit slurm` records a run; `status` reads squeue while the job runs and
    scontrol once it left the queue (this cluster keeps no accounting); `cancel`
    sends the spec's signal to the batch shell first, so the trainer's stop path
    writes a checkpoint (its `stop` record names the signal: proof that the
    signal, not scancel, made it), then scancels the requeued job."""
    folder, runs_dir = tmp_path / "job", tmp_path / "runs"
    folder.mkdir()
    args = ["--model=tiny", "--image-size=8", "--workers=0", "--progress=plain", "--data=synthetic",
            "--synthetic-size=64", "--batch-size=4", "--epochs=100000", "--no-eval", "--log-every=1",
            f"--checkpoint-dir={folder / 'ckpt'}", f"--metrics={folder / 'metrics.jsonl'}", "--resume=auto"]
    spec = {"name": "runs-cancel", "nodes": 2, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
            "command": {"python": PYTHON, "module": "ddpkit.train", "args": args},
            "env": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            "slurm": {"mode": "torchrun"}, "preemption": {"checkpoint_s": 10}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    env = {"DDPKIT_RUNS_DIR": str(runs_dir)}

    def ddpkit(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return cluster.run(["ddpkit", *argv], cwd=folder, env=env, timeout=timeout)

    done = ddpkit("submit", "slurm", "-f", str(folder / "job.yaml"), "--dir", str(folder))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = int(done.stdout.split("submitted Slurm job ")[1].split(":")[0])
    try:
        (run,) = [json.loads(p.read_text()) for p in runs_dir.glob("*/run.json")]
        assert (run["target"], run["slurm"]["job_id"], run["slurm"]["signal"]) == ("slurm", job_id, "USR2")
        assert (runs_dir / f"runs-cancel-{run['id']}" / "rendered" / "runs-cancel.sbatch").exists()

        deadline = time.monotonic() + 120
        while '"kind": "train"' not in ((folder / "metrics.jsonl").read_text() if (folder / "metrics.jsonl").exists()
                                        else ""):
            assert time.monotonic() < deadline, f"no training step within 120 s\n{ddpkit('logs', str(job_id)).stdout}"
            time.sleep(0.2)
        status = ddpkit("status", str(job_id))
        assert status.returncode == 0, status.stderr
        assert status.stdout.splitlines()[0] == f"run {run['id']}: running", status.stdout
        assert "Slurm RUNNING on node1,node2 (squeue)" in status.stdout, status.stdout
        logs = ddpkit("logs", "runs-cancel", "--node", "1", "--tail", "3")
        assert logs.returncode == 0 and logs.stdout.splitlines()[-1].startswith("[node1] "), logs.stdout + logs.stderr

        started = time.monotonic()
        cancel = ddpkit("cancel", str(job_id), timeout=120)
        took = time.monotonic() - started
    finally:
        cluster.run(["scancel", str(job_id)])
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert cancel.stdout.splitlines()[-1] == f"ddpkit cancel: Slurm job {job_id} CANCELLED (run {run['id']} cancelled)"
    stops = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "stop"]
    assert len(stops) == 1 and stops[0]["signal"] == "SIGUSR2", stops
    assert Path(stops[0]["checkpoint"]).exists(), stops
    after = ddpkit("status", str(job_id))
    assert after.stdout.splitlines()[0].startswith(f"run {run['id']}: cancelled"), after.stdout
    # Left the queue (cancelled while pending after its requeue: no nodes), and no accounting here.
    assert "where     Slurm CANCELLED (scontrol)" in after.stdout, after.stdout
    assert re.search(r" preempted: the job left its run after SIGUSR2: (PENDING|REQUEUED)", after.stdout), after.stdout
    print(f"RUNS-TIMING slurm cancel (signal, checkpoint, requeue, scancel): {took:.1f} s")
    listed = ddpkit("runs")
    assert re.search(rf"{run['id']}\s*│\s*runs-cancel\s*│\s*slurm\s*│\s*cancelled", listed.stdout), listed.stdout
    assert processes_in(folder) == [], "processes of the job left running"


# ---- every rendered variant of the example specs, checked by sbatch --test-only -----

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# What makes an example fit this 2-node, 8-CPU, GPU-less cluster.
FIT = ["slurm.partition=debug", "device=cpu", "backend=gloo", "nodes=2", "nproc_per_node=2",
       "resources.cpus_per_process=2", "slurm.mem=1M"]
RESERVATION = "ddpkit-res"


def render_example(example: Path, out: Path, sets: list[str]) -> Path:
    """`ddpkit render slurm` through the CLI's own entry point, in this
    process: 44 renders would spend most of their time starting Pythons."""
    args = [a for s in sets for a in ("--set", s)]
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = cli_main(["render", "slurm", "-f", str(example), *args, "-o", str(out)])
    assert code == 0, said.getvalue()
    return out / f"{example.stem}.sbatch"


def sbatch_test_only(cluster: SlurmCluster, script: Path) -> subprocess.CompletedProcess[str]:
    return cluster.run(["sbatch", "--test-only", str(script)], cwd=script.parent)


@pytest.fixture
def held_job(cluster: SlurmCluster) -> Iterator[int]:
    """A real job to depend on, held so that it never runs."""
    job = cluster.run(["sbatch", "--parsable", "--hold", "--job-name=dep", "--output=/dev/null", "--wrap=true"])
    assert job.returncode == 0, job.stderr
    job_id = int(job.stdout.strip().split(";")[0])
    yield job_id
    cluster.run(["scancel", str(job_id)])


@contextlib.contextmanager
def reservation(cluster: SlurmCluster) -> Iterator[str]:
    """A real reservation on both nodes, for root, from now on; deleted on
    exit (while it exists, no other job can start on the nodes)."""
    made = cluster.run(["scontrol", "create", "reservation", f"ReservationName={RESERVATION}", "Nodes=node[1-2]",
                        "StartTime=now", "Duration=30", "Users=root", "Flags=IGNORE_JOBS"])
    assert made.returncode == 0, made.stdout + made.stderr
    try:
        yield RESERVATION
    finally:
        cluster.run(["scontrol", "delete", f"ReservationName={RESERVATION}"])


def variants(held: int) -> list[list[str]]:
    return [
        [],
        [f"slurm.dependency=afterok:{held}"],
        [f"slurm.dependency=afterany:{held}?afternotok:{held}"],
        ["slurm.constraint=ddp"],
        ["slurm.constraint=rack1|rack2"],
        [f"slurm.reservation={RESERVATION}"],
        ["slurm.nodelist=node[1-2]"],
        ["nodes=1", "slurm.exclude=node1"],
        ["slurm.extra_sbatch=[\"--comment=it's a #test\", --nice=10, --mail-type=NONE]"],
        ["slurm.requeue=false", "slurm.exclusive=true", "slurm.time=00:30:00"],
        [f"slurm.dependency=afterok:{held}", "slurm.constraint=ddp&rack1", "nodes=1", "slurm.nodelist=node1",
         "slurm.extra_sbatch=[--comment=all]"],
    ]


def test_sbatch_test_only_accepts_every_rendered_variant(cluster: SlurmCluster, tmp_path: Path,
                                                         held_job: int) -> None:
    def check(runs: list[tuple[Path, str, list[str]]]) -> list[tuple[str, str, list[str], str]]:
        refused = []
        for example, mode, extra in runs:
            out = tmp_path / f"{example.stem}-{mode}-{len(list(tmp_path.iterdir()))}"
            script = render_example(example, out, [*FIT, f"slurm.mode={mode}", *extra])
            done = sbatch_test_only(cluster, script)
            # accepted: "sbatch: Job N to start at ... on nodes ..." and status 0
            if done.returncode != 0 or "to start at" not in done.stderr:
                refused.append((script.name, mode, extra, done.stderr.strip()))
        return refused

    runs = [(example, mode, extra) for example in EXAMPLES for mode in ("torchrun", "srun")
            for extra in variants(held_job)]
    in_reservation = [r for r in runs if any(e.startswith("slurm.reservation=") for e in r[2])]
    refused = check([r for r in runs if r not in in_reservation])
    with reservation(cluster):
        refused += check(in_reservation)
    assert len(runs) == len(EXAMPLES) * 2 * len(variants(held_job)) >= 44 and len(in_reservation) >= 4
    assert refused == [], "\n".join(map(str, refused))


@pytest.mark.parametrize(("extra", "error"), [
    (["slurm.constraint=rack1"], "Requested node configuration is not available"),
    (["slurm.reservation=nosuch"], "requested reservation is invalid"),
    (["slurm.exclude=node1"], "Requested node configuration is not available"),
])
def test_sbatch_refuses_what_the_cluster_cannot_give(cluster: SlurmCluster, tmp_path: Path,
                                                     extra: list[str], error: str) -> None:
    """The options really reach sbatch: one the cluster cannot satisfy (both
    nodes on one rack, no such reservation, a 2-node job with one node
    excluded) is refused. --test-only does not look at
    dependencies, so that one is a real submission."""
    script = render_example(EXAMPLES[0], tmp_path, [*FIT, *extra])
    dependency = any(e.startswith("slurm.dependency") for e in extra)
    done = (cluster.run(["sbatch", "--parsable", "--hold", str(script)], cwd=tmp_path) if dependency
            else sbatch_test_only(cluster, script))
    if done.returncode == 0 and dependency:
        cluster.run(["scancel", done.stdout.strip().split(";")[0]])
    assert done.returncode != 0 and error.lower() in done.stderr.lower(), done.stderr


def test_placement_options_as_slurm_records_them(cluster: SlurmCluster, tmp_path: Path, held_job: int) -> None:
    """A held job with every option: scontrol shows what sbatch read from the
    #SBATCH lines, quotes and '#' included."""
    comment = "it's a \"#quoted\" \\ comment"
    spec = job_spec("placed", dependency=f"afterok:{held_job}", constraint="ddp&rack1", nodelist="node1",
                    extra_sbatch=[f"--comment={comment}", "--nice=10"])
    spec["nodes"] = 1
    script = render(tmp_path, spec)
    job = cluster.sbatch(script, "--hold")
    try:
        info = cluster.run(["scontrol", "show", "job", str(job)]).stdout
    finally:
        cluster.run(["scancel", str(job)])
    assert f"Comment={comment}" in [line.strip() for line in info.splitlines()], info
    assert f"Dependency=afterok:{held_job}" in info and "Features=ddp&rack1" in info
    assert "ReqNodeList=node1" in info and "Nice=10" in info
