"""Per-target request builders: each turns a JobSpec into template variables
(`build`) and checks the rendered text against the spec (`verify`)."""

from __future__ import annotations

from types import ModuleType

from . import compose, kubernetes, slurm, ssh

TARGETS: dict[str, ModuleType] = {"compose": compose, "slurm": slurm, "k8s": kubernetes, "ssh": ssh}


def register(name: str, module: ModuleType) -> None:
    TARGETS[name] = module
