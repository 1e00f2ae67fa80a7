"""Pre-emption: SIGTERM or SIGUSR2 asks the job to stop.

The handler only records the request (StopRequest). StopAgreement turns the
per-rank requests into one decision that every rank takes after the same
step, so a signal that reached only some ranks, or reached them during
different steps, still stops every rank together: then rank 0 checkpoints,
everyone exits with EXIT_PREEMPTED, and under Slurm rank 0 asks for the job
to be requeued when the signal was the one that asks for it (the time
limit's warning, preemption.signal; not a user's `scancel`, whose SIGTERM
must cancel). SIGUSR1 is left alone: NCCL may use it. The signals are
agreed.TRAINER_STOP_SIGNALS, the list the renderers tell torchrun's agent
to forward (contract.stop_args) instead of dying on them.

The agreement is pipelined so that it never waits on the training device:
the flag (the signal's number, 0 for none) lives on the CPU and is
all-reduced (MAX) over a CPU-capable group,
asynchronously; the check after step n reads the all-reduce started after
step n-1 (long finished by then) and starts the next one. Every rank sees
the same value, the flags as of the end of step n-1, so the decision is the
same everywhere; the price is that a stop takes effect one step later than
the step during which the signal arrived.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from types import FrameType

import torch
import torch.distributed as dist

from ... import records
from ...shared import envnames
from ...shared.agreed import TRAINER_STOP_SIGNALS
from ...shared.exitcodes import ExitCode

EXIT_PREEMPTED = ExitCode.PREEMPTED  # stopped on request after a checkpoint; run again with --resume auto
# The renderers tell torchrun to forward exactly these (contract.stop_args).
STOP_SIGNALS = tuple(signal.Signals[name] for name in TRAINER_STOP_SIGNALS)
CPU_BACKENDS = ("gloo", "mpi")  # default-group backends that all-reduce CPU tensors


class StopRequest:
    """This process's own view: did a stop signal arrive?"""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


def cpu_group(backend: str) -> dist.ProcessGroup | None:
    """A process group that all-reduces CPU tensors: None (the default group)
    when its backend can, else a new gloo group. A collective call: every
    rank must make it, in the same order relative to its other new_group calls."""
    if backend in CPU_BACKENDS:
        return None
    # NCCL only reduces device tensors: a flag there would cost a device copy
    # and a tiny kernel on the compute stream every step.
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)  # this rank is in the group: never the non-member marker
    return group


class StopAgreement:
    """Every rank's stop decision after each step, the same on all ranks.

    check() after every step; finish() once training ends normally, so that
    no all-reduce is left in flight when the process group goes away.
    """

    def __init__(self, request: StopRequest, distributed: bool, group: dist.ProcessGroup | None = None) -> None:
        self.request, self.distributed, self.group = request, distributed, group
        self._flag = torch.zeros(1, dtype=torch.int32)  # CPU: reading it never syncs a device
        self._pending: dist.Work | None = None
        self.signum: int | None = None  # the agreed stop signal, once check() said stop

    def stop_record(self, step: int, checkpoint: str | None) -> records.Stop:
        """The metrics file's `stop` record: written only on this path, so a
        checkpoint that a signal caused can be told from a periodic one."""
        name = signal.Signals(self.signum).name if self.signum else None
        return records.Stop(name, step, checkpoint, int(os.environ.get(envnames.SLURM_RESTART_COUNT, "0") or 0))

    @classmethod
    def for_run(cls, request: StopRequest, distributed: bool) -> StopAgreement:
        """Make the agreement for a training run; with a process group, every
        rank must call this at the same point of its start-up (it may create a group)."""
        group = cpu_group(dist.get_backend()) if distributed else None
        return cls(request, distributed, group)

    def check(self) -> bool:
        """True on every rank, after the same step, once any rank got a stop signal."""
        if not self.distributed:
            self.signum = self.request.signum
            return self.request.requested
        if self._take_pending():
            return True
        # The signal's number, not just 1: every rank then knows which signal
        # stopped the job (the highest, if ranks got different ones).
        self._flag.fill_(self.request.signum or 0)
        self._pending = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def _take_pending(self) -> bool:
        """Wait for the all-reduce started at the previous check (done by now:
        a whole step ran since) and return its result."""
        if self._pending is None:
            return False
        self._pending.wait()
        self._pending = None
        self.signum = int(self._flag.item()) or None
        return self.signum is not None

    def finish(self) -> None:
        """Wait for the all-reduce still in flight, if any. Its answer comes
        too late to matter: training is over, so a stop asked for during the
        last step changes nothing. Skip this on an error path: a peer that died
        would make it wait for the whole collective timeout."""
        self._take_pending()


REQUEUE_ON_DEFAULT = "USR2"  # what `--signal=B:USR2@N` sends before the time limit


def requeue_signal(env: Mapping[str, str]) -> str | None:
    """The stop signal (a name without SIG) after which the job requeues itself, or None
    for never. The rendered script says (DDPKIT_SLURM_REQUEUE_ON: preemption.signal, or
    empty when slurm.requeue is false); a script of the user's own gets USR2."""
    wanted = env.get(envnames.DDPKIT_SLURM_REQUEUE_ON, REQUEUE_ON_DEFAULT).strip().upper().removeprefix("SIG")
    return wanted or None


def requeue_if_slurm(signum: int | None, say: Callable[[str], None],
                     env: Mapping[str, str] = os.environ) -> bool:
    """Under Slurm, put the job back in the queue when `signum` asks for it, and say so
    first: the requeue ends this run at once, so a line written after it may never
    reach the job's output. Any other stop (a user's `scancel` sends SIGTERM; Slurm's
    own preemption requeues or cancels the job as its PreemptMode says) leaves the job
    to end. True when the requeue was asked for."""
    job = env.get(envnames.SLURM_JOB_ID)
    if not job:
        return False
    name = signal.Signals(signum).name if signum else "?"
    wanted = requeue_signal(env)
    if wanted is None or name != f"SIG{wanted}":
        why = "slurm.requeue is off" if wanted is None else f"it requeues itself on SIG{wanted} only"
        say(f"not requeueing Slurm job {job}: stopped by {name}, and {why} "
            f"({envnames.DDPKIT_SLURM_REQUEUE_ON}); this run ends here")
        return False
    say(f"requeueing Slurm job {job} (scontrol requeue); this run ends here")
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        say(f"scontrol requeue {job} failed: {done.stderr.strip()}")
    return True
