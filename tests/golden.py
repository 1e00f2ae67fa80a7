"""The checked-in example outputs under slurm/ and k8s/: which example
renders to which file. `make golden` writes them; tests compare them whole."""

from __future__ import annotations

import sys
from pathlib import Path

from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import render

ROOT = Path(__file__).resolve().parents[1]
K8S_KINDS = ("pytorchjob", "indexed-job", "trainjob", "jobset")


def _single(spec: JobSpec, target: str) -> str:
    files = render(spec, target).files
    assert len(files) == 1, f"{target} renders {sorted(files)}; golden expects one file"
    return next(iter(files.values()))


def expected() -> dict[Path, str]:
    """Relative path -> text, for every example job."""
    out: dict[Path, str] = {}
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        stem = example.stem
        out[Path("slurm") / f"{stem}.sbatch"] = _single(load_spec(example), "slurm")
        for kind in K8S_KINDS:
            spec = load_spec(example, overrides=[f"k8s.kind={kind}"])
            out[Path("k8s") / f"{stem}.{kind}.yaml"] = _single(spec, "k8s")
    return out


def main(argv: list[str]) -> int:
    if argv != ["--write"]:
        print("usage: python -m tests.golden --write", file=sys.stderr)
        return 2
    for rel, text in expected().items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
