"""ddpkit: one PyTorch DDP job, described once, run on Slurm, Kubernetes, SSH or compose."""

from collections.abc import Callable

__version__ = "0.1.0"


def on_stop(fn: Callable[[], None]) -> None:
    """Run `fn` (save a checkpoint) on every rank when the job is asked to stop
    (SIGTERM, SIGUSR2: pre-emption, a time limit's warning, `ddpkit cancel`),
    when the program next steps its optimizer after the step every rank agreed
    on, before that step changes anything; the process then exits 75
    and, under Slurm, the job is requeued where the signal asks for it.
    One line in a program of the user's own (ddpkit/preamble/stop.py)."""
    from .preamble import stop

    stop.on_stop(fn)
