"""Tell an elastic Slurm job's batch shell that training finished.

An elastic job step runs with --no-kill and --kill-on-bad-exit=0, so that a
lost node's task does not end the others. The price: a node the others left
behind whose slurmd still answers (its trainer frozen: a GPU hung in its
driver, a SIGSTOPped agent) keeps its task, and so the step, running until
the job's time limit, long after the survivors finished. Only the trainer
knows that training finished; only the batch shell owns the step. The batch
script (templates/slurm/job.sbatch.j2) exports its PID and node name and
traps SIGUSR1 (free there: the preemption signal is USR2 or TERM, and no NCCL
runs in the batch shell); a finished worker on that node sends it, and the
shell ends the tasks still running watchdog.loss_s later.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from ...host import processes
from ...shared import envnames


def batch_shell_pid(env: Mapping[str, str]) -> int | None:
    """The PID of this job's batch shell when it runs on this node and asked
    to be told, else None. The PID is checked to be a process of this job
    (its environment names the same SLURM_JOB_ID): a task in a container
    with a PID namespace of its own must not signal a stranger."""
    pid, node, job = (env.get(name) for name in (envnames.DDPKIT_SLURM_BATCH_PID, envnames.DDPKIT_SLURM_BATCH_NODE,
                                                  envnames.SLURM_JOB_ID))
    if not (pid and pid.isdigit() and node and job) or env.get(envnames.SLURMD_NODENAME) != node:
        return None
    return int(pid) if processes.environ_has(int(pid), envnames.SLURM_JOB_ID, job) else None


def tell_training_finished(env: Mapping[str, str] = os.environ) -> bool:
    """Signal the batch shell (see the module's doc); True when it was told."""
    pid = batch_shell_pid(env)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return False
    return True
