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
from ddpkit.quoting import compose_unliteral
from ddpkit.spec import JobSpec
from ddpkit.specfile import SpecError
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
