"""The two tiers stay honest (docs/TESTING.md): a test marked `full` says
where `make test` proves its capability, and what it names runs there.

Read from the test files' text, no test is run: every `@pytest.mark.full`
on a test function carries a comment, and each test module or test
function the comment names exists and is not itself marked `full` as a
whole. (A parameter case marked `full` leaves its test in CI, so only
function-level marks are followed.)"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MARK = re.compile(r"^@pytest\.mark\.full\b(?P<rest>.*)$")
NAMED_MODULE = re.compile(r"\b(test_\w+)\.py\b")
NAMED_FUNCTION = re.compile(r"(?<![\w.])(test_\w+)\b(?!\.py)")


@dataclass(frozen=True)
class FullMark:
    """One function-level `full` mark: where it is and what its comment says."""

    module: str
    line: int
    function: str
    comment: str


def _decorated_function(lines: list[str], index: int) -> str:
    """The name of the function the decorator on line `index` belongs to."""
    for line in lines[index + 1:]:
        found = re.match(r"\s*(?:async\s+)?def\s+(\w+)", line)
        if found:
            return found.group(1)
        if not line.lstrip().startswith(("@", ")", "#")) and line.strip() and not line.startswith(" "):
            break
    return ""


def full_marks() -> list[FullMark]:
    marks = []
    for path in sorted(TESTS.glob("test_*.py")):
        lines = path.read_text().splitlines()
        for index, line in enumerate(lines):
            found = MARK.match(line)
            if found:
                comment = found.group("rest").strip().removeprefix("#").strip()
                marks.append(FullMark(path.name, index + 1, _decorated_function(lines, index), comment))
    return marks


def functions_by_module() -> dict[str, set[str]]:
    out = {}
    for path in TESTS.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        out[path.stem] = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    return out


def test_every_full_mark_says_where_make_test_proves_it() -> None:
    marks = full_marks()
    assert marks, "no function marked full was found: the reader is broken"
    silent = [f"{m.module}:{m.line}" for m in marks if not m.comment]
    assert silent == [], f"marked full without saying where make test proves the capability: {silent}"
    assert all(m.function for m in marks), [m for m in marks if not m.function]


def broken_references(marks: list[FullMark], functions: dict[str, set[str]]) -> list[str]:
    """Each module or test function a mark's comment names that does not run in `make test`."""
    whole_full = {(m.module.removesuffix(".py"), m.function) for m in marks}
    broken = []
    for mark in marks:
        for module in NAMED_MODULE.findall(mark.comment):
            tests = {f for f in functions.get(module, set()) if f.startswith("test_")}
            if module not in functions:
                broken.append(f"{mark.module}:{mark.line} names {module}.py, which does not exist")
            elif tests and all((module, f) in whole_full for f in tests):
                broken.append(f"{mark.module}:{mark.line} names {module}.py, whose every test is marked full")
        for name in NAMED_FUNCTION.findall(mark.comment):
            owners = [m for m, names in functions.items() if name in names]
            if not owners:
                broken.append(f"{mark.module}:{mark.line} names {name}, which no test module defines")
            elif all((owner, name) in whole_full for owner in owners):
                broken.append(f"{mark.module}:{mark.line} names {name}, which is itself marked full")
    return broken


def test_what_a_full_mark_names_runs_in_make_test() -> None:
    broken = broken_references(full_marks(), functions_by_module())
    assert broken == [], "\n".join(broken)


def test_a_reference_to_a_full_test_or_a_missing_one_is_caught() -> None:
    """The negative control, on made-up modules: each kind of broken reference is found."""
    functions = {"test_a": {"test_one", "test_two"}, "test_b": {"test_three"}}
    marks = [FullMark("test_a.py", 1, "test_one", "proven by test_two"),
             FullMark("test_a.py", 5, "test_two", "see test_b.py and test_one"),
             FullMark("test_b.py", 1, "test_three", "see test_c.py and test_four")]
    assert broken_references(marks, functions) == [
        "test_a.py:1 names test_two, which is itself marked full",
        "test_a.py:5 names test_b.py, whose every test is marked full",
        "test_a.py:5 names test_one, which is itself marked full",
        "test_b.py:1 names test_c.py, which does not exist",
        "test_b.py:1 names test_four, which no test module defines"]
    assert broken_references(marks[:1], functions) == []  # test_two is not marked full here
