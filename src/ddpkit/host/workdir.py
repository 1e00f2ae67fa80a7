"""The directory a job's processes start in (the spec's `command.workdir`,
handed to every node as DDPKIT_WORKDIR): made if it is missing, by the user
the processes run as, and entered before the program starts, by the agent on
every node and by `python -m ddpkit.run` where no agent runs (Slurm's srun
mode). One rule for every target, so a relative path in the program's
arguments means the same folder everywhere. A leaf: the agent and the
runner both use it before anything else of ddpkit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ..shared import envnames
from ..shared.exitcodes import ExitCode, exit_on


def enter(env: Mapping[str, str], who: str) -> None:
    """Make and enter DDPKIT_WORKDIR when it is set; a folder that cannot be
    made or entered ends the process with one line and exit 3 (the host
    cannot run the job)."""
    folder = env.get(envnames.DDPKIT_WORKDIR)
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        os.chdir(folder)
    except OSError as exc:
        sys.exit(exit_on(who, f"command.workdir {folder} cannot be made or entered as uid {os.getuid()}: "
                              f"{exc.strerror or exc}; fix: a folder that user can write, or a mount there",
                         ExitCode.PREFLIGHT))
