"""Every YAML block in README.md and docs/*.md parses, and every one that is
a job spec (or a fragment of one: its keys are spec fields) validates and
renders for the targets it configures, all four when it names none. A
reader copies these blocks: one the spec refuses is a bug. A failure names the file
and line of the block."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.spec import JobSpec
from ddpkit.specfile import SpecError, build_spec
from ddpkit.targets import render

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```ya?ml[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# What a fragment leaves out, for it to be a whole job.
BASE = {"name": "doc-example", "image": "ddpkit:cpu"}
TARGET_SECTIONS = {"slurm": "slurm", "k8s": "k8s", "ssh": "ssh", "compose": "compose"}


def yaml_blocks() -> list[tuple[str, str]]:
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = yaml_blocks()


def is_spec(data: Any) -> bool:
    return isinstance(data, dict) and bool(data) and set(data) <= set(JobSpec.model_fields)


@pytest.mark.parametrize(("where", "text"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_yaml_block_parses_and_every_job_spec_renders(where: str, text: str) -> None:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        pytest.fail(f"{where}: the YAML block does not parse: {exc}")
    if not is_spec(data):
        return  # another file's YAML (a manifest, a compose file): parsing is what a reader relies on
    try:
        spec = build_spec({**BASE, **data})
    except SpecError as exc:
        pytest.fail(f"{where}: the job spec is refused:\n" + "\n".join(exc.problems))
    targets = [target for section, target in TARGET_SECTIONS.items() if section in data] or list(TARGET_SECTIONS.values())
    for target in targets:
        rendered = render(spec, target)
        assert rendered.files, f"{where}: rendering for {target} wrote nothing"


def test_the_blocks_are_found_and_the_readme_reference_is_a_job_spec() -> None:
    """Guards the test above against finding nothing (a changed fence)."""
    readme = [text for where, text in BLOCKS if where.startswith("README.md:")]
    assert readme and is_spec(yaml.safe_load(readme[0])), "README.md's spec reference is not found as a job spec"
    assert sum(is_spec(yaml.safe_load(t)) for _, t in BLOCKS) >= 5
