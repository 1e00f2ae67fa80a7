"""Runs that another tool starts: the Kubernetes manifests `ddpkit render k8s`
writes for `kubectl apply`, and the compose file `ddpkit render compose`
writes for `docker compose up`. Rendering records a run (state `rendered`);
`ddpkit status` and `ddpkit logs` then ask kubectl or docker compose about
it (backends/kubectl.py, backends/compose.py), and where that tool is not
installed they print the exact command to run where it is (docs/guides/runs.md).
This module records the render and runs the tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from ...render.engine import Rendered
from ...runs import Applied, RunFolder, RunRecord, RunsDirError, RunState, RunTarget, all_runs
from ...spec import JobSpec
from ...spec.yamlfile import dump_yaml
from ...targets.kubernetes import KINDS
from ...targets.kubernetes.base import Controller

TOOL_S = 30.0  # one kubectl/compose query; a cluster that does not answer in this is reported, not waited on
# The targets whose rendered files another tool starts (a run is recorded for them), and that tool.
RENDER_TARGETS = {RunTarget.K8S: "kubectl", RunTarget.COMPOSE: "compose"}
# The job object of each kind, by the `kind:` its file names (the kinds' own register).
CONTROLLERS: dict[str, Controller] = {m.INFO.controller.api_kind: m.INFO.controller for m in KINDS.values()}


def recorded_target(render_word: str) -> RunTarget | None:
    """The run target of `ddpkit render WORD` where rendering records a run
    (another tool starts the files), else None."""
    return next((target for target in RENDER_TARGETS if target.value == render_word), None)


def record_render(spec: JobSpec, target: RunTarget, rendered: Rendered, written: list[Path]) -> RunRecord | None:
    """The run of a rendered job. Rendering the same job again updates its
    rendered run (the cluster or the Docker host holds one job of that name)
    instead of adding another. None where the runs folder cannot be written:
    rendering goes on, it only says so."""
    try:
        run = _rendered_run(spec, target) or RunFolder.create(
            name=spec.name, target=target, nodes=spec.nodes, nproc_per_node=spec.nproc_per_node,
            spec_yaml=dump_yaml(spec), first="rendered")
        run.spec_file.write_text(dump_yaml(spec))
        copies = rendered.write(run.rendered_dir)
        applied = _applied(spec, target, rendered, written or copies)
        rec = run.update(applied=applied, state=RunState.RENDERED, nodes=spec.nodes,
                         nproc_per_node=spec.nproc_per_node)
        run.event("files", ", ".join(applied.files))
        return rec
    except (RunsDirError, OSError, ValueError) as exc:
        print(f"ddpkit render: no run recorded ({exc}); the files are written all the same", file=sys.stderr)
        return None


def _rendered_run(spec: JobSpec, target: RunTarget) -> RunFolder | None:
    for run in all_runs():  # newest first
        rec = run.record
        if rec.name == spec.name and rec.target == target:
            return run.folder if rec.state == RunState.RENDERED else None
    return None


def _applied(spec: JobSpec, target: RunTarget, rendered: Rendered, written: list[Path]) -> Applied:
    files = [str(p.resolve()) for p in written]
    if target is RunTarget.COMPOSE:
        main = [f for f in files if Path(f).name == "compose.yaml"] or files
        return Applied(tool="compose", files=main, project=spec.name)
    for text in rendered.files.values():
        for doc in yaml.safe_load_all(text):
            if isinstance(doc, dict) and doc.get("kind") in CONTROLLERS:
                meta = doc.get("metadata") or {}
                return Applied(tool="kubectl", files=files, kind=doc["kind"], group=CONTROLLERS[doc["kind"]].group,
                               object_name=str(meta.get("name", spec.name)),
                               namespace=str(meta.get("namespace") or spec.k8s.namespace or ""))
    raise ValueError(f"rendered {target} files hold none of the kinds {', '.join(CONTROLLERS)}")


def compose_cli() -> list[str]:
    """docker's plugin where it is, else the standalone binary beside this
    Python (the project's venv) or on PATH; [] where there is none."""
    if shutil.which("docker") and run_tool(["docker", "compose", "version"]).returncode == 0:
        return ["docker", "compose"]
    beside = Path(sys.executable).with_name("docker-compose")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("docker-compose")
    return [found] if found else []


def run_tool(words: list[str]) -> subprocess.CompletedProcess[str]:
    """kubectl or docker compose, its output captured; no answer in TOOL_S is exit 124."""
    try:
        return subprocess.run(words, capture_output=True, text=True, check=False, timeout=TOOL_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(words, 124, "", f"no answer in {TOOL_S:g} s")


def last_error(done: subprocess.CompletedProcess[str]) -> str:
    """The tool's last line on stderr, or its exit status."""
    return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
