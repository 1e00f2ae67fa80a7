"""`ddpkit render <target> --doctor` swaps the program for `-m ddpkit.doctor`
and changes nothing else: same files, same launch line up to the program,
same environment, so the doctor runs through the job's own launch path."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
import yaml

from ddpkit.spec import doctor_mode
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import TARGETS, render
from ddpkit.targets.compose import FILENAME as COMPOSE_FILE

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu-smoke.yaml"


def changed_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.ndiff(before.splitlines(), after.splitlines()))
    return [d[2:] for d in diff if d.startswith("- ")], [d[2:] for d in diff if d.startswith("+ ")]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_doctor_swaps_the_program_and_nothing_else(target: str) -> None:
    spec = load_spec(EXAMPLE)
    job, doc = render(spec, target), render(doctor_mode(spec), target)
    assert sorted(job.files) == sorted(doc.files)
    program = spec.command.argv()  # ['-m', 'ddpkit.train', '--model=resnet18', ...]
    touched = 0
    for name in job.files:
        removed, added = changed_lines(job.files[name], doc.files[name])
        assert all("ddpkit.doctor" in line for line in added), (name, added)
        assert all(any(tok in line for tok in program[1:]) for line in removed), (name, removed)
        assert "ddpkit.doctor" not in job.files[name]
        touched += bool(added)
    assert touched, f"{target}: no file runs the doctor"


def test_compose_doctor_command_is_the_same_torchrun_line() -> None:
    spec = load_spec(EXAMPLE)
    job = yaml.safe_load(render(spec, "compose").files[COMPOSE_FILE])
    doc = yaml.safe_load(render(doctor_mode(spec), "compose").files[COMPOSE_FILE])
    program = len(spec.command.argv())
    for name, svc in job["services"].items():
        dsvc = doc["services"][name]
        assert dsvc["command"][:-2] == svc["command"][:-program]
        assert dsvc["command"][-2:] == ["-m", "ddpkit.doctor"]
        assert dsvc["command"][:3] == ["python3", "-m", "ddpkit.agent"]
        assert {k: v for k, v in dsvc.items() if k != "command"} == {k: v for k, v in svc.items() if k != "command"}
