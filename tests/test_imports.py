"""The import direction of docs/ARCHITECTURE.md, checked on the source.

Every module of src/ddpkit is parsed (nothing is imported), each `import` and
`from ... import` inside the package becomes an edge, and the test fails on an
import into a layer the importer may not use, or on any cycle. Imports inside
functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"

# What each part of the package may import besides itself, lowest layers last.
# cli -> launch -> targets -> render primitives / contract -> spec; train and
# doctor are the entrypoint's side and never reach into rendering or launching.
# The packages that group leaves by concern (GROUPS, below: shared, host, render,
# rendezvous) give each of their modules a row of its own.
# shared.agreed: the facts renderer and trainer share (trainer flags, stop signals,
# ports, the device rule); a leaf like shared.envnames, so either side may use it.
# host.processes: facts about this host's processes (psutil), for the launcher and the trainer alike;
# render.templatedir: where the shipped templates are, for the renderer and the report page;
# rendezvous.listening: a listening socket on one address for a TCPStore (the trainer's store, the launcher's).
# records: every record the job sends back (watchdog reports, worker exits, metrics),
# its one writer and reader; a leaf, so the job, its agent, launchers and report share it.
# host.workdir: the folder every process starts in (command.workdir), for the agent and the runner.
# host.scontrol: what Slurm's scontrol prints, read by the launcher's Slurm checks and queue and by the agent.
LEAVES = {"shared.envnames", "shared.exitcodes", "shared.wording", "host.processes", "render.templatedir", "records",
          "rendezvous.listening", "host.workdir", "host.scontrol"}
# rendezvous.runkey: the run key's namespaces in the store, which launchers, the trainer
# and the rendezvous handler must derive alike; a leaf over shared.envnames.
BASE = LEAVES | {"shared.agreed", "rendezvous.runkey"}
ALLOWED: dict[str, set[str]] = {
    "cli": {"launch", "targets", "render.engine", "contract", "render.quoting", "spec.yamlfile", "spec", "train", "doctor",
            "host.netif", "runs"} | BASE,
    # launch -> train: only train.argcheck, the trainer's own parser checking a job's
    # command line before anything starts (no torch).
    "launch": {"targets", "render.engine", "contract", "render.quoting", "spec.yamlfile", "spec", "train", "runs",
               "rdzv_store"} | BASE,
    # runs: the run folders' layout and records; below launch, it starts and signals nothing.
    "runs": BASE,
    # report: a run's page (`ddpkit report`); it reads run folders and draws, and starts nothing;
    # a run whose records live elsewhere (a compose file's containers) has its backend bring them.
    "report": {"runs", "launch"} | BASE,
    "targets": {"render.engine", "contract", "render.quoting", "spec.yamlfile", "spec"} | BASE,
    "render.engine": {"contract", "render.quoting", "spec"} | BASE,
    "contract": {"render.quoting", "spec", "rendezvous.timing"} | BASE,
    # an elastic job's rendezvous store outside the nodes: hosted by a launcher, or run as a service of its own
    "rdzv_store": {"rendezvous.members"} | BASE,  # its watch reads ddpkit's membership
    "rendezvous.members": set(),  # ddpkit's rendezvous membership in the store: a key per node
    "rendezvous.timing": set(),  # the rendezvous timeouts derived from watchdog.loss_s: arithmetic only
    # `python -m ddpkit.agent`: torchrun with a zygote; preloads train by name; each forked worker gets the preamble;
    # it registers ddpkit's rendezvous handler with torch (no entry point needed on the node)
    "agent": {"preamble", "rendezvous.handler"} | BASE,
    # what a program of the user's own gets before its first line: the trainer's interface, rank report and watchdog
    "preamble": {"train", "watchdog", "host.netif"} | BASE,
    "run": {"preamble", "agent", "train"} | BASE,  # `python -m ddpkit.run`: the preamble, then the program
    # torchrun's handler (the torchrun.handlers entry point): torch, its timing and membership, agreed
    "rendezvous.handler": {"rendezvous.timing", "rendezvous.members"} | BASE,
    "spec.yamlfile": {"spec"} | BASE,
    "spec": BASE,
    "render.quoting": set(),
    "doctor": {"train", "host.netif"} | BASE,
    # agreed, never the contract: `ddpkit train` starts without the spec. Its `__main__` as an srun
    # task (no agent) says an uncaught error and leaves the node's failure file as the agent would.
    "train": {"host.netif", "agent"} | BASE,
    "watchdog": {"train"} | BASE,  # the public API for users' own scripts: train.stall_model and train.stall
    "host.netif": BASE,
    "shared.agreed": LEAVES,
    "rendezvous.runkey": LEAVES,
    "shared.envnames": set(),
    "shared.exitcodes": set(),
    "shared.wording": set(),
    "records": set(),
    "host.processes": set(),
    "render.templatedir": set(),
    "rendezvous.listening": set(),
    "host.scontrol": set(),
    "host.workdir": {"shared.envnames", "shared.exitcodes"},
    # the groups' own __init__: a docstring that says what the folder holds
    "shared": set(), "host": set(), "render": set(), "rendezvous": set(),
    # `ddpkit.on_stop`, the one line a program of the user's own adds to be stopped with a checkpoint
    "__init__": {"preamble"},
    # callbacks a program adds to a Hugging Face or Lightning Trainer: the preamble's stop part
    "frameworks": {"preamble"} | BASE,
    # the documentation site's generated reference pages: they read the CLI, the spec, the targets and the owners
    "docs_reference": {"cli", "targets", "render.engine", "spec", "spec.yamlfile", "render.templatedir"} | BASE,
}


# Inside train and launch, each sub-package (or top-level module) may import only the
# sub-packages named here besides itself; a part not in the table (train's main,
# __main__, argcheck; launch's __init__) is the package's front and may import any.
INSIDE: dict[str, dict[str, set[str]]] = {
    "train": {
        "loop": {"checkpoint", "watchdog", "stop", "model", "data", "outputs", "startup", "config"},
        "checkpoint": {"watchdog", "stop", "model", "outputs", "startup", "config"},
        "watchdog": {"startup"},
        "stop": set(),
        "model": {"config"},
        "data": set(),
        "startup": {"outputs", "config"},
        "outputs": set(),
        "config": set(),
    },
    "launch": {
        "local": {"supervise", "runargs", "secrets", "prelude", "forkedagents", "detach"},
        "docker": {"supervise", "runargs", "secrets", "prelude"},
        "ssh": {"supervise", "runargs", "secrets", "prelude"},
        # `submit slurm` hands its script to control's Slurm backend, which reads the queue through slurm/jobs.py
        "slurm": {"secrets", "prelude", "control"},
        "control": {"slurm", "supervise"},
        "supervise": set(),
        "prelude": {"secrets"},  # the checks and pieces every launcher starts with
        "runargs": set(),
        "secrets": set(),
        "forkedagents": set(),  # launch local's end of the agents' fork server (agent/forkserver.py)
        "detach": set(),  # --detach: a launcher's supervision in a session of its own, reached by the run folder
    },
}

@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts) or "__init__"] = path
    return names


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The dotted name (inside the package) that a `from` import names."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if module == "__init__":
        package = []
    if node.level == 0:
        name = node.module or ""
        return name.removeprefix("ddpkit").lstrip(".") if name.startswith("ddpkit") else ""
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def edges() -> list[Edge]:
    modules = module_names()
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if node.level == 0 and not (node.module or "").startswith("ddpkit"):
                    continue
                # `from . import local` depends on the submodule, not on the package's __init__.
                subs = [f"{target}.{a.name}".lstrip(".") for a in node.names]
                named = [s for s in subs if s in modules]
                for t in named or [target or "__init__"]:
                    if t in modules and t != module:
                        found.append(Edge(module, t, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ddpkit."):
                        t = alias.name.removeprefix("ddpkit.")
                        if t in modules and t != module:
                            found.append(Edge(module, t, node.lineno))
    return found


# Packages that group leaves by concern: each of their modules is a part of its own in ALLOWED.
GROUPS = {"shared", "host", "render", "rendezvous"}


def top(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in GROUPS and len(parts) > 1 else parts[0]


def test_every_top_level_part_has_a_layer() -> None:
    parts = {top(m) for m in module_names()}
    assert parts <= set(ALLOWED), f"add {sorted(parts - set(ALLOWED))} to ALLOWED and docs/ARCHITECTURE.md"


def test_no_import_reaches_a_layer_it_may_not_use() -> None:
    wrong = [f"{e.source}:{e.line} imports {e.target}" for e in edges()
             if top(e.source) != top(e.target) and top(e.target) not in ALLOWED[top(e.source)]]
    assert not wrong, "imports against docs/ARCHITECTURE.md's direction:\n" + "\n".join(wrong)


def inner(module: str) -> tuple[str, str] | None:
    """(package, part) for a module inside train or launch: its sub-package or top-level module."""
    parts = module.split(".")
    if parts[0] in INSIDE and len(parts) > 1:
        return parts[0], parts[1]
    return None


def test_every_sub_package_is_in_the_table() -> None:
    fronts = {"main", "__main__", "argcheck"}
    parts = {part for m in module_names() if (part := inner(m))}
    missing = sorted(f"{p}.{s}" for p, s in parts if s not in INSIDE[p] and s not in fronts)
    assert not missing, f"add {missing} to INSIDE and docs/ARCHITECTURE.md"


def test_no_import_inside_train_or_launch_goes_up() -> None:
    wrong = []
    for e in edges():
        source, target = inner(e.source), inner(e.target)
        if source is None or target is None or source[0] != target[0] or source[1] == target[1]:
            continue
        allowed = INSIDE[source[0]].get(source[1])
        if allowed is not None and target[1] not in allowed:
            wrong.append(f"{e.source}:{e.line} imports {e.target}")
    assert not wrong, "imports against the sub-packages' order:\n" + "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in module_names()}
    for e in edges():
        graph[e.source].add(e.target)
    assert cycles(graph) == []


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_cycle_finder_finds_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_edges_see_relative_and_lazy_imports() -> None:
    # The finder must see the imports the rules are about, or the two tests above prove nothing.
    found = {(e.source, e.target) for e in edges()}
    assert ("cli", "spec.yamlfile") in found
    assert any(source.startswith("launch.") and target == "spec.yamlfile" for source, target in found)


def test_launch_reaches_train_only_for_the_argument_check() -> None:
    # launch -> train is allowed for one module: the trainer's parser checking a
    # job's command line before anything starts (docs/ARCHITECTURE.md).
    into_train = {(e.source, e.target) for e in edges() if top(e.source) == "launch" and top(e.target) == "train"}
    assert into_train and {t for _, t in into_train} == {"train.argcheck"}, into_train


@pytest.mark.parametrize("module", ["ddpkit.train.main", "ddpkit.train.__main__"])
def test_the_trainer_starts_without_the_spec(module: str) -> None:
    # The trainer (`python -m ddpkit.train`, what every launch line runs) reads
    # only agreed (flags, signals, ports, device rule): importing it must not
    # pull in the job spec or the contract, nor pydantic through them.
    probe = (f"import sys, {module}; "
             "print(sorted(m for m in ('pydantic', 'ddpkit.spec', 'ddpkit.contract') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports {done.stdout.strip()}"
