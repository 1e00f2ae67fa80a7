"""One backend per target for a run's life after its launch (base.py:
`RunBackend`, `Now`): launched.py (local, docker, ssh: ddpkit's own
launcher), slurm.py, kubectl.py and compose.py (rendered jobs another tool
starts). `ddpkit runs/status/logs/cancel` pick a run's backend by its
target and ask it; none of them knows a target."""

from __future__ import annotations

from ....runs import StoredRun
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
        launched = {target: Launched(target, leftovers=target == "local") for target in ("local", "docker", "ssh")}
        self._by_target: dict[str, RunBackend] = {**launched, "slurm": Slurm(slurm), "k8s": Kubectl(),
                                                  "compose": Compose()}

    def of(self, run: StoredRun) -> RunBackend:
        """The backend of the run's target (one ddpkit does not know: its launcher's)."""
        return self._by_target.get(run.record.target) or Launched(run.record.target)
