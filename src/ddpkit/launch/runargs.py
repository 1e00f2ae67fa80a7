"""What every launcher adds to the job on its command line, said once:
`-- TRAIN ARGS` appended to the job's command."""

from __future__ import annotations

import argparse

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
