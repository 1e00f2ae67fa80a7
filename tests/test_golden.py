"""The checked-in examples under slurm/ and k8s/ are exactly what the
renderers produce today, compared whole. This test never writes them:
`make golden` does, on purpose, and the diff goes into review."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from tests.golden import ROOT, expected

HINT = "run `make golden` to regenerate the checked-in examples, then review the diff"
GOLDEN_DIRS = ("slurm", "k8s")


@pytest.fixture(scope="module")
def golden() -> dict[Path, str]:
    return expected()


def test_every_golden_file_matches(golden: dict[Path, str]) -> None:
    problems = []
    for rel, want in golden.items():
        path = ROOT / rel
        if not path.exists():
            problems.append(f"{rel} is missing")
            continue
        got = path.read_text(encoding="utf-8")
        if got != want:
            diff = difflib.unified_diff(got.splitlines(keepends=True), want.splitlines(keepends=True),
                                        fromfile=f"{rel} (checked in)", tofile=f"{rel} (rendered now)")
            problems.append("".join(diff))
    assert not problems, "\n".join(problems) + f"\n{HINT}"


def test_no_stale_golden_files(golden: dict[Path, str]) -> None:
    present = {p.relative_to(ROOT) for d in GOLDEN_DIRS if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*")
               if p.is_file()}
    stale = sorted(str(p) for p in present - set(golden))
    assert not stale, f"checked-in files no example renders: {stale}; delete them, then {HINT}"
