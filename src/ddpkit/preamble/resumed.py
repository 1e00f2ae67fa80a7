"""Whether a restarted job's program resumed: on a job Slurm requeued, or
whose workers their agent restarted, rank 0 says at the program's first
optimizer step whether the program had loaded anything with `torch.load`
before it (its checkpoint, for the programs that resume: a Hugging Face
Trainer's `optimizer.pt`, Lightning's `last.ckpt`, the tutorial's
`snapshot.pt`) or nothing, so that it starts over from step 0. Only the
program knows whether it resumes; this is what it did, said once, where
the user reads the job's start.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from ..shared import envnames

SHOWN_FILES = 3


def restart_of(env: Mapping[str, str]) -> str | None:
    """How this run of the job was restarted, or None on its first run."""
    slurm = env.get(envnames.SLURM_RESTART_COUNT, "0")
    if slurm.isdigit() and int(slurm) > 0:
        return f"requeued by Slurm (restart {slurm})"
    agent = env.get(envnames.TORCHELASTIC_RESTART_COUNT, "0")
    if agent.isdigit() and int(agent) > 0:
        return f"restarted by its agent (restart {agent})"
    return None


def verdict(restart: str, loaded: list[str]) -> str:
    """The line rank 0 prints at the first optimizer step."""
    if not loaded:
        return (f"ddpkit: this job was {restart}, and the program loaded nothing with torch.load before its first "
                "step: it starts over from step 0 (to resume, load your checkpoint at start: docs/guides/your-program.md)")
    shown = ", ".join(loaded[:SHOWN_FILES]) + (f" and {len(loaded) - SHOWN_FILES} more" if len(loaded) > SHOWN_FILES else "")
    return f"ddpkit: this job was {restart}; before its first step the program loaded {shown}: it resumes from there"


def _name(target: Any) -> str:
    if isinstance(target, (str, os.PathLike)):
        return os.fsdecode(target)
    return str(getattr(target, "name", type(target).__name__))


def install(env: Mapping[str, str] = os.environ) -> None:
    """On rank 0 of a restarted job: note every torch.load until the first optimizer step, then say what was loaded."""
    restart = restart_of(env)
    if restart is None or env.get(envnames.RANK, "0") != "0":
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    loaded: list[str] = []
    said: list[bool] = []
    load = torch.load

    def noting_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        loaded.append(_name(f))
        return load(f, *args, **kwargs)

    def first_step(*_: Any) -> None:
        # Not removed here: torch iterates its hooks while calling them, and a
        # hook removed from the middle of them breaks the program's step.
        if said:
            return
        said.append(True)
        if torch.load is noting_load:
            torch.load = load
        print(verdict(restart, list(dict.fromkeys(loaded))), file=sys.stderr, flush=True)

    torch.load = noting_load
    register_optimizer_step_pre_hook(first_step)
