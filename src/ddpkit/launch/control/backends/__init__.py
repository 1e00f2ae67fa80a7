"""One backend per target for a run's life after its launch (base.py:
`RunBackend`, `Now`): launched.py (local, docker, ssh: ddpkit's own
launcher), slurm.py, kubectl.py and compose.py (rendered jobs another tool
starts). `ddpkit runs/status/logs/cancel` pick a run's backend by its
target (runs.RunTarget: every target has one) and ask it; none of them
knows a target."""

from __future__ import annotations

from ....runs import RunTarget, StoredRun
from ...slurm.jobs import SlurmQueue
from .base import Now, RunBackend
from .compose import Compose
from .kubectl import Kubectl
from .launched import Launched
from .slurm import Slurm

__all__ = ["Backends", "Now", "RunBackend"]


class Backends:
    """Every target's backend for one command. `slurm`: the jobs the command
    asks Slurm about, asked once for them all."""

    def __init__(self, slurm: SlurmQueue) -> None:
        # launch local's nodes are sessions of their own on this host: they outlive a killed launcher.
        self._by_target: dict[RunTarget, RunBackend] = {
            RunTarget.LOCAL: Launched(RunTarget.LOCAL, leftovers=True), RunTarget.DOCKER: Launched(RunTarget.DOCKER),
            RunTarget.SSH: Launched(RunTarget.SSH), RunTarget.SLURM: Slurm(slurm), RunTarget.K8S: Kubectl(),
            RunTarget.COMPOSE: Compose()}

    def of(self, run: StoredRun) -> RunBackend:
        """The backend of the run's target."""
        return self._by_target[run.record.target]
