"""Pre-emption: one grace chain for every target.

A stop that asks for a checkpoint passes through nested timeouts: the
checkpoint, torchrun's --shutdown-timeout around it, and each scheduler's or
launcher's warning around that. The user sets one number
(preemption.checkpoint_s); every other link is derived here, and a link set
by hand that would kill the workers before their checkpoint is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from .fields import Strict

DEFAULT_CHECKPOINT_S = 60


def chain_margin(seconds: int) -> int:
    """The slack one link of the grace chain adds to the link inside it: a
    quarter of the inner time, at least 2 s (process exit, a requeue call), at
    most 15 s (a long checkpoint needs no longer exit)."""
    return max(2, min(15, math.ceil(seconds / 4)))


@dataclass(frozen=True)
class GraceChain:
    """What a stop that asks for a checkpoint may take, inside out:
    checkpoint_s < shutdown_s (torchrun's --shutdown-timeout: the forwarded
    signal to SIGKILL of the workers) < each outer warning (Slurm's
    --signal=B:SIG@N, Kubernetes' terminationGracePeriodSeconds, the
    launchers' grace after Ctrl-C or SIGTERM)."""

    checkpoint_s: int
    shutdown_s: int
    slurm_signal_s: int
    k8s_grace_s: int
    launcher_grace_s: int

    @classmethod
    def from_checkpoint(cls, checkpoint_s: int, slurm: int | None = None, k8s: int | None = None) -> GraceChain:
        shutdown = checkpoint_s + chain_margin(checkpoint_s)
        warning = shutdown + chain_margin(shutdown)
        return cls(checkpoint_s, shutdown, warning if slurm is None else slurm, warning if k8s is None else k8s, warning)

    @property
    def warnings(self) -> dict[str, int]:
        return {"slurm.signal_seconds": self.slurm_signal_s, "k8s.termination_grace_s": self.k8s_grace_s,
                "launcher grace": self.launcher_grace_s}


def checkpoint_within(warning_s: int) -> int | None:
    """The longest checkpoint whose chain fits inside `warning_s` (None: none
    does): what an old spec that set only a scheduler's warning allows."""
    fits = [c for c in range(1, warning_s) if GraceChain.from_checkpoint(c).launcher_grace_s <= warning_s]
    return fits[-1] if fits else None


class Preemption(Strict):
    """How a job stops when its scheduler wants the nodes back: the scheduler
    warns with `signal` (Slurm: before the time limit or a pre-emption;
    Kubernetes and the launchers always send SIGTERM), every rank finishes
    its step, rank 0 writes a checkpoint, and the job exits 75 (requeued
    under Slurm). `checkpoint_s` is the one number to set: the longest time
    from the signal to the checkpoint on disk (two training steps, since the
    ranks agree to stop one step later, plus one save). torchrun's
    --shutdown-timeout and every scheduler's warning are derived from it."""

    # One of the signals `ddpkit train` stops on (agreed.TRAINER_STOP_SIGNALS).
    signal: Literal["USR2", "TERM"] = Field(default="USR2", description="Slurm's warning signal (not USR1: NCCL may use it)")
    checkpoint_s: int | None = Field(
        default=None, ge=1, le=3000,
        description=f"seconds from the stop signal to a written checkpoint (default {DEFAULT_CHECKPOINT_S}); "
                    "torchrun's --shutdown-timeout and the schedulers' warnings are derived from it",
    )


def grace_chain(checkpoint_s: int | None, slurm_signal_s: int | None, k8s_grace_s: int | None) -> GraceChain:
    """The chain the renderers and launchers use (JobSpec.grace), from
    preemption.checkpoint_s, slurm.signal_seconds and k8s.termination_grace_s.
    A scheduler warning set in an older spec without preemption.checkpoint_s
    sets the checkpoint time that fits inside the smallest of them; with
    checkpoint_s, each must exceed the shutdown timeout (chain_problem)."""
    checkpoint = checkpoint_s
    if checkpoint is None:
        given = [w for w in (slurm_signal_s, k8s_grace_s) if w is not None]
        checkpoint = checkpoint_within(min(given)) if given else DEFAULT_CHECKPOINT_S
        if checkpoint is None:
            raise ValueError(f"a scheduler warning of {min(given)} s leaves no time for a checkpoint; "
                             "raise it, or set preemption.checkpoint_s and let ddpkit derive it")
    return GraceChain.from_checkpoint(checkpoint, slurm_signal_s, k8s_grace_s)


def chain_problem(chain: GraceChain) -> str | None:
    """One line naming the first link that breaks the chain, with its fix."""
    for name, value in chain.warnings.items():
        if value <= chain.shutdown_s:
            return (f"{name}={value} must exceed torchrun's --shutdown-timeout of {chain.shutdown_s} s "
                    f"(preemption.checkpoint_s={chain.checkpoint_s} plus {chain.shutdown_s - chain.checkpoint_s} s) "
                    f"or the workers are killed before their checkpoint is written; raise it (derived: "
                    f"{GraceChain.from_checkpoint(chain.checkpoint_s).launcher_grace_s}), lower "
                    "preemption.checkpoint_s, or remove it to derive it")
    return None
