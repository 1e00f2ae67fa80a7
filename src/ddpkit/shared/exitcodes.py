"""Every exit code ddpkit's commands return, in one place.

The numbers follow sysexits(3) and the shell's 128+signal convention where one
fits, so that schedulers and scripts can tell a fault of the input from a fault
of the job. The documentation's exit-code reference (docs/reference/exit-codes.md)
is generated from this class and its comments.
"""

from __future__ import annotations

import sys
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1          # the job (or a doctor check) ran and failed
    BAD_INPUT = 2       # the job spec, a flag or a hostfile is wrong; nothing was started
    # a host or the cluster cannot run the job (no Docker daemon, too; --detach: the first host cannot keep the
    # supervisor: no writable runs folder, no ddpkit, no setsid); nothing was started
    PREFLIGHT = 3
    STARTUP = 4         # the job started but could not form its process group (network, rendezvous, versions)
    # ddpkit train's own faults: each names the host, the path and the fix (docs/guides/hangs.md)
    RESUME_MISMATCH = 10  # a rank cannot read the checkpoint rank 0 chose to resume from (directory not shared)
    CHECKPOINT_DIR = 11   # --checkpoint-dir cannot be written on a rank that writes checkpoints
    DATA_MISSING = 12     # --data-dir does not exist (or lacks the dataset) on some node
    STALLED = 13          # the hang watchdog found a rank without progress: stacks dumped, every rank stopped
    NODE_LOST = 14        # a node sent no heartbeat for watchdog.loss_s: elastic survivors re-form, a static job stops
    SOFTWARE = 70       # EX_SOFTWARE: an internal error in ddpkit (a template bug)
    PREEMPTED = 75      # EX_TEMPFAIL: checkpointed on a signal; run again with --resume auto
    # elastic: a worker failed after a restart with the same error as before it (type, message, file and line), no
    # node lost between: a bug in the program, which no restart gets past; not restarted again, not requeued
    SAME_ERROR = 76
    INTERRUPTED = 130   # 128 + SIGINT: stopped by Ctrl-C or SIGTERM, every node stopped


# The codes a ddpkit.train worker exits with that a launcher passes on as its
# own (torchrun's agent exits 1 whatever its worker's code was; launch/supervisor
# reads the worker's code from the agent's report). Another program's code has
# no meaning in this table, so its failure stays FAILED.
WORKER_CODES = frozenset({ExitCode.BAD_INPUT, ExitCode.STARTUP, ExitCode.RESUME_MISMATCH, ExitCode.CHECKPOINT_DIR,
                          ExitCode.DATA_MISSING, ExitCode.STALLED, ExitCode.NODE_LOST,
                          ExitCode.PREEMPTED})


def code_of(error: BaseException, default: ExitCode = ExitCode.BAD_INPUT) -> int:
    """The code a command ends with on `error`: the error class's `exit_code`
    (every error of ddpkit's that ends a command names its code so), else
    `default`."""
    return int(getattr(error, "exit_code", default))


def exit_on(who: str, error: BaseException | str, code: int | None = None) -> int:
    """Print `who: <error>` on stderr (an error's str() is what its user
    reads: one line, or a heading and its list) and return the exit code:
    `code` where the caller decides it, else code_of(error). A message
    without an error is bad input."""
    print(f"{who}: {error}", file=sys.stderr, flush=True)
    if code is not None:
        return int(code)
    return code_of(error) if isinstance(error, BaseException) else int(ExitCode.BAD_INPUT)
