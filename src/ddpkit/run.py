"""`python -m ddpkit.run PROGRAM [ARGS]` or `python -m ddpkit.run -m MODULE [ARGS]`:
run a program of the user's own as `python` would, after ddpkit's preamble
(ddpkit/preamble), wherever no agent's zygote starts the workers: Slurm's
`srun` mode (one task per process), a container that runs one process, a
torchrun of the user's own, `DDPKIT_AGENT_FORK=0`.

In a task of an srun step that has no torchrun variables, it sets them from
Slurm's first (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT: the same rule `ddpkit train` reads them by), so a
program written for torchrun runs unchanged under srun.

The program sees what `python PROGRAM ARGS` would give it: sys.argv,
__main__, sys.path[0], its exit code, and a traceback that starts at its own
frames (in a Slurm job, kept in the node's log: one line says where). A task
of an srun step that fails leaves its node's failure file, so that the job
ends with the code of the first failure, not srun's highest
(agent/nodefailure.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

from . import preamble
from .host import workdir
from .shared import envnames
from .shared.exitcodes import ExitCode, exit_on
from .train.startup import launchinfo

USAGE = "usage: python -m ddpkit.run PROGRAM [ARGS] | -m MODULE [ARGS]"


def torchrun_env(env: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables for a task of an srun step that lacks them ({} otherwise)."""
    if envnames.RANK in env or not launchinfo.in_srun_step(env):
        return {}
    info = launchinfo.slurm_task(env)
    found = {envnames.RANK: info.rank, envnames.LOCAL_RANK: info.local_rank, envnames.WORLD_SIZE: info.world_size,
             envnames.LOCAL_WORLD_SIZE: info.local_world_size, envnames.GROUP_RANK: info.node_rank,
             envnames.MASTER_ADDR: info.master_addr, envnames.MASTER_PORT: info.master_port}
    return {name: str(value) for name, value in found.items() if value is not None}


def prepare(argv: list[str], env: MutableMapping[str, str]) -> None:
    """Check the line, fill in the torchrun variables; a bad line or launch
    environment ends the process with one line and exit 2."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        sys.exit(ExitCode.BAD_INPUT if not argv or argv[0] == "-m" else ExitCode.OK)
    try:
        env.update(torchrun_env(env))
    except launchinfo.StartupError as err:
        sys.exit(exit_on("ddpkit.run", err, ExitCode.BAD_INPUT))


def main(argv: list[str] | None = None) -> None:
    from .agent import nodefailure
    from .preamble import stop

    code = _run(sys.argv[1:] if argv is None else argv)
    nodefailure.task_ended(code, stopped=stop.STATE.request.signum is not None)
    sys.exit(code)


def _run(line: list[str]) -> int:
    """The task's exit code: the program's, or that of the check that ended it
    before the program's first line (a bad line, workdir, preamble part), so
    that those too leave the node's failure file."""
    from .agent import worker

    try:
        prepare(line, os.environ)
        workdir.enter(os.environ, "ddpkit.run")
        preamble.install(line)
    except SystemExit as exc:
        return worker.exit_status(exc)
    return worker.run_as_main(line)


if __name__ == "__main__":
    main()
