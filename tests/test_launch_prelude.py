"""The prelude every launcher starts with (launch/prelude.py): its checks in
one order, each the input error its cli reports, and the pieces a launcher
takes from it (the run folder, its lines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddpkit.contract import RowKey
from ddpkit.launch.prelude import prelude
from ddpkit.runs import RunFolder, RunTarget
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import SpecError, SpecFileError
from ddpkit.train.argcheck import TrainArgsError


def job(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "pre", **fields})


def test_a_job_that_passes_gives_its_spec_and_its_secrets_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRE_TOKEN", "s3cret")
    spec = job(secrets=[{"name": "PRE_TOKEN"}])
    ready = prelude(spec, "launch local", RowKey.LOCAL)
    assert ready.spec is spec and ready.who == "launch local" and ready.secrets == {"PRE_TOKEN": "s3cret"}
    assert "s3cret" not in repr(ready)


def test_the_trainer_arguments_are_checked_before_the_targets_refusals() -> None:
    refused = job(nodes=2, elastic={"min_nodes": 1}, slurm={"mode": "srun"})
    with pytest.raises(SpecError, match="elastic on slurm-srun"):
        prelude(refused, "submit slurm", RowKey.SLURM_SRUN)
    both = job(nodes=2, elastic={"min_nodes": 1}, slurm={"mode": "srun"}, command={"args": ["--no-such-flag"]})
    with pytest.raises(TrainArgsError, match="--no-such-flag"):
        prelude(both, "submit slurm", RowKey.SLURM_SRUN)


def test_no_target_leaves_the_refusal_to_rendering() -> None:
    refused = job(nodes=2, elastic={"min_nodes": 1}, slurm={"mode": "srun"})
    assert prelude(refused, "submit slurm", None).spec is refused


def test_an_unset_secret_is_refused_in_the_launchers_words_unless_none_is_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PRE_TOKEN", raising=False)
    spec = job(secrets=[{"name": "PRE_TOKEN"}])
    with pytest.raises(SpecFileError, match=r"launch ssh: secrets \['PRE_TOKEN'\] not set"):
        prelude(spec, "launch ssh", RowKey.SSH)
    assert prelude(spec, "launch ssh", RowKey.SSH, read_secrets=False).secrets == {}  # a dry run


def test_the_specs_warnings_carry_the_launchers_name(capsys: pytest.CaptureFixture[str]) -> None:
    prelude(job(env={"HF_TOKEN": "hf_" + "a" * 34}), "launch docker", RowKey.COMPOSE)
    assert capsys.readouterr().err.startswith("launch docker: warning: env.HF_TOKEN:")


def test_the_run_folder_and_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_RUNS_DIR", str(tmp_path))
    ready = prelude(job(nodes=2, nproc_per_node=3), "launch ssh", RowKey.SSH)
    run = ready.run_folder(RunTarget.SSH, nodes=4)
    record = RunFolder(run.path).record()
    assert (record.target, record.nodes, record.nproc_per_node) == ("ssh", 4, 3)
    assert record.stop_grace_s == ready.spec.grace.launcher_grace_s
    assert ready.run_folder(RunTarget.LOCAL).record().nodes == 2
    assert ready.run_line(run) == f"launch ssh: run {run.path.name} (ddpkit status {record.id})"


def test_a_slurm_run_folder_keeps_the_script_and_slurms_signal_lead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.targets import render

    monkeypatch.setenv("DDPKIT_RUNS_DIR", str(tmp_path))
    # a checkpoint time that makes the launcher's grace another number than Slurm's signal lead
    ready = prelude(job(nodes=2, slurm={"signal_seconds": 300}, preemption={"checkpoint_s": 30}), "submit slurm", None)
    assert ready.spec.grace.launcher_grace_s != 300
    rendered = render(ready.spec, "slurm")
    run = ready.run_folder(RunTarget.SLURM, rendered=rendered)
    record = RunFolder(run.path).record()
    assert (record.target, record.nodes, record.stop_grace_s) == ("slurm", 2, 300)
    assert (run.rendered_dir / "pre.sbatch").read_text() == rendered.files["pre.sbatch"]


def test_the_watchdog_note_only_for_a_script_with_its_progress_off() -> None:
    script = {"command": {"script": "train.py"}}
    assert prelude(job(**script), "launch local", RowKey.LOCAL).note_line is None
    bare = prelude(job(**script, preamble={"progress": False}), "launch local", RowKey.LOCAL)
    assert bare.note_line is not None and bare.note_line.startswith("launch local: stall detection is off")
