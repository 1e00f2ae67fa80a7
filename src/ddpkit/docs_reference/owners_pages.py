"""reference/exit-codes.md and reference/environment.md, from their one
owners (ddpkit.shared.exitcodes, ddpkit.shared.envnames). What each value means is the
comment its owner writes beside it (or in the lines just above it), read
from the source: the owner stays the only place that says it."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..render.templatedir import default_template_dir
from ..shared import envnames, exitcodes
from ..shared.exitcodes import WORKER_CODES, ExitCode
from .markdown import cell, code, generated_note, table

PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Commented:
    """A name assigned in a module, the comment that says what it is, and the
    comment block that opens its group (after a blank line), if any."""

    name: str
    line: int
    note: str
    group: str


def _comments(source: str) -> dict[int, str]:
    """{line: its comment's text} for every comment in `source`."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def commented_names(path: Path, body: list[ast.stmt] | None = None) -> list[Commented]:
    """Every `NAME = ...` (or `NAME: T = ...`) in `body` (default: the module's
    top level). A name's note is its trailing comment, else the comment lines
    right above it; a comment block after a blank line opens a group (its
    first sentence; the rest of the block is the first name's note)."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    comments = _comments(source)
    statements = body if body is not None else ast.parse(source).body
    found: list[Commented] = []
    group = ""
    for stmt in statements:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
        else:
            continue
        above: list[str] = []
        number = stmt.lineno - 1
        while number >= 1 and lines[number - 1].lstrip().startswith("#"):
            above.insert(0, comments[number])
            number -= 1
        opens_group = above and (number == 0 or not lines[number - 1].strip())
        if opens_group:
            group, above = _split_group(above)
        trailing = comments.get(stmt.end_lineno or stmt.lineno, "")
        if (stmt.end_lineno or stmt.lineno) and not lines[(stmt.end_lineno or stmt.lineno) - 1].split("#")[0].strip():
            trailing = ""
        found.append(Commented(name, stmt.lineno, trailing or " ".join(above), group))
    return found


def _split_group(block: list[str]) -> tuple[str, list[str]]:
    """A comment block that opens a group: its first sentence (the lines up to
    one that ends in a full stop) names the group; the lines after it are the
    note of the name right below."""
    for index, line in enumerate(block):
        if line.endswith("."):
            return " ".join(block[: index + 1]), block[index + 1:]
    return " ".join(block), []


def exit_codes_page() -> str:
    path = Path(exitcodes.__file__)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ExitCode.__name__)
    notes = {c.name: c.note for c in commented_names(path, body)}
    rows = [(str(int(code_)), code(code_.name), cell(notes.get(code_.name, "")),
             "yes" if code_ in WORKER_CODES else "")
            for code_ in ExitCode]
    return "\n".join([
        "# Exit codes", "", generated_note("ddpkit.shared.exitcodes.ExitCode"), "",
        "Every code a `ddpkit` command ends with. The numbers follow sysexits(3) and the shell's 128+signal "
        "convention where one fits, so that a scheduler or a script can tell a fault of the input from a "
        "fault of the job.", "",
        "**Passed on** marks the codes a `ddpkit train` worker ends with that a launcher passes on as its own "
        "(`WORKER_CODES`); any other code of a worker's becomes 1.", "",
        table(("Code", "Name", "Meaning", "Passed on"), rows)])


def _uses(name: str) -> list[str]:
    """The modules of ddpkit that name `envnames.<name>` (or import it from envnames)."""
    return USES.get(name, [])


def _find_uses() -> dict[str, list[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        if module in ("envnames", "docs_reference") or module.startswith("docs_reference."):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envnames":
                found[node.attr].add(module)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("envnames"):
                for alias in node.names:
                    found[alias.name].add(module)
    # the shipped templates write variables by their literal names
    for template in sorted(default_template_dir().rglob("*")):
        if template.is_file():
            text = template.read_text(encoding="utf-8", errors="replace")
            for name in vars(envnames):
                if name.isupper() and re.search(rf"\b{name}\b", text):
                    found[name].add(f"templates/{template.relative_to(default_template_dir())}")
    return {name: sorted(modules) for name, modules in found.items()}


USES = _find_uses()


def environment_page() -> str:
    path = Path(envnames.__file__)
    names = [c for c in commented_names(path) if isinstance(getattr(envnames, c.name), str)]
    lines = ["# Environment variables", "", generated_note("ddpkit.shared.envnames"), "",
             "Every environment variable ddpkit sets or reads, grouped as its one owner groups them; "
             "**Used in** lists the modules of `ddpkit` and the shipped "
             "templates that name it (the renderers, templates and launchers set; the trainer and its preamble read).", ""]
    for group, members in _grouped(names):
        lines += [f"## {cell(group)}" if group else "## Other", ""]
        rows = [(code(getattr(envnames, c.name)), cell(c.note), ", ".join(code(m) for m in _uses(c.name)))
                for c in members]
        lines.append(table(("Variable", "What it is", "Used in"), rows))
    return "\n".join(lines)


def _grouped(names: list[Commented]) -> list[tuple[str, list[Commented]]]:
    groups: dict[str, list[Commented]] = {}
    for c in names:
        groups.setdefault(c.group, []).append(c)
    return list(groups.items())
