"""reference/spec.md: every job-spec field, from JobSpec's JSON Schema."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..spec import JobSpec
from ..spec.yamlfile import build_spec
from ..targets import TARGETS
from .examples import Example, found_examples, made_examples
from .honour import Effect, Probe, probe_all
from .markdown import cell, generated_note, literal, prose
from .schema_walk import NO_DEFAULT, REQUIRED, SchemaField, SchemaWalk

INTRO = """\
Every field of the YAML job spec, read from the spec's JSON Schema
(`ddpkit schema` prints it). A field's path is dotted (`watchdog.loss_s` is
`loss_s` under `watchdog:`); `[]` steps into a list's items.

**Targets** says what each render target does with the field. It is found
by rendering, not written by hand: the field's examples (below) are rendered
with `ddpkit render`'s templates for each target and compared with the same
spec without the field.

- *renders it*: the target's files change (a directive, a flag, a variable);
- *no change*: the files stay the same for these examples: the value is read
  elsewhere (by a launcher, or by the job when it runs) or these examples
  equal what the target does anyway;
- *refuses it*: the target refuses the job with the field set (the reason follows).

`launch local`, `launch docker` and `launch ssh` run the same contract as the
rendered files (`launch ssh` runs the ssh target's script).

**Example** shows the first job spec in the shipped `examples/`, `README.md`
or these pages that sets the field, else a value made from the field's type
and bounds; each one is accepted by the schema when the page is built.
"""


@dataclass(frozen=True)
class FieldEntry:
    field: SchemaField
    shown: Example | None
    probe: Probe


def entries(root: Path) -> list[FieldEntry]:
    fields = SchemaWalk(JobSpec.model_json_schema()).fields()
    documented = found_examples(root, fields)
    probes: dict[str, Probe] = {}
    found: list[FieldEntry] = []
    for field in fields:
        made = made_examples(field)
        docs = documented[field.path]
        shown = docs[0] if docs else made[0] if made else None
        if field.in_list_item:  # an item's field counts as its list does: the item is what a target renders
            list_path = field.path.split("[]")[0]
            probe = probes[list_path]
        else:
            contexts = [e.context for e in docs if not e.is_default] + [e.context for e in made]
            probe = probe_all(contexts or [e.context for e in docs], field.parts)
            probes[field.path] = probe
        found.append(FieldEntry(field, shown, probe))
    return found


def _default(field: SchemaField, defaults: dict[str, Any]) -> str:
    if field.default is REQUIRED:
        return "required"
    if field.default is NO_DEFAULT:
        value: Any = defaults
        for part in field.parts:
            if not isinstance(value, dict) or part not in value:
                return "none"
            value = value[part]
        return f"`{literal(value)}`"
    return "absent" if field.default is None else f"`{literal(field.default)}`"


def _targets(probe: Probe) -> str:
    words = []
    for target in TARGETS:
        effect = probe.effects[target]
        why = f" ({cell(probe.refusals[target])})" if effect is Effect.REFUSES else ""
        words.append(f"{target}: *{effect.value}*{why}")
    return "; ".join(words)


def _entry(entry: FieldEntry, defaults: dict[str, Any]) -> str:
    field = entry.field
    lines = [f"### `{field.path}`", ""]
    if field.description:
        lines += [prose(field.description), ""]
    lines += ["| Type | Default | Allowed values |", "|---|---|---|",
              f"| {cell(field.type)} | {_default(field, defaults)} | {cell(field.allowed) or 'any of its type'} |", ""]
    lines += [f"**Targets**{' (as its list)' if field.in_list_item else ''}: {_targets(entry.probe)}", ""]
    if entry.shown is None:
        lines += ["**Example**: none in the documents, and none the schema's rules let ddpkit make.", ""]
    else:
        body = yaml.safe_dump(entry.shown.fragment, sort_keys=False, default_flow_style=False).rstrip()
        lines += [f"**Example** (from {entry.shown.source}):", "", "```yaml", body, "```", ""]
    return "\n".join(lines)


def spec_page(root: Path) -> str:
    """The page's Markdown; `root` is the checkout whose examples/ and docs/ give examples."""
    defaults = build_spec({}).model_dump(mode="json")
    found = entries(root)
    parts = ["# Job spec", "", generated_note("ddpkit.spec.JobSpec"), "", INTRO, ""]
    parts += ["## The job", "", "The fields at the top level of the spec.", ""]
    parts += [_entry(e, defaults) for e in found if not e.field.top]
    for top in dict.fromkeys(e.field.top for e in found if e.field.top):
        section = [e for e in found if e.field.top == top]
        parts += [f"## `{top}`", ""]
        note = section[0].field.section_note if len(section[0].field.parts) == 2 else ""
        if note:
            parts += [prose(note), ""]
        parts += [_entry(e, defaults) for e in section]
    return "\n".join(parts)
