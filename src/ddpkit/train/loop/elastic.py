"""Elastic membership, on the training side (spec.elastic, docs/guides/elastic.md).

torchrun's elastic agent starts new worker processes after every
membership change, so nothing here survives a restart: each new set of
workers finds out what changed from the agent's variables (restart count,
max restarts) and from the checkpoint it resumes from (the world size that
wrote it). Two things are decided here:

- the global batch on this world (`--keep-global-batch-of W`): the full
  job's global batch kept by gradient accumulation, or, without the flag,
  the global batch shrinks with the world and the learning rate follows
  (linear scaling, loop.Trainer._replan);
- the "what changed" line printed after the rank report, and the
  `reformed` record beside it that tells the launcher the job trains again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...records import Reformed
from ..config.values import TrainConfig
from ..startup.launchinfo import AgentRestarts


@dataclass(frozen=True)
class BatchFit:
    """How this world runs the job's global batch."""

    config: TrainConfig  # with batch_size / grad_accum for this world
    target: int  # the global batch of the full job (batch x accum x W)
    note: str  # one line for the report


def fit_global_batch(config: TrainConfig, world: int) -> BatchFit:
    """With --keep-global-batch-of W: the per-rank batch and accumulation
    that give this world the full job's global batch G = batch x accum x W,
    never a larger micro-batch than --batch-size (it must fit in memory).
    When G does not split over this world, the largest global batch below
    G that does is used (and the report says so)."""
    full = config.keep_global_batch_of
    target = config.batch_size * config.grad_accum * (full or world)
    if not full or world == full:
        return BatchFit(config, target, f"global batch {target}")
    per_rank = max(target // world, 1)
    accum = max(-(-per_rank // config.batch_size), 1)
    while per_rank % accum:
        accum += 1
    fitted = dataclasses.replace(config, batch_size=per_rank // accum, grad_accum=accum)
    got = per_rank * world
    note = (f"global batch {got} kept by gradient accumulation on {world} ranks (full job: {full}): "
            f"--batch-size {config.batch_size} x --grad-accum {config.grad_accum} -> "
            f"{fitted.batch_size} x {fitted.grad_accum}")
    if got != target:
        note += f"; {target} does not split over {world} ranks, so {got} (the lr follows it)"
    return BatchFit(fitted, target, note)


def changed_line(restarts: AgentRestarts | None, world: int, saved_world: int | None, batch_note: str,
                 keeps_batch: bool) -> str | None:
    """'What changed' after a (re-)rendezvous, for the rank report: the
    restart number, the world size before (the checkpoint's) and now, and
    how the global batch follows. None for a job that is not elastic."""
    if restarts is None and not keeps_batch:
        return None
    head = "elastic: " + (f"restart {restarts.restart} of at most {restarts.max_restarts}" if restarts else "start")
    if saved_world is None:
        world_part = f"world size {world} (no checkpoint to resume from)"
    elif saved_world == world:
        world_part = f"world size {world}, unchanged since the checkpoint"
    else:
        world_part = f"world size {saved_world} -> {world} (the checkpoint was written by {saved_world} ranks)"
    mode = batch_note if keeps_batch else f"{batch_note}; it follows the world size and the lr follows it (linear scaling)"
    return f"{head}; {world_part}; {mode}"


def reformed(restarts: AgentRestarts | None, world: int, saved_world: int | None) -> Reformed | None:
    """The `reformed` record after a (re-)rendezvous of torchrun's elastic
    agent; None for a job that torchrun does not restart."""
    if restarts is None:
        return None
    return Reformed(restart=restarts.restart, max_restarts=restarts.max_restarts, world=world, saved_world=saved_world)
