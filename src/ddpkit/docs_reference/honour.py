"""Which render targets honour a spec field, found by rendering: the field
set to its example against the same spec without it. A target whose files
change honours the field; one whose files stay the same ignores it; one
that refuses the job with the field set says so. Nothing here is a table
kept by hand, so it changes when a target changes."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any

from ..render.engine import environment
from ..render.templatedir import default_template_dir
from ..spec import JobSpec
from ..spec.yamlfile import SpecError, build_spec
from ..targets import TARGETS


class Effect(str, Enum):
    RENDERS = "renders it"
    IGNORES = "no change"
    REFUSES = "refuses it"


@dataclass(frozen=True)
class Probe:
    """What each target does with one field's example."""

    effects: dict[str, Effect]  # target name -> effect, in TARGETS' order
    refusals: dict[str, str]  # target name -> why it refuses


def _files(spec: JobSpec, target: str) -> dict[str, str] | str:
    """The target's files as text (templates only: the same text `ddpkit render`
    writes, without its bash -n and read-back checks), or why it refuses."""
    module = TARGETS[target]
    try:
        outputs = module.build(spec)
    except SpecError as exc:
        return "; ".join(exc.problems)
    env = environment(default_template_dir())
    return {o.name: env.get_template(o.template).render(**o.variables) for o in outputs}


@cache
def _baseline(target: str) -> dict[str, str] | str:
    return _files(build_spec({}), target)


def without(fragment: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
    """`fragment` less the field at `parts` (its other keys stay, as context)."""
    trimmed = copy.deepcopy(fragment)
    holder: Any = trimmed
    for part in parts[:-1]:
        holder = holder.get(part) if isinstance(holder, dict) else None
    if isinstance(holder, dict):
        holder.pop(parts[-1], None)
    return trimmed


def probe(context: dict[str, Any], parts: tuple[str, ...]) -> Probe:
    """Render `context` (a spec that sets the field) for every target and
    compare it with the same spec less the field (or, where that is refused,
    with the default spec)."""
    with_field = build_spec(context)
    try:
        baseline_spec: JobSpec | None = build_spec(without(context, parts))
    except SpecError:
        baseline_spec = None  # the field is required where it stands: compare with no section at all
    effects: dict[str, Effect] = {}
    refusals: dict[str, str] = {}
    for target in TARGETS:
        seen = _files(with_field, target)
        base = _files(baseline_spec, target) if baseline_spec is not None else _baseline(target)
        if isinstance(seen, str):
            effects[target], refusals[target] = Effect.REFUSES, seen
        else:
            effects[target] = Effect.RENDERS if seen != base else Effect.IGNORES
    return Probe(effects, refusals)


def probe_all(contexts: list[dict[str, Any]], parts: tuple[str, ...]) -> Probe:
    """`probe` over several examples: a target renders the field if any
    example changes its files, refuses it if every example is refused."""
    probes = [probe(c, parts) for c in contexts]
    effects: dict[str, Effect] = {}
    refusals: dict[str, str] = {}
    for target in TARGETS:
        seen = [p.effects[target] for p in probes]
        if Effect.RENDERS in seen:
            effects[target] = Effect.RENDERS
        elif seen and all(e is Effect.REFUSES for e in seen):
            effects[target], refusals[target] = Effect.REFUSES, probes[0].refusals[target]
        else:
            effects[target] = Effect.IGNORES
    return Probe(effects, refusals)
