"""Rules that keep the code's shape, checked on the source (nothing is imported):

- the top of src/ddpkit holds only what people run or import by name
  (TOP_LEVEL); every other module lives in the folder of its concern;
- no module under src/ddpkit passes MAX_LINES lines (split it by concern);
- one name, one meaning (docs/ARCHITECTURE.md's glossary): no two classes
  under src/ddpkit share a name (but those in SHARED_CLASS_NAMES, with why),
  every class name in the glossary's table is defined exactly once, and a
  name the glossary's words table retired (a class, or a class's member
  written `Class.NAME`) is not defined again;
- nothing under launch/ or runs/ reads the job's output with a regular
  expression: the job talks to its launcher in records (records.decode,
  records.unframe), never in text a launcher parses. Every regular expression
  there is listed in NOT_JOB_OUTPUT with what it reads, so a new one fails
  until someone says what it matches; the one text scraper of job output that
  is left is named in SCRAPED_JOB_OUTPUT, with why.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ddpkit"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINES = 400


def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in sorted(PACKAGE.rglob("*.py"))}


# `ddpkit` (cli), `python -m ddpkit.run`, `python -m ddpkit.rdzv_store` (rendered manifests run it),
# `from ddpkit import watchdog`, `ddpkit.on_stop` (__init__).
TOP_LEVEL = {"__init__", "cli", "run", "rdzv_store", "watchdog"}


# ---- the tree --------------------------------------------------------------------------------
def test_the_top_of_the_package_holds_only_what_people_run_or_import() -> None:
    loose = sorted({p.stem for p in PACKAGE.glob("*.py")} - TOP_LEVEL)
    assert not loose, f"modules at the top of src/ddpkit (move each into the folder of its concern): {loose}"


# ---- size ------------------------------------------------------------------------------------
def test_no_module_passes_the_line_limit() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each by concern): {long}"


# ---- the glossary ------------------------------------------------------------------------------
def glossary_part(title: str) -> str:
    """One `### title` part of the glossary's section."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Glossary\n", 1)[1].split("\n## ", 1)[0]
    return section.split(f"\n### {title}\n", 1)[1].split("\n### ", 1)[0]


def glossary() -> list[str]:
    """The names in the first column of the glossary's class-name table."""
    return re.findall(r"^\| `(\w+)` \|", glossary_part("Class names"), flags=re.MULTILINE)


def retired() -> dict[str, str]:
    """Each class name a words row's last column retired, written `Name` (what
    follows it in "(now ...)" is its replacement), and the row's word. A
    name retired from one meaning but kept for another is written there
    without backticks."""
    found = {}
    for row in re.findall(r"^\| \*\*.+\|$", glossary_part("Words"), flags=re.MULTILINE):
        cells = [c.strip() for c in row[1:-1].split("|")]  # no cell holds a pipe
        assert len(cells) == 4, f"a words row without its four cells: {row[:80]}"
        found.update({name: cells[0] for name in re.findall(r"`(\w+)`", re.sub(r"\(now [^)]*\)", "", cells[3]))})
    return found


def retired_members() -> dict[tuple[str, str], str]:
    """Each `Class.NAME` a words row's last column retired (an enum's member
    or a class's attribute, most often a word ddpkit prints or stores), and
    the row's word."""
    found = {}
    for row in re.findall(r"^\| \*\*.+\|$", glossary_part("Words"), flags=re.MULTILINE):
        last = row[1:-1].split("|")[3]
        found.update({(cls, name): row.split("|")[1].strip()
                      for cls, name in re.findall(r"`(\w+)\.(\w+)`", re.sub(r"\(now [^)]*\)", "", last))})
    return found


def definitions(names: set[str]) -> dict[str, list[str]]:
    """Where each of `names` is defined under src/ddpkit: as a class, or bound
    at a module's top level (`Event = A | B`): a second meaning may come as
    either. Only modules whose text may define one are parsed (parsing every
    module takes seconds on a busy machine)."""
    found: dict[str, list[str]] = defaultdict(list)
    either = "|".join(sorted(names))
    mentions = re.compile(rf"^\s*class (?:{either})\b|^(?:{either})\s*[:=]", flags=re.MULTILINE)
    for name, path in modules().items():
        text = path.read_text(encoding="utf-8")
        if not mentions.search(text):
            continue
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{name}:{node.lineno}")
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name):
                    found[target.id].append(f"{name}:{node.lineno}")
    return found


