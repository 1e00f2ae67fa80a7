"""What every launcher adds to the job on its command line, said once:
`-- TRAIN ARGS` appended to the job's command; where ddpkit train's
metrics go when the run folder is on the machine that runs rank 0; and
where a program of the user's own has its metrics kept when it is not."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..shared.agreed import METRICS_FLAG, TRAIN_MODULE, flag_value, is_ddpkit_module
from ..spec import JobSpec


def add_train_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN ARGS",
                        help="arguments appended to the job's command (after --)")


def with_train_args(spec: JobSpec, train_args: list[str]) -> JobSpec:
    """The job with `-- TRAIN ARGS` after its own arguments (the `--` itself dropped)."""
    extra = train_args[1:] if train_args[:1] == ["--"] else list(train_args)
    if not extra:
        return spec
    command = spec.command.model_copy(update={"args": [*spec.command.args, *extra]})
    return spec.model_copy(update={"command": command})


def with_metrics_into(spec: JobSpec, path: Path) -> JobSpec:
    """ddpkit train's metrics records into `path` (the run folder's, where
    `ddpkit report` reads them), unless the job names its own file or is not
    ddpkit train."""
    if spec.command.module != TRAIN_MODULE or flag_value(spec.command.args, METRICS_FLAG) is not None:
        return spec
    command = spec.command.model_copy(update={"args": [*spec.command.args, METRICS_FLAG, str(path)]})
    return spec.model_copy(update={"command": command})


def metrics_from_output(spec: JobSpec, path: Path) -> Path | None:
    """`path` (the run folder's metrics file) for a program of the user's own
    whose rank 0 runs where the run folder is not (launch ssh, launch docker):
    its preamble frames the records on stderr (agreed.METRICS_TO_LAUNCHER) and
    the launcher appends them there. None for ddpkit's own programs (ddpkit
    train writes the --metrics file it is given, on its node)."""
    return None if is_ddpkit_module(spec.command.module) else path
