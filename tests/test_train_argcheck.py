"""A ddpkit.train command line is checked before anything is written or
started: render, launch and submit refuse a flag the
trainer's own parser refuses, in one line with the closest flag, exit 2;
values a shell on the node may expand are never refused; another program's
arguments are not checked. `ddpkit train` itself answers a typo with one
line, and its --help shows the defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.train.argcheck import train_args_problem
from tests.test_startup import ROOT

TYPO = "--modle=resnet50"
ONE_LINE = ("ddpkit: command.args for ddpkit.train: unrecognized argument --modle=resnet50 (did you mean --model?); "
            "nothing was written or started\n")


def spec_file(tmp_path: Path, args: list[str], **fields: object) -> Path:
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "typo", "nodes": 2, "nproc_per_node": 1, "device": "cpu",
                                    "command": {"args": args}, **fields}))
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("target", ["slurm", "k8s", "ssh", "compose"])
def test_render_refuses_a_misspelt_flag_and_writes_nothing(tmp_path: Path, target: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["render", target, "-f", str(spec_file(tmp_path, [TYPO, "--epochs=2"])),
                              "-o", str(tmp_path / "out")], capsys)
    assert (code, out, err) == (ExitCode.BAD_INPUT, "", ONE_LINE)
    assert not (tmp_path / "out").exists()


def test_submit_slurm_refuses_it_before_the_cluster_is_asked(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "scontrol", "sinfo"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho called >> {tmp_path}/called\nexit 0\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    folder = tmp_path / "jobs"
    folder.mkdir()
    for extra in ([], ["--no-check"]):
        code, out, err = run_cli(["submit", "slurm", "-f", str(spec_file(tmp_path, [TYPO])), "--dir", str(folder),
                                  *extra], capsys)
        assert (code, out, err) == (ExitCode.BAD_INPUT, "", ONE_LINE)
    assert list(folder.iterdir()) == [] and not (tmp_path / "called").exists()


@pytest.mark.parametrize("launcher", [["launch", "local"], ["launch", "docker"],
                                      ["launch", "ssh", "--hostfile", "/nonexistent/hostfile"]])
def test_launchers_refuse_it_before_starting_anything(tmp_path: Path, launcher: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli([*launcher, "-f", str(spec_file(tmp_path, [TYPO]))], capsys)
    assert (code, out, err) == (ExitCode.BAD_INPUT, "", ONE_LINE)


def test_launch_local_checks_the_args_after_dash_dash_too(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["launch", "local", "-f", str(spec_file(tmp_path, [])), "--", "--batch-size", "abc"],
                           capsys)
    assert code == ExitCode.BAD_INPUT
    assert err == ("ddpkit: command.args for ddpkit.train: argument --batch-size: must be a whole number >= 1, "
                   "got 'abc'; nothing was written or started\n")


@pytest.mark.parametrize(("args", "problem"), [
    ([TYPO], "unrecognized argument --modle=resnet50 (did you mean --model?)"),
    (["--modle", "resnet50"], "unrecognized argument --modle (did you mean --model?)"),
    (["--model", "resnt50"], "--model 'resnt50' (did you mean resnet50?): use one of resnet18, resnet34, "
                             "resnet50, tiny or package.module:factory"),
    (["--data", "cifar"], "argument --data: invalid choice: 'cifar' (choose from 'synthetic', 'cifar10', "
                          "'imagefolder')"),
    (["--data", "cifar10"], "--data cifar10 needs --data-dir DIR"),
    (["--help"], "--help: the job would print the usage and exit without training; remove it"),
    (["stray"], "unrecognized arguments: stray"),
    # with a value for the node's shell, names are still checked
    (["--modle=$MODEL", "--batch-size", "$BS"], "unrecognized argument --modle=$MODEL (did you mean --model?)"),
])
def test_the_problem_in_one_line(args: list[str], problem: str) -> None:
    assert train_args_problem(args) == problem


@pytest.mark.parametrize("args", [
    [],
    ["--model=resnet50", "--epochs", "3", "--data=cifar10", "--data-dir", "/data/c10"],
    ["--mod", "resnet50"],  # argparse takes a unique prefix, and so does the trainer
    ["--model", "mypkg.models:build", "--resume", "/nowhere/on/this/host.pt"],  # files are the node's business
    ["--batch-size", "$BS", "--data-dir=${DATA}/c10", "--epochs=`cat epochs`"],
    ["--log-dir", "/a b/'q'\"dq\"\n$(touch x)"],
])
def test_good_or_node_side_args_pass(args: list[str]) -> None:
    assert train_args_problem(args) is None


def test_hostile_values_survive_the_check_exactly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostile = "/a b/'q'\"dq\"\n$(touch x)`id`\\"
    code, out, err = run_cli(["render", "compose", "-f", str(spec_file(tmp_path, ["--log-dir", hostile]))], capsys)
    assert code == 0, err
    import yaml

    service = yaml.safe_load(out)["services"]["node0"]
    command = [w.replace("$$", "$") for w in service["command"]]
    assert command[-2:] == ["--log-dir", hostile]


def test_other_programs_and_doctor_runs_are_not_checked(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["render", "slurm", "-f", str(spec_file(tmp_path, [TYPO])), "--set",
                            "command.module=mypkg.train"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["render", "slurm", "-f", str(spec_file(tmp_path, [TYPO])), "--doctor"], capsys)
    assert code == 0, err


def test_ddpkit_train_answers_a_typo_in_one_line_with_its_own_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["train", "--modle", "resnet50"], capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert err == "ddpkit train: error: unrecognized argument --modle (did you mean --model?); see ddpkit train --help\n"


def test_python_m_ddpkit_train_answers_a_typo_in_one_line() -> None:
    """What each torchrun worker runs: one line per rank, not the usage."""
    done = subprocess.run([sys.executable, "-m", "ddpkit.train", TYPO], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=60)
    assert (done.returncode, done.stdout) == (ExitCode.BAD_INPUT, "")
    assert done.stderr == ("ddpkit train: error: unrecognized argument --modle=resnet50 (did you mean --model?); "
                           "see ddpkit train --help\n")


def test_ddpkit_train_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: resnet18)", "(default: synthetic)", "(default: 32)", "(default: 0.1)",
                  "(default: fp32)", "(default: 10)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text


def test_other_commands_name_themselves_on_an_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["render", "slurm", "--nodez", "2"], capsys)
    assert code == ExitCode.BAD_INPUT
    assert err == "ddpkit render: error: unrecognized argument --nodez (did you mean --nodes?); see ddpkit render --help\n"


def test_ddpkit_train_refuses_node_side_options_in_one_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """What only the node can tell (a --resume file) is the trainer's own
    refusal: one line too, which a launcher shows once, last."""
    missing = tmp_path / "nope.pt"
    code, out, err = run_cli(["train", "--resume", str(missing), "--data", "cifar10"], capsys)
    assert (code, out) == (ExitCode.BAD_INPUT, "")
    assert err == (f"ddpkit train: invalid options (nothing was started): --data cifar10 needs --data-dir DIR; "
                   f"--resume {missing}: no such file (use auto, or a checkpoint file)\n")
