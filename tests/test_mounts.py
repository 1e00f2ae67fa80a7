"""The job's `mounts:` on every target (targets/mounts.py): bound where
there are containers, honoured as they stand or refused with the fix where
there are none, matched to k8s.volumes on Kubernetes; and the warning when a
resumable job's checkpoints would go with its container."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.cli import main
from ddpkit.render.quoting import compose_unliteral
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import SpecError
from ddpkit.targets import kubernetes, render, slurm

# A hostile host path: quotes, a space, `$(...)`: every file must carry it as given.
HOST = "/srv/it's a \"data\" $(echo X)"
RESUME = ["--checkpoint-dir", "/ckpt/run", "--resume", "auto"]


def spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "mj", "nodes": 2, "device": "cpu", "mounts": [f"{HOST}:/data:ro"]}
    return JobSpec.model_validate(base | fields)


def test_compose_binds_every_mount_into_every_service() -> None:
    doc = yaml.safe_load(render(spec(), "compose").files["compose.yaml"])
    # As compose reads it: `$$` in the file is a literal `$`, so `$(echo X)` is never interpolated.
    got = [[compose_unliteral(v) for v in svc["volumes"]] for svc in doc["services"].values()]
    assert got == [[f"{HOST}:/data:ro"]] * 2


def test_slurm_container_runtimes_bind_the_jobs_mounts_after_their_own() -> None:
    pyxis = spec(slurm={"container": {"runtime": "pyxis", "mounts": ["/scratch:/scratch"]}})
    assert f"--container-mounts=/scratch:/scratch,{HOST}:/data:ro" in slurm.srun_options(pyxis)
    apptainer = spec(slurm={"container": {"runtime": "apptainer"}})
    prefix = slurm.container_prefix(apptainer)
    assert prefix[prefix.index("--bind") + 1] == f"{HOST}:/data:ro"
    assert shlex.quote(f"{HOST}:/data:ro") in render(apptainer, "slurm").files["mj.sbatch"]


def test_ssh_docker_passes_each_mount_to_docker_run() -> None:
    text = render(spec(ssh={"docker": True}), "ssh").files["launch.sh"]
    assert "-v" in text and "/data:ro" in text and "echo X" in text


@pytest.mark.parametrize(("target", "fields", "where"), [
    ("slurm", {}, "Slurm without slurm.container.runtime"),
    ("ssh", {}, "SSH without ssh.docker"),
])
def test_a_target_without_containers_refuses_a_moved_folder(target: str, fields: dict[str, Any], where: str) -> None:
    with pytest.raises(SpecError, match=f"moves a folder, which {where} cannot do") as err:
        render(spec(**fields), target)
    assert "write /data:/data" in str(err.value)


def test_a_target_without_containers_takes_a_folder_where_it_is() -> None:
    same = spec(mounts=["/data:/data:ro"])
    assert render(same, "slurm").files and render(same, "ssh").files


def test_launch_local_refuses_a_moved_folder_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "local", "--set", "device=cpu", "--set", "mounts=[/srv/data:/data]"])
    err = capsys.readouterr().err
    assert code == 2 and "mounts: /srv/data:/data moves a folder, which launch local cannot do" in err, err


def test_kubernetes_needs_a_volume_at_each_mounts_target() -> None:
    with pytest.raises(SpecError, match=r"mounts: /data on Kubernetes needs a volume there: add to k8s.volumes"):
        render(spec(), "k8s")
    matched = spec(k8s={"volumes": [{"name": "data", "mount_path": "/data", "persistent_volume_claim": "d"}]})
    assert kubernetes.filename(matched) in render(matched, "k8s").files


@pytest.mark.parametrize(("target", "fields", "file"), [
    ("compose", {}, "compose.yaml"),
    ("ssh", {"ssh": {"docker": True}}, "launch.sh"),
    ("slurm", {"slurm": {"container": {"runtime": "pyxis"}}}, "mj.sbatch"),
])
def test_container_targets_warn_when_checkpoints_stay_in_the_container(
        target: str, fields: dict[str, Any], file: str) -> None:
    unsaved = spec(command={"args": RESUME}, **fields)
    [warning] = [n for n in render(unsaved, target).notes.get(file, ()) if n.startswith("warning:")]
    assert "--resume auto but no writable mount holds --checkpoint-dir /ckpt/run" in warning
    assert "add to mounts '/host/ckpt:/ckpt'" in warning
    saved = spec(command={"args": RESUME}, mounts=["/srv/ckpt:/ckpt"], **fields)
    assert not [n for n in render(saved, target).notes.get(file, ()) if n.startswith("warning:")]
    read_only = spec(command={"args": RESUME}, mounts=["/srv/ckpt:/ckpt:ro"], **fields)
    assert [n for n in render(read_only, target).notes.get(file, ()) if n.startswith("warning:")]


def test_render_prints_the_warning_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["render", "compose", "--set", "device=cpu", "--set", "command.args=" + repr(RESUME),
                 "-o", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0 and "warning: compose: --resume auto but no writable mount holds" in err


# ---- a program of the user's own in a container (targets/program_paths.py) ----

CONTAINER_TARGETS = [
    ("compose", {}, "compose.yaml"),
    ("ssh", {"ssh": {"docker": True}}, "launch.sh"),
]


def warnings_of(job: JobSpec, target: str, file: str) -> list[str]:
    return [n for n in render(job, target).notes.get(file, ()) if n.startswith("warning:")]


def k8s_warnings(job: JobSpec) -> list[str]:
    return [n for n in render(job, "k8s").notes.get(kubernetes.filename(job), ()) if n.startswith("warning:")]


@pytest.mark.parametrize(("target", "fields", "file"), CONTAINER_TARGETS)
def test_a_host_script_that_no_mount_brings_in_is_named_with_the_fix(
        tmp_path: Path, target: str, fields: dict[str, Any], file: str) -> None:
    script = tmp_path / "it's train.py"
    script.write_text("print('hi')\n")
    [warning] = warnings_of(spec(command={"script": str(script)}, **fields), target, file)
    assert f"command.script {shlex.quote(str(script))} is a file of this host that no mount brings" in warning
    assert f"add to mounts {shlex.quote(f'{tmp_path}:{tmp_path}:ro')}" in warning
    mounted = spec(command={"script": str(script)}, mounts=[f"{tmp_path}:{tmp_path}:ro"], **fields)
    assert warnings_of(mounted, target, file) == []
    # A path this host does not have is the image's business: nothing to say.
    assert warnings_of(spec(command={"script": "/opt/app/train.py"}, **fields), target, file) == []


def test_a_virtual_environments_python_is_named_unless_mounted(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    python = venv / "bin" / "python"
    python.write_text("")
    [warning] = warnings_of(spec(command={"python": str(python), "script": "/opt/app/t.py"}), "compose",
                            "compose.yaml")
    assert f"command.python {python} is the virtual environment {venv} of this host" in warning
    assert "Fix: set command.python to the image's interpreter (python3)" in warning
    mounted = spec(command={"python": str(python), "script": "/opt/app/t.py"}, mounts=[f"{venv}:{venv}:ro"])
    assert warnings_of(mounted, "compose", "compose.yaml") == []
    assert warnings_of(spec(command={"script": "/opt/app/t.py"}), "compose", "compose.yaml") == []


@pytest.mark.parametrize(("target", "fields", "file"), CONTAINER_TARGETS)
@pytest.mark.parametrize("args", [["--output_dir", "/out/run"], ["--output-dir=/out/run"],
                                  ["--trainer.default_root_dir", "/out/run"]])
def test_a_programs_output_folder_inside_the_container_is_named(
        target: str, fields: dict[str, Any], file: str, args: list[str]) -> None:
    flag = args[0].partition("=")[0]
    [warning] = warnings_of(spec(command={"script": "/opt/app/t.py", "args": args}, **fields), target, file)
    assert f"{flag} /out/run is on no writable storage that outlives the container" in warning
    assert "Fix: add to mounts /host/out:/out/run" in warning
    kept = spec(command={"script": "/opt/app/t.py", "args": args}, mounts=["/srv/out:/out"], **fields)
    assert warnings_of(kept, target, file) == []
    read_only = spec(command={"script": "/opt/app/t.py", "args": args}, mounts=["/srv/out:/out:ro"], **fields)
    assert len(warnings_of(read_only, target, file)) == 1


def test_a_relative_output_folder_asks_for_an_absolute_one() -> None:
    [warning] = warnings_of(spec(command={"script": "/opt/app/t.py", "args": ["--output_dir", "out"]}),
                            "compose", "compose.yaml")
    assert "--output_dir out is on no writable storage" in warning
    assert "give an absolute path (a relative one is inside the image's working directory)" in warning


def test_a_hostile_output_folder_is_quoted_as_given() -> None:
    folder = "/out/it's $(echo X)"
    [warning] = warnings_of(spec(command={"script": "/opt/app/t.py", "args": ["--output_dir", folder]}),
                            "compose", "compose.yaml")
    assert f"--output_dir {shlex.quote(folder)} is on no writable storage" in warning
    assert shlex.quote(f"/host/out:{folder}") in warning


def test_ddpkit_train_keeps_its_own_rule_and_one_warning_per_folder() -> None:
    # ddpkit train: only a resumable job's checkpoints are worth a word (the resume warning above).
    assert warnings_of(spec(command={"args": ["--checkpoint-dir", "/ckpt/run"]}), "compose", "compose.yaml") == []
    [warning] = warnings_of(spec(command={"script": "/opt/app/t.py", "args": RESUME}), "compose", "compose.yaml")
    assert "--resume auto but no writable mount holds --checkpoint-dir /ckpt/run" in warning


def test_kubernetes_wants_a_shared_volume_for_a_programs_outputs() -> None:
    base: dict[str, Any] = {"name": "mj", "nodes": 2, "device": "cpu",
                            "command": {"script": "/opt/app/t.py", "args": ["--output_dir", "/out/run"]}}
    [warning] = k8s_warnings(JobSpec.model_validate(base))
    assert warning.startswith("warning: k8s: --output_dir /out/run is on no writable storage")
    assert "add to k8s.volumes {name: out, mount_path: /out/run, persistent_volume_claim: <claim>}" in warning
    scratch = base | {"k8s": {"volumes": [{"name": "o", "mount_path": "/out", "empty_dir": {}}]}}
    assert len(k8s_warnings(JobSpec.model_validate(scratch))) == 1
    shared = base | {"k8s": {"volumes": [{"name": "o", "mount_path": "/out", "persistent_volume_claim": "c"}]}}
    assert k8s_warnings(JobSpec.model_validate(shared)) == []


def test_render_prints_the_programs_warnings_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["render", "compose", "--set", "device=cpu", "--set", "command.script=/opt/app/t.py",
                 "--set", "command.args=['--output_dir', '/out']", "-o", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0 and "warning: compose: --output_dir /out is on no writable storage" in err
