"""reference/cli.md: every command and flag, walked from the CLI's own parser."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..cli import build_parser
from .markdown import cell, code, generated_note, table


@dataclass(frozen=True)
class CliCommand:
    """One command a user types: its words after `ddpkit` and its parser."""

    words: tuple[str, ...]
    parser: argparse.ArgumentParser
    help: str


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in action._choices_actions}
            found += [(name, sub, helps.get(name, "")) for name, sub in action.choices.items()]
    return found


def commands(parser: argparse.ArgumentParser | None = None, words: tuple[str, ...] = ()) -> list[CliCommand]:
    """Every leaf command under `parser` (`ddpkit launch local`, not `ddpkit launch`)."""
    parser = parser or build_parser()
    found = []
    for name, sub, help_text in _subcommands(parser):
        inner = commands(sub, (*words, name))
        found += inner or [CliCommand((*words, name), sub, help_text)]
    return found


def _flag_row(action: argparse.Action) -> tuple[str, ...]:
    if action.option_strings:
        takes = "" if action.nargs == 0 else " " + (action.metavar if isinstance(action.metavar, str)
                                                      else action.dest.upper())
        name = ", ".join(code(o + takes) for o in action.option_strings)
    else:
        name = code(action.metavar if isinstance(action.metavar, str) else action.dest)
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else code(str(default))
    choices = ", ".join(code(str(c)) for c in action.choices) if action.choices else ""
    required = "yes" if action.required or not action.option_strings and action.nargs not in ("?", "*") else ""
    help_text = "" if action.help in (None, argparse.SUPPRESS) else str(action.help)
    return name, cell(help_text % vars(action) if "%(" in help_text else help_text), shown, choices, required


def _section(command: CliCommand) -> str:
    title = "ddpkit " + " ".join(command.words)
    rows = [_flag_row(a) for a in command.parser._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]
    lines = [f"## `{title}`", "", cell(command.help or command.parser.description or ""), "",
             "```text", command.parser.format_usage().strip(), "```", ""]
    if rows:
        lines.append(table(("Flag or argument", "What it does", "Default", "Choices", "Required"), rows))
    return "\n".join(lines)


def cli_page() -> str:
    found = commands()
    lines = ["# Commands and flags", "", generated_note("the CLI's parser (ddpkit.cli.build_parser)"), "",
             "Every command `ddpkit` takes, with each flag as its parser defines it; `ddpkit COMMAND --help` "
             "prints the same.", "",
             table(("Command", "What it does"), [(code("ddpkit " + " ".join(c.words)), cell(c.help)) for c in found])]
    lines += [_section(c) for c in found]
    return "\n".join(lines)
