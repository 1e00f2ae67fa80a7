"""What README.md and the pages under docs/ (docs/guides/ included) show a
reader to copy works as shown:

- every YAML block parses, and every one that is a job spec (or a fragment
  of one: its keys are spec fields) validates and renders for the targets it
  configures, all four when it names none;
- every `ddpkit ...` line of a shell block (after an optional `$ ` prompt,
  lines ending in `\\` joined) parses with the CLI's own parser, built as
  `ddpkit` builds it; nothing is run, and placeholders (RUN, FILE, <name>)
  are ordinary values to it;
- every `make ...` shown, in a shell block or as inline code, names targets
  the Makefile has.

A failure names the file and line of what it shows."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ddpkit.cli import build_parser
from ddpkit.docs_reference.examples import is_job_spec
from ddpkit.spec.yamlfile import SpecError, build_spec
from ddpkit.targets import render

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<mark>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "shell-session", "zsh"}
INLINE_MAKE = re.compile(r"`(make [^`\n]+)`")
# A Makefile rule's first line: names, a colon that is not `:=` or `::`; not a recipe, comment or `$(VAR)` rule.
RULE = re.compile(r"^(?P<names>[A-Za-z0-9_.][^:=#$]*?)[ \t]*:(?![=:])")
# Where a shell line stops being the command's arguments: a pipe, a list, a redirection.
OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>>", "&>", "2>&1", ">&2"}
# What a fragment leaves out, for it to be a whole job.
BASE = {"name": "doc-example", "image": "ddpkit:cpu"}
TARGET_SECTIONS = {"slurm": "slurm", "k8s": "k8s", "ssh": "ssh", "compose": "compose"}


@dataclass(frozen=True)
class Block:
    """One fenced code block: where its opening fence is, its language, and
    its lines (dedented by the fence's indent) with their line numbers."""

    path: str
    line: int
    language: str
    lines: tuple[tuple[int, str], ...]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def text(self) -> str:
        return "".join(text + "\n" for _, text in self.lines)


@dataclass(frozen=True)
class Shown:
    """A command a document shows: where it starts and its words as the shell splits them."""

    where: str
    words: tuple[str, ...]


def blocks_and_prose(path: str, text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a Markdown text, and its other lines (numbered from 1)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    opening: re.Match[str] | None = None
    start = 0
    body: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if opening is None:
            if fence:
                opening, start, body = fence, number, []
            else:
                prose.append((number, line))
        elif fence and not fence["lang"] and fence["mark"][0] == opening["mark"][0] \
                and len(fence["mark"]) >= len(opening["mark"]) and line.strip() == fence["mark"]:
            blocks.append(Block(path, start, opening["lang"].lower(), tuple(body)))
            opening = None
        else:
            indent = len(opening["indent"])
            body.append((number, line[indent:] if line[:indent].strip() == "" else line.lstrip()))
    return blocks, prose


@dataclass(frozen=True)
class Document:
    path: str
    blocks: tuple[Block, ...]
    prose: tuple[tuple[int, str], ...]


@functools.cache
def documents() -> tuple[Document, ...]:
    found = []
    for path in DOCUMENTS:
        name = str(path.relative_to(ROOT))
        blocks, prose = blocks_and_prose(name, path.read_text(encoding="utf-8"))
        found.append(Document(name, tuple(blocks), tuple(prose)))
    return tuple(found)


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """(line number, command) for each command of a shell block: a `$ ` prompt
    dropped, a line ending in `\\` joined with the next."""
    commands: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in block.lines:
        if pending is None:
            stripped = line.strip()
            pending = (number, stripped[2:] if stripped.startswith("$ ") else stripped)
        else:
            pending = (pending[0], pending[1] + " " + line.strip())
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        commands.append(pending)
        pending = None
    if pending is not None:
        commands.append(pending)
    return commands


def _is_operator(word: str) -> bool:
    if word in OPERATORS or word.startswith((">", "2>", "1>", "&>", "|")):
        return True
    return word.startswith("<") and not word.endswith(">")  # `<name>` is a placeholder, `<file` a redirection


def command_words(command: str) -> tuple[str, ...]:
    """The words of the first command on a shell line, its comment dropped;
    empty when the line is not one the shell could split."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return ()
    for index, word in enumerate(words):
        if _is_operator(word):
            return tuple(words[:index])
    return tuple(words)


def shown_commands(program: str) -> list[Shown]:
    """Every command of the shell blocks that starts with `program`."""
    found = []
    for document in documents():
        for block in document.blocks:
            if block.language not in SHELL_LANGUAGES:
                continue
            for number, command in shell_lines(block):
                words = command_words(command)
                if words[:1] == (program,):
                    found.append(Shown(f"{document.path}:{number}", words))
    return found


def inline_make_commands() -> list[Shown]:
    """Every `make ...` inline code span outside the fenced blocks."""
    found = []
    for document in documents():
        for number, line in document.prose:
            for match in INLINE_MAKE.finditer(line):
                found.append(Shown(f"{document.path}:{number}", command_words(match.group(1))))
    return found


def yaml_blocks() -> list[Block]:
    return [b for d in documents() for b in d.blocks if b.language in ("yaml", "yml")]


@functools.cache
def parser() -> argparse.ArgumentParser:
    return build_parser()


@functools.cache
def make_targets(makefile: Path = ROOT / "Makefile") -> frozenset[str]:
    """The names the Makefile's rules define, `.PHONY` and the like excepted."""
    names: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        rule = RULE.match(line)
        if rule:
            names.update(n for n in rule["names"].split() if not n.startswith("."))
    return frozenset(names)


def check_yaml_block(where: str, text: str) -> None:
    """The block parses; a job spec (or fragment) validates and renders."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AssertionError(f"{where}: the YAML block does not parse: {exc}") from None
    if not is_job_spec(data):
        return  # another file's YAML (a manifest, a compose file): parsing is what a reader relies on
    try:
        spec = build_spec({**BASE, **data})
    except SpecError as exc:
        raise AssertionError(f"{where}: the job spec is refused:\n" + "\n".join(exc.problems)) from None
    targets = [target for section, target in TARGET_SECTIONS.items() if section in data] or list(TARGET_SECTIONS.values())
    for target in targets:
        rendered = render(spec, target)
        assert rendered.files, f"{where}: rendering for {target} wrote nothing"


def check_ddpkit_command(shown: Shown) -> None:
    """The words after `ddpkit` parse as `ddpkit` parses them (main's
    parse_known_args: an unknown option is an error there too)."""
    argv = list(shown.words[1:])
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            _, extras = parser().parse_known_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):  # --help, --version
            return
        error = said.getvalue().strip().splitlines()[-1:]  # argparse's own line, after the usage
        raise AssertionError(f"{shown.where}: `{shlex.join(shown.words)}` does not parse: {' '.join(error)}") from None
    assert not extras, f"{shown.where}: `{shlex.join(shown.words)}`: ddpkit does not know {extras}"


def check_make_command(shown: Shown) -> None:
    """Every target the `make` command names is a rule of the Makefile."""
    named = [w for w in shown.words[1:] if not w.startswith("-") and "=" not in w]
    missing = [name for name in named if name not in make_targets()]
    assert not missing, f"{shown.where}: `{shlex.join(shown.words)}`: the Makefile has no target {missing}"


BLOCKS = yaml_blocks()
DDPKIT_COMMANDS = shown_commands("ddpkit")
MAKE_COMMANDS = shown_commands("make") + inline_make_commands()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_yaml_block_parses_and_every_job_spec_renders(block: Block) -> None:
    check_yaml_block(block.where, block.text)


@pytest.mark.parametrize("shown", DDPKIT_COMMANDS, ids=[s.where for s in DDPKIT_COMMANDS])
def test_every_ddpkit_command_shown_parses(shown: Shown) -> None:
    check_ddpkit_command(shown)


@pytest.mark.parametrize("shown", MAKE_COMMANDS, ids=[s.where for s in MAKE_COMMANDS])
def test_every_make_command_shown_names_a_makefile_target(shown: Shown) -> None:
    check_make_command(shown)


def test_the_blocks_and_commands_are_found_in_readme_and_every_docs_folder() -> None:
    """Guards the tests above against finding nothing (a changed fence, a folder not walked)."""
    readme = [b for b in BLOCKS if b.path == "README.md"]
    assert readme and is_job_spec(yaml.safe_load(readme[0].text)), "README.md's spec reference is not found as a job spec"
    assert sum(is_job_spec(yaml.safe_load(b.text)) for b in BLOCKS) >= 5
    assert any(s.where.startswith("README.md:") for s in DDPKIT_COMMANDS)
    assert any(s.where.startswith("docs/guides/") for s in DDPKIT_COMMANDS), "docs/guides/ is not walked"
    assert any(s.where.startswith("README.md:") for s in MAKE_COMMANDS)
    assert {"docs", "test"} <= make_targets(), sorted(make_targets())


def _blocks_of(markdown: str) -> list[Block]:
    return blocks_and_prose("example.md", markdown)[0]


def test_a_spec_the_schema_refuses_fails_naming_its_file_and_line() -> None:
    [block] = _blocks_of("Intro.\n\n```yaml\nnodes: 0\nwatchdog:\n  loss_s: -1\n```\n")
    assert is_job_spec(yaml.safe_load(block.text))
    with pytest.raises(AssertionError, match=r"example\.md:3: the job spec is refused"):
        check_yaml_block(block.where, block.text)


def test_a_command_the_cli_refuses_fails_naming_its_file_and_line() -> None:
    [block] = _blocks_of("Text\n\n  ```bash\n  $ ddpkit render slurm -f job.yaml \\\n      --no-such-flag 3\n  ```\n")
    [command] = [Shown(f"example.md:{n}", command_words(c)) for n, c in shell_lines(block)]
    assert command == Shown("example.md:4", ("ddpkit", "render", "slurm", "-f", "job.yaml", "--no-such-flag", "3"))
    with pytest.raises(AssertionError, match=r"example\.md:4: .*does not know \['--no-such-flag', '3'\]"):
        check_ddpkit_command(command)
    with pytest.raises(AssertionError, match=r"example\.md:9: .*does not parse: .*invalid choice: 'nowhere'"):
        check_ddpkit_command(Shown("example.md:9", ("ddpkit", "render", "nowhere")))


def test_placeholders_comments_and_pipes_are_not_arguments() -> None:
    assert command_words("ddpkit logs <name> --tail 5 | less  # follow it") == ("ddpkit", "logs", "<name>", "--tail", "5")
    assert command_words("ddpkit render slurm -f job.yaml > out.sbatch") == ("ddpkit", "render", "slurm", "-f", "job.yaml")
    check_ddpkit_command(Shown("example.md:1", ("ddpkit", "status", "RUN")))


def test_a_make_target_the_makefile_lacks_fails_naming_its_file_and_line() -> None:
    check_make_command(Shown("example.md:1", ("make", "image", "IMAGE=registry.example.com/team/ddpkit:0.1.0")))
    with pytest.raises(AssertionError, match=r"example\.md:2: .*no target \['no-such-target'\]"):
        check_make_command(Shown("example.md:2", ("make", "demo", "no-such-target")))
