"""command.workdir: every process starts in it on every target, made if
missing (ddpkit/host/workdir.py, entered by the agent and by `python -m
ddpkit.run`); on Kubernetes an emptyDir holds it where no volume does, with a
warning that it goes with the pod; a folder that cannot be made ends the
process with one line and exit 3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.contract import target_env
from ddpkit.shared import envnames
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.spec import JobSpec
from ddpkit.targets import kubernetes, render
from tests.test_startup import ROOT

WHERE = "import os; print('cwd', os.getcwd()); open('made-here.txt', 'w').write('x')\n"


def spec(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "wd", "nodes": 2, "device": "cpu",
                            "command": {"script": "/opt/app/train.py", "workdir": "/work/job"}}
    return JobSpec.model_validate(base | fields)


def runner(tmp_path: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    program = tmp_path / "where.py"
    program.write_text(WHERE)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), envnames.DDPKIT_WORKDIR: str(workdir)}
    return subprocess.run([sys.executable, "-m", "ddpkit.run", str(program)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)


def test_a_relative_workdir_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"command.workdir 'out' is not an absolute path; write it as the nodes"):
        spec(command={"script": "/opt/app/train.py", "workdir": "out"})


def test_every_process_gets_the_workdir_in_its_environment() -> None:
    assert target_env(spec())[envnames.DDPKIT_WORKDIR] == "/work/job"
    assert envnames.DDPKIT_WORKDIR not in target_env(spec(command={"script": "/opt/app/train.py"}))


def test_the_runner_makes_and_enters_the_workdir_before_the_program(tmp_path: Path) -> None:
    folder = tmp_path / "not" / "there yet"
    done = runner(tmp_path, folder)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"cwd {folder}"] and (folder / "made-here.txt").is_file()


def test_a_workdir_that_cannot_be_made_is_one_line_and_exit_3(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = runner(tmp_path, tmp_path / "a-file" / "job")
    assert done.returncode == ExitCode.PREFLIGHT, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"ddpkit.run: command.workdir {tmp_path / 'a-file' / 'job'} cannot be made or "
                                  "entered as uid "), done.stderr


def pod_of(job: JobSpec) -> tuple[dict[str, Any], list[str]]:
    rendered = render(job, "k8s")
    name = kubernetes.filename(job)
    doc = yaml.safe_load(rendered.files[name])
    pod = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return pod, [n for n in rendered.notes.get(name, ()) if n.startswith("warning:")]


def test_kubernetes_holds_the_workdir_in_an_empty_dir_and_warns_that_it_goes_with_the_pod() -> None:
    pod, warnings = pod_of(spec())
    assert {"name": "ddpkit-workdir", "emptyDir": {}} in pod["volumes"]
    assert {"name": "ddpkit-workdir", "mountPath": "/work/job"} in pod["containers"][0]["volumeMounts"]
    assert any("command.workdir /work/job is an emptyDir in each pod" in w for w in warnings), warnings


def test_kubernetes_uses_the_volume_that_holds_the_workdir(tmp_path: Path) -> None:
    kept = spec(k8s={"volumes": [{"name": "jobs", "mount_path": "/work", "persistent_volume_claim": "jobs"}]})
    pod, warnings = pod_of(kept)
    assert all(v["name"] != "ddpkit-workdir" for v in pod["volumes"]), pod["volumes"]
    assert not any("command.workdir" in w for w in warnings), warnings


@pytest.mark.slow
def test_launch_local_starts_every_process_in_the_workdir(tmp_path: Path) -> None:
    program = tmp_path / "where.py"
    program.write_text(WHERE.replace("'made-here.txt'", "f\"made-by-rank-{os.environ['RANK']}.txt\""))
    folder = tmp_path / "job folder"
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2", "--nproc-per-node",
                           "1", "--set", f"command.script={program}", "--set", f"command.workdir={folder}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in folder.glob("made-by-rank-*")) == ["made-by-rank-0.txt", "made-by-rank-1.txt"]
    assert f"cwd {folder}" in done.stdout
