"""The render targets and `render(spec, target)`.

Each target is a module of this package that implements `TargetRenderer`:
a `NAME` (the word after `ddpkit render`), `build` (the spec as template
variables, one OutputFile per file) and `verify` (the rendered text read
back and checked against the spec). Layers (docs/ARCHITECTURE.md): the CLI
and the launchers import this package; it imports the render primitives,
the contract and quoting; nothing below imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..render.engine import OutputFile, Rendered, render_files
from ..spec import JobSpec
from . import compose, kubernetes, slurm, ssh


class TargetRenderer(Protocol):
    """What a target module provides (a module satisfies it structurally)."""

    @property
    def NAME(self) -> str:
        """The CLI word: `ddpkit render <name>`."""
        ...

    def build(self, spec: JobSpec) -> list[OutputFile]:
        """The files to render: template, variables, kind (shell / yaml / text)."""
        ...

    def verify(self, spec: JobSpec, rendered: Rendered) -> None:
        """Read the rendered files back; raise RenderError if they disagree with the spec."""
        ...


def _registry(*modules: TargetRenderer) -> dict[str, TargetRenderer]:
    return {m.NAME: m for m in modules}


# In the order `ddpkit render --help` lists them.
TARGETS: dict[str, TargetRenderer] = _registry(slurm, kubernetes, ssh, compose)


def register(target: TargetRenderer) -> None:
    """Add a target (a module or any object with NAME, build and verify)."""
    TARGETS[target.NAME] = target


def render(spec: JobSpec, target: str, *, template_dir: Path | None = None) -> Rendered:
    """{filename: text} for one CLI target (slurm, k8s, ssh, compose), each
    file checked (bash -n / YAML parse) and verified against the spec."""
    if target not in TARGETS:
        raise KeyError(f"unknown target {target!r}; choose one of {', '.join(sorted(TARGETS))}")
    module = TARGETS[target]
    rendered = render_files(module.build(spec), template_dir)
    module.verify(spec, rendered)
    return rendered
