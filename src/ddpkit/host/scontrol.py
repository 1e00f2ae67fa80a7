"""What Slurm's `scontrol` prints, read in one place: by the launcher (the
cluster's limits before sbatch, the jobs a command shows) and by the agent
on a node (a job whose batch host is gone) alike.

Three shapes: `scontrol show job|node|partition -o` prints one record a line
of `Key=Value` words (fields); `scontrol show config` prints one setting a
line, `Key = Value` (config_value); `scontrol show hostnames` one host a
line (hostnames). The callers run scontrol; this module
runs nothing. A leaf: it imports nothing of the package, so the launcher
and the job's side may both use it.
"""

from __future__ import annotations

import re

_FIELD = re.compile(r"(\w+)=(\S*)")


def fields(line: str) -> dict[str, str]:
    """One `-o` record's `Key=Value` words (a value ends at the first blank)."""
    return {m.group(1): m.group(2) for m in _FIELD.finditer(line)}


def config_value(text: str, name: str) -> str | None:
    """The value of setting `name` in `scontrol show config`'s text; None
    when it does not list it."""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == name:
            return value.strip()
    return None


def hostnames(text: str) -> list[str]:
    """The hosts `scontrol show hostnames LIST` printed, in its order."""
    return text.split()
