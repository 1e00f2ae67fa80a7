"""`ddpkit train`'s command line checked before a job is rendered or started.

A spec whose `command.args` say `--modle=resnet50` would otherwise wait in a
queue for its GPUs and then fail on every rank at once. `render`, `launch`
and `submit` call `check_command` on the job's final command: when it runs
`ddpkit.train`, its arguments go through the trainer's own parser (the one
`ddpkit train` and torchrun's workers use) and the checks that need no node
(`options.static_problems`); a problem is one line, `TrainArgsError`, exit 2
(cli.main), before anything is written or started.

A spec's arguments reach the trainer literally, but a value with `$` or a
backquote may be meant for a shell on the node (a wrapper script, a custom
template): with one present only the option names are checked, never the
values, so nothing that could be right is refused.

No torch import: it runs in `ddpkit render`.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn

from ..shared.agreed import TRAIN_MODULE
from ..shared.exitcodes import ExitCode
from .config.options import static_problems

SHELL_CHARS = ("$", "`")


class TrainArgsError(ValueError):
    """One line: what is wrong with a ddpkit.train command line, and the fix."""

    exit_code = ExitCode.BAD_INPUT


class _Raising(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise TrainArgsError(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise TrainArgsError(message or "the trainer's parser would exit here")


def train_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
                 prog: str = "ddpkit train") -> argparse.ArgumentParser:
    """The trainer's parser, as `ddpkit train` builds it."""
    from .main import add_arguments

    parser = parser_class(prog=prog, description="the DDP training entrypoint")
    add_arguments(parser)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings]


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The message for arguments `parser` does not know: the first option
    among them with the closest known name, else every one."""
    options = [e for e in extras if e.startswith("-") and e != "-"]
    if options:
        name = options[0].split("=", 1)[0]
        return f"unrecognized argument {options[0]}{did_you_mean(name, option_strings(parser))}"
    return f"unrecognized arguments: {' '.join(extras)}"


def unknown_options_line(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """What a command says of options it does not know: one line, naming
    the closest known one (not argparse's usage, printed once per rank)."""
    return f"{parser.prog}: error: {unrecognized(parser, extras)}; see {parser.prog} --help"


def _known_name(parser: argparse.ArgumentParser, name: str) -> bool:
    """As argparse matches it: exactly, or a prefix of exactly one long option."""
    names = option_strings(parser)
    if name in names:
        return True
    return parser.allow_abbrev and name.startswith("--") and len([n for n in names if n.startswith(name)]) == 1


def train_args_problem(args: Sequence[str]) -> str | None:
    """What is wrong with these `ddpkit train` arguments, in one line, or None."""
    parser = train_parser(_Raising)
    if any(a in ("-h", "--help") for a in args):
        return "--help: the job would print the usage and exit without training; remove it"
    if any(c in a for a in args for c in SHELL_CHARS):
        for arg in args:
            name = arg.split("=", 1)[0]
            if arg.startswith("--") and not any(c in name for c in SHELL_CHARS) and not _known_name(parser, name):
                return unrecognized(parser, [arg])
        return None
    try:
        ns, extras = parser.parse_known_args(list(args))
    except TrainArgsError as exc:
        return str(exc)
    if extras:
        return unrecognized(parser, extras)
    found = static_problems(ns)
    return "; ".join(found) if found else None


def check_command(module: str | None, args: Sequence[str]) -> None:
    """Raises TrainArgsError when a job that runs ddpkit.train has arguments
    it would refuse; another program's arguments are its own business."""
    if module != TRAIN_MODULE:
        return
    problem = train_args_problem(args)
    if problem:
        raise TrainArgsError(f"command.args for {TRAIN_MODULE}: {problem}; nothing was written or started")
