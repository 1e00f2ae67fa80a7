"""exitcodes.exit_on: every command's error turned into its printed line and
its exit code, read from the error class's one attribute, `exit_code`."""

from __future__ import annotations

import pytest

from ddpkit.render.engine import RenderError, TemplatesError
from ddpkit.shared.exitcodes import ExitCode, code_of, exit_on
from ddpkit.spec.yamlfile import SpecError, SpecFileError
from ddpkit.train.argcheck import TrainArgsError
from ddpkit.train.startup.netproblem import NetCheckError, Problem
from ddpkit.train.stop.faults import CheckpointDirError, DataMissing, ResumeMismatch, TrainFault


@pytest.mark.parametrize(("error", "code"), [
    (SpecError(["a"]), ExitCode.BAD_INPUT), (SpecFileError("a"), ExitCode.BAD_INPUT),
    (TrainArgsError("a"), ExitCode.BAD_INPUT), (TemplatesError("a"), ExitCode.BAD_INPUT),
    (RenderError("a"), ExitCode.SOFTWARE), (NetCheckError(Problem("c", "cause", "fix")), ExitCode.STARTUP),
    (TrainFault("a"), ExitCode.FAILED), (ResumeMismatch("a"), ExitCode.RESUME_MISMATCH),
    (CheckpointDirError("a"), ExitCode.CHECKPOINT_DIR), (DataMissing("a"), ExitCode.DATA_MISSING),
    (ValueError("a"), ExitCode.BAD_INPUT)])
def test_each_error_names_its_code(error: BaseException, code: ExitCode) -> None:
    assert code_of(error) == code


def test_a_spec_error_prints_its_problems_as_a_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_on("ddpkit", SpecError(["nodes: too many", "name: too long"])) == ExitCode.BAD_INPUT
    assert capsys.readouterr().err == ("ddpkit: invalid job spec (nothing was written or started):\n"
                                       "  - nodes: too many\n  - name: too long\n")
    assert exit_on("ddpkit", SpecFileError("-f x.yaml: no such file")) == ExitCode.BAD_INPUT
    assert capsys.readouterr().err == "ddpkit: -f x.yaml: no such file (nothing was written or started)\n"


def test_the_caller_may_decide_the_code_and_a_message_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_on("ddpkit report", LookupError("no run x"), ExitCode.FAILED) == ExitCode.FAILED
    assert exit_on("ddpkit train", DataMissing("gone"), ExitCode.BAD_INPUT) == ExitCode.BAD_INPUT
    assert exit_on("ddpkit train", "invalid options") == ExitCode.BAD_INPUT
    assert capsys.readouterr().err.splitlines() == ["ddpkit report: no run x", "ddpkit train: gone",
                                                    "ddpkit train: invalid options"]
