"""What every run command (`ddpkit runs`, `status`, `logs`, `cancel`)
shares: its entry in the CLI, the states a run is active in, and which
errors a run command turns into one line and which exit code (`exit_line`;
printed by exitcodes.exit_on, as every command's errors are)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ...runs import RunState, UnknownRun
from ...shared.exitcodes import ExitCode, exit_on

POLL_S = 0.5  # how often a command that waits (cancel, logs --follow) asks again
ACTIVE = (RunState.RUNNING, RunState.PENDING)


@dataclass(frozen=True)
class ControlCommand:
    """One `ddpkit` command of this package (cli.COMMANDS names it `module:NAME`)."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class RunCommandError(Exception):
    """A one-line refusal, with its exit code."""

    def __init__(self, line: str, exit_code: int = ExitCode.BAD_INPUT) -> None:
        super().__init__(line)
        self.exit_code = exit_code


class ToolMissing(RunCommandError):
    """kubectl or docker compose is not installed here: the line names the
    exact command to run where it is (exit 3)."""

    def __init__(self, tool: str, command: str) -> None:
        super().__init__(f"{tool} is not installed here; where it is, run: {command}", ExitCode.PREFLIGHT)
        self.tool = tool
        self.command = command


def exit_line(exc: BaseException) -> tuple[str, int] | None:
    """The one line and exit code for an error a run command may meet; None
    for one it does not expect (raised on, as a bug)."""
    if isinstance(exc, UnknownRun):
        return str(exc), ExitCode.BAD_INPUT
    if isinstance(exc, RunCommandError):
        return str(exc), exc.exit_code
    if isinstance(exc, FileNotFoundError):  # a Slurm command missing on this host
        return (f"{exc.filename or exc} is not installed here: run this on a host that has it (a Slurm login node)",
                ExitCode.PREFLIGHT)
    if isinstance(exc, OSError):
        return str(exc), ExitCode.FAILED
    return None


def one_line(command: str, body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Every refusal as one line on stderr, never a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except KeyboardInterrupt:
            return ExitCode.INTERRUPTED
        except Exception as exc:
            said = exit_line(exc)
            if said is None:
                raise
            return exit_on(f"ddpkit {command}", said[0], said[1])
    return run


def already_ended(run_id: str, state: RunState, exit_code: int | None) -> int:
    """`cancel` of a run that is over: says so; exit 0 unless it was abandoned."""
    print(f"ddpkit cancel: run {run_id} has already ended: {state.value}"
          + ("" if exit_code is None else f", exit code {exit_code}"))
    return ExitCode.OK if state != RunState.ABANDONED else ExitCode.FAILED
