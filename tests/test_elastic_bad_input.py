"""Bad elastic input (docs/guides/elastic.md, "Spec rules"): each is refused with a
one-line cause and fix, exit 2, and nothing is rendered, written or started.
Covers the spec (YAML and --set), the targets that cannot run an elastic
job, `launch ssh` and `ddpkit train`'s own flag."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.cli import main as cli_main
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import SpecError
from ddpkit.targets import render

ELASTIC = {"min_nodes": 2, "max_restarts": 4}
TARGETS = ["slurm", "k8s", "ssh", "compose"]


def write(tmp_path: Path, **fields: Any) -> Path:
    job = {"name": "el", "nodes": 3, "elastic": dict(ELASTIC), **fields}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def problems(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if ln.startswith("  - ")]


@pytest.mark.parametrize(("fields", "needle"), [
    ({"elastic": {"min_nodes": 4}}, "elastic.min_nodes 4 is more than nodes 3; set min_nodes between 1 and 3"),
    ({"elastic": {"min_nodes": 0}}, "greater than or equal to 1"),
    ({"elastic": {"min_nodes": 1}, "nodes": 1}, "a 1-node job has no node to lose; set nodes to 2 or more"),
    ({"elastic": {"min_nodes": 2, "max_restarts": -1}}, "greater than or equal to 0"),
    ({"elastic": {"min_nodes": 2, "max_restarts": 101}}, "less than or equal to 100"),
    ({"elastic": {"max_restarts": 1}}, "elastic.min_nodes"),
    ({"rendezvous": {"backend": "static"}}, "elastic needs c10d rendezvous (node ranks are assigned anew at each "
                                            "restart); remove rendezvous.backend: static"),
    ({"elastic": {"min_nodes": 2, "keep_global_batch": True}, "command": {"module": "my.train"}},
     "elastic.keep_global_batch adjusts ddpkit.train's gradient accumulation"),
    ({"elastic": {"min_nodes": 2, "spare": 1}}, "elastic.spare: unknown field"),
])
@pytest.mark.parametrize("target", TARGETS)
def test_bad_spec_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             fields: dict[str, Any], needle: str, target: str) -> None:
    out = tmp_path / "out"
    assert cli_main(["render", target, "-f", str(write(tmp_path, **fields)), "-o", str(out)]) == 2
    found = problems(capsys.readouterr().err)
    assert len(found) == 1 and needle in found[0], found
    assert not out.exists()


def test_a_set_override_is_checked_the_same_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    argv = ["render", "ssh", "-f", str(write(tmp_path)), "--set", "elastic.min_nodes=5", "-o", str(out)]
    assert cli_main(argv) == 2
    assert "elastic.min_nodes 5 is more than nodes 3" in problems(capsys.readouterr().err)[0]
    assert not out.exists()


def test_an_explicit_c10d_is_fine_and_static_by_default_becomes_c10d() -> None:
    spec = JobSpec.model_validate({"name": "el", "nodes": 3, "elastic": ELASTIC, "rendezvous": {"backend": "c10d"}})
    assert spec.rendezvous.backend == "c10d"
    assert JobSpec.model_validate({"name": "el", "nodes": 3, "elastic": ELASTIC}).rendezvous.backend == "c10d"


REFUSALS = [
    ("slurm", ["slurm.mode=srun"], "elastic on slurm-srun: slurm.mode: srun starts every process itself"),
    ("k8s", ["k8s.kind=indexed-job"], "elastic on indexed-job:"),
    ("k8s", ["k8s.kind=trainjob"], "elastic on trainjob:"),
    ("k8s", ["k8s.kind=jobset"], "elastic on jobset:"),
]


@pytest.mark.parametrize(("target", "overrides", "needle"), REFUSALS, ids=[r[1][0] for r in REFUSALS])
@pytest.mark.parametrize("doctor", [False, True])
def test_a_target_that_cannot_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str,
                                         overrides: list[str], needle: str, doctor: bool) -> None:
    out = tmp_path / "out"
    sets = [w for o in overrides for w in ("--set", o)]
    argv = ["render", target, "-f", str(write(tmp_path)), *sets, "-o", str(out), *(["--doctor"] if doctor else [])]
    assert cli_main(argv) == 2
    found = problems(capsys.readouterr().err)
    assert len(found) == 1 and needle in found[0] and re.search(r"; (use|set) ", found[0]), found
    assert not out.exists()


def test_a_refusal_is_an_input_error_in_the_api_too() -> None:
    spec = JobSpec.model_validate({"name": "el", "nodes": 3, "elastic": ELASTIC, "k8s": {"kind": "jobset"}})
    with pytest.raises(SpecError, match="elastic on jobset"):
        render(spec, "k8s")


def test_launch_ssh_refuses_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2\nh3\n")
    job = write(tmp_path, elastic={"min_nodes": 9}, ssh={"log_dir": str(tmp_path / "logs")})
    assert cli_main(["launch", "ssh", "-f", str(job), "--hostfile", str(hostfile), "--dry-run"]) == 2
    assert "elastic.min_nodes 9 is more than nodes 3" in problems(capsys.readouterr().err)[0]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_train_refuses_a_bad_keep_global_batch(value: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ddpkit.train", "--keep-global-batch-of", value, "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--keep-global-batch-of" in done.stderr and "Traceback" not in done.stderr