def test_the_glossary_is_read() -> None:
    names = glossary()
    assert len(names) >= 20 and {"JobSpec", "NodeLost", "Supervisor"} <= set(names), names
    assert len(names) == len(set(names)), "a name twice in the glossary"


# A class name two modules define, each for the same meaning, and why neither takes a qualifier.
SHARED_CLASS_NAMES = {
    # A program imports the one for its framework (ddpkit.frameworks.hf or .lightning, never both):
    # the public name says what it is in either, as each framework's own callbacks are named.
    "StopCallback": {"frameworks.hf", "frameworks.lightning"},
}
CLASS = re.compile(r"^[ \t]*class (\w+)\b", flags=re.MULTILINE)


def class_names() -> dict[str, list[str]]:
    """Every class statement under src/ddpkit, by name (read as text: parsing
    every module takes seconds on a busy machine, and a `class` line is a
    class statement in this code; a docstring that begins a line with one
    shows up as a class of that name, to be reworded)."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, path in modules().items():
        for match in CLASS.finditer(path.read_text(encoding="utf-8")):
            found[match.group(1)].append(name)
    return found


def test_no_two_classes_share_a_name() -> None:
    found = class_names()
    assert len(found) > 200 and "Supervisor" in found, len(found)
    shared = {name: where for name, where in found.items()
              if len(where) > 1 and set(where) != SHARED_CLASS_NAMES.get(name)}
    assert not shared, ("classes that share a name (one name, one meaning: give each a qualifier that says which, "
                        f"docs/ARCHITECTURE.md#glossary): {shared}")
    gone = {name for name in SHARED_CLASS_NAMES if set(found.get(name, [])) != SHARED_CLASS_NAMES[name]}
    assert not gone, f"listed in SHARED_CLASS_NAMES but no longer shared as listed: {gone}"


def test_retired_names_stay_retired() -> None:
    names = retired()
    assert {"Plan", "Heartbeat", "RunStatus"} <= set(names), names
    back = {name: (word, class_names()[name]) for name, word in names.items() if name in class_names()}
    assert not back, f"a class name the glossary retired is defined again (its word, where): {back}"


def test_retired_members_stay_retired() -> None:
    members = retired_members()
    assert ("RunState", "LOST") in members, members
    back = []
    for (cls, name), word in members.items():
        for module in class_names().get(cls, []):
            tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ClassDef) and node.name == cls):
                    continue
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                        [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                    if any(isinstance(x, ast.Name) and x.id == name for x in targets):
                        back.append(f"{cls}.{name} ({word}): {module}:{stmt.lineno}")
    assert not back, f"a member the glossary retired is defined again (docs/ARCHITECTURE.md#glossary): {back}"


def test_each_glossary_name_is_defined_exactly_once() -> None:
    names = glossary()
    found = definitions(set(names))
    wrong = {name: found.get(name, []) for name in names if len(found.get(name, [])) != 1}
    assert not wrong, f"glossary names defined other than once (docs/ARCHITECTURE.md#glossary): {wrong}"


# ---- no regular expression over the job's output in launch/ and runs/ -----------------------------
# (module, function): what its regular expression reads, none of it the job's output.
NOT_JOB_OUTPUT = {
    ("launch.ssh.hostfile", "parse_host"): "a hostfile's host token (the user's file)",
    ("launch.ssh.hostfile", "parse_line"): "a hostfile line's slots= option (the user's file)",
    ("launch.ssh.running_node", "safe_name"): "a node's label, made a file name",
    ("launch.slurm.checks", "slurm_seconds"): "Slurm's time syntax (slurm.time, a partition's MaxTime)",
    ("launch.slurm.checks", "megabytes"): "Slurm's memory syntax (RealMemory, slurm.mem)",
    ("launch.slurm.checks", "gpu_count"): "a node's Gres in `scontrol show node`",
}
# (module, function, scraper): a line of the job's output matched as text outside records.
SCRAPED_JOB_OUTPUT = {
    # The node's shell prints `DDPKIT_PGID=<pid>` (templates/ssh/node.sh.j2) before anything
    # of ddpkit runs on the host, so no record writer is there yet; the launcher takes the
    # node's process group from that first line (targets/sshnode.parse_pgid, a prefix
    # match). `ddpkit render ssh`'s launch.sh reads the same line with bash's =~, and
    # the tests' stand-in nodes print it: a record instead changes node.sh, launch.sh
    # and those tests together, which is more than this rule's change.
    ("launch.ssh.running_node", "SshNode._line", "parse_pgid"),
}
SCRAPERS = {"parse_pgid"}  # text scrapers of job output defined outside launch/ and runs/
REGEX_CALLS = {"match", "fullmatch", "search", "findall", "finditer", "sub", "subn", "split"}


def regex_uses(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(enclosing function, line, call) for every use of a regular expression:
    re's functions under any alias, and the methods of a pattern a module
    compiled (`_HOST = re.compile(...)`, `_HOST.match(token)`); also a call of
    a SCRAPERS function."""
    re_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names if a.name == "re"}
    from_re = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "re"
               for a in n.names}
    patterns = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_compile(node.value, re_names,
                                                                                               from_re):
            patterns |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, f"{where}.{child.name}".lstrip("."))
                continue
            if isinstance(child, ast.Call):
                func = child.func
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    owner, attr = func.value.id, func.attr
                    if (owner in re_names and attr in REGEX_CALLS | {"compile"}) or \
                            (owner in patterns and attr in REGEX_CALLS):
                        found.append((where, child.lineno, f"{owner}.{attr}"))
                elif isinstance(func, ast.Name) and (func.id in from_re or func.id in SCRAPERS):
                    found.append((where, child.lineno, func.id))
            visit(child, where)

    visit(tree, "")
    return found


