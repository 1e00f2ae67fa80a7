"""The render side imports downward only (docs/ARCHITECTURE.md):

    cli -> launch -> targets -> render -> (quoting, contract) -> specfile -> spec -> envnames, exitcodes

Every import of these modules, function-level ones included, is read from
the source and checked against its layer; nothing here imports a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# module -> layer; a module may import only modules of a lower layer, or of
# its own package at the same layer (targets.ssh imports targets.sshnode).
LAYERS: dict[str, int] = {
    "ddpkit.envnames": 0,
    "ddpkit.exitcodes": 0,
    "ddpkit.spec": 1,
    "ddpkit.specfile": 2,
    "ddpkit.quoting": 3,
    "ddpkit.contract": 3,
    "ddpkit.render": 4,
    "ddpkit.targets": 5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer of a module or of the package holding it (targets.slurm -> targets)."""
    while module:
        if module in LAYERS:
            return LAYERS[module]
        module = module.rpartition(".")[0]
    return None


def render_side() -> dict[str, Path]:
    files = {module_name(p): p for p in (SRC / "ddpkit").glob("*.py")}
    files |= {module_name(p): p for p in (SRC / "ddpkit" / "targets").glob("*.py")}
    return {m: p for m, p in files.items() if layer_of(m) is not None}


def imports_of(module: str, path: Path) -> set[str]:
    """Every ddpkit module `module` imports, resolved to absolute names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            stem = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
            assert stem is not None
            # `from . import quoting` names a module; `from .spec import JobSpec` a name in one.
            out |= {f"{stem}.{a.name}" if f"{stem}.{a.name}" in ALL else stem for a in node.names}
    return {m for m in out if m == "ddpkit" or m.startswith("ddpkit.")}


ALL = {module_name(p) for p in (SRC / "ddpkit").rglob("*.py")}
MODULES = render_side()


def test_the_layer_map_covers_the_render_side() -> None:
    assert {"ddpkit.render", "ddpkit.contract", "ddpkit.quoting", "ddpkit.targets", "ddpkit.targets.sshnode",
            "ddpkit.targets.slurm", "ddpkit.targets.kubernetes"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_goes_up_a_layer(module: str) -> None:
    mine = layer_of(module)
    assert mine is not None
    package = module.split(".")[:2]
    for imported in sorted(imports_of(module, MODULES[module])):
        theirs = layer_of(imported)
        same_package = imported.split(".")[:2] == package
        assert theirs is not None and (theirs < mine or (theirs == mine and same_package)), (
            f"{module} (layer {mine}) imports {imported} (layer {theirs})")


def test_contract_and_quoting_know_nothing_of_rendering() -> None:
    for low in ("ddpkit.contract", "ddpkit.quoting"):
        assert not {m for m in imports_of(low, MODULES[low]) if layer_of(m) not in (0, 1, 2)}, low


def test_no_cycles_inside_the_targets_package() -> None:
    graph = {m: {i for i in imports_of(m, MODULES[m]) if i in MODULES and i != m}
             for m in MODULES if m.startswith("ddpkit.targets.")}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    assert not [m for m in graph if reaches(m, m, set())]


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """A lazy `from .targets import TARGETS` inside a function (what render.py
    had) is found."""
    fake = tmp_path / "render.py"
    fake.write_text("def f():\n    from .targets import TARGETS\n    return TARGETS\n")
    assert "ddpkit.targets" in imports_of("ddpkit.render", fake)
