"""What every run command (`ddpkit runs`, `status`, `logs`, `cancel`) shares:
its entry in the CLI and the one-line refusal, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ...exitcodes import ExitCode
from ...runs import UnknownRun


@dataclass(frozen=True)
class Command:
    """One `ddpkit` command of this module (cli.COMMANDS names it `module:NAME`)."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class RunCommandError(Exception):
    """A one-line refusal, with its exit code."""

    def __init__(self, line: str, code: int = ExitCode.BAD_INPUT) -> None:
        super().__init__(line)
        self.code = code


def one_line(command: str, body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Every refusal as one line on stderr, never a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except UnknownRun as exc:
            print(f"ddpkit {command}: {exc}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        except RunCommandError as exc:
            print(f"ddpkit {command}: {exc}", file=sys.stderr)
            return exc.code
        except FileNotFoundError as exc:  # a Slurm command missing on this host
            print(f"ddpkit {command}: {exc.filename or exc} is not installed here: run this on a host that has "
                  "it (a Slurm login node)", file=sys.stderr)
            return ExitCode.PREFLIGHT
        except OSError as exc:
            print(f"ddpkit {command}: {exc}", file=sys.stderr)
            return ExitCode.FAILED
        except KeyboardInterrupt:
            return ExitCode.INTERRUPTED
    return run
