"""Forge one process's rank-report row in real jobs, from outside ddpkit.

`forge_env({"on_rank": 1, "rank": 0})` returns the environment that makes
every Python process of a job (torchrun workers, --spawn children, the nodes
of `ddpkit launch local`) load tests/helpers/forgehook/sitecustomize.py,
which wraps ddpkit.train.startup.rank_report.own_row: the process whose true rank is
`on_rank` (default: the last rank) reports the given fields instead of its
own. So a test can provoke a duplicate rank or a version mismatch without
any test hook in the product.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

FORGE_VAR = "DDPKIT_TEST_FORGE_RANK_REPORT"
HOOK_DIR = Path(__file__).resolve().parent / "forgehook"


def forge_env(changes: Mapping[str, object], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to add to a job's environment (PYTHONPATH keeps `base`'s entries after the hook)."""
    env = os.environ if base is None else base
    path = os.pathsep.join(p for p in (str(HOOK_DIR), env.get("PYTHONPATH", "")) if p)
    return {FORGE_VAR: json.dumps(dict(changes)), "PYTHONPATH": path}


def forged(row: Any, world_size: int, raw: str) -> Any:
    """`row` with the changes in `raw` applied when it is the chosen rank's."""
    changes = json.loads(raw)
    if changes.pop("on_rank", world_size - 1) != row.rank:
        return row
    allowed = {f.name for f in fields(row)}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"{FORGE_VAR}: unknown row fields {sorted(unknown)}; use {sorted(allowed)}")
    return replace(row, **changes)


def install(raw: str) -> None:
    """Wrap rank_report.own_row in this process (called by the sitecustomize hook)."""
    from ddpkit.train.startup import rank_report

    real: Callable[[Any], Any] = rank_report.own_row

    def own_row(ctx: Any, *args: Any) -> Any:
        return forged(real(ctx, *args), ctx.world_size, raw)

    rank_report.own_row = own_row