def _is_compile(call: ast.Call, re_names: set[str], from_re: set[str]) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in re_names
            and func.attr == "compile") or (isinstance(func, ast.Name) and func.id == "compile" and "compile" in from_re)


def launch_and_runs() -> dict[str, ast.Module]:
    """The modules of launch/ and runs/ that import re or call a scraper (the
    others cannot use either, and parsing every module takes seconds)."""
    may = re.compile(r"^\s*(?:import|from) [^\n]*\bre\b|\b(?:" + "|".join(sorted(SCRAPERS)) + r")\b",
                     flags=re.MULTILINE)
    texts = {name: path.read_text(encoding="utf-8") for name, path in modules().items()
             if name.split(".")[0] in ("launch", "runs")}
    return {name: ast.parse(text) for name, text in texts.items() if may.search(text)}


def test_launch_and_runs_match_no_regular_expression_over_the_jobs_output() -> None:
    listed = set(NOT_JOB_OUTPUT) | {(m, f) for m, f, _ in SCRAPED_JOB_OUTPUT}
    unlisted, seen = [], set()
    for module, tree in launch_and_runs().items():
        for where, line, call in regex_uses(tree):
            if not where:
                continue  # a pattern compiled at the top: judged where it is applied
            named = (module, where, call) in SCRAPED_JOB_OUTPUT if call in SCRAPERS else (module, where) in NOT_JOB_OUTPUT
            if not named:
                unlisted.append(f"{module}:{line} {where}: {call}")
            seen.add((module, where))
    assert not unlisted, ("a regular expression in launch/ or runs/: the job's output is read as records "
                          "(records.decode, records.unframe), never parsed; if it reads no job output, add it to "
                          "NOT_JOB_OUTPUT with what it reads:\n" + "\n".join(unlisted))
    assert listed <= seen, f"listed but gone (remove from the lists): {sorted(listed - seen)}"


def test_the_regex_finder_sees_every_form() -> None:
    # The rule proves nothing if the finder misses a form: an alias, a compiled pattern, a bare import.
    source = '''
import re as regex
from re import search
_LINE = regex.compile(r"x")

def a(line):
    return regex.match(r"x", line)

def b(line):
    return _LINE.findall(line)

class Node:
    def c(self, line):
        return search(r"x", line), parse_pgid(line)
'''
    found = {(where, call) for where, _, call in regex_uses(ast.parse(source))}
    assert found == {("", "regex.compile"), ("a", "regex.match"), ("b", "_LINE.findall"), ("Node.c", "search"),
                     ("Node.c", "parse_pgid")}
