"""The state of the last completed step, written when a peer is lost, so that
a restart loses at most the step in flight.

Under DDP every rank holds the whole model and optimizer of the last step all
ranks completed. When a node is lost the survivors' agents restart their
workers, which resume from the newest checkpoint in --checkpoint-dir; without
this, the one written every --checkpoint-every steps, and every step since is
trained again. Instead one rank writes its own state of the last completed
step at the loss: a checkpoint like any other, marked with why it was written.
Which rank: the first to claim the write in the job's control store (the
watchdog's; in an elastic job the rendezvous store, which outlives any node),
so the write is done once and also when rank 0's node is the one lost;
without a store to claim in, rank 0.

Two moments write it, whichever comes first:
- the main thread, when a collective fails: a peer that died closed its
  connections, and gloo raises at once;
- the hang watchdog's thread, on its `lost` verdict: a silent peer leaves the
  main thread waiting in a collective that nothing can wake, so the state is
  read beside it.

The guard makes the second safe. The main thread holds it while the state
moves on to the next step (optimizer, scaler, scheduler, position), so the
watchdog never reads half of a step. And a step in flight has already run its
forward pass, which updates BatchNorm's running statistics: the guard keeps
every buffer's value from before the step and writes those.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from .checkpointer import Checkpointer, Position
from .files import checkpoint_name

# The main thread holds the guard for one optimizer update; longer means it is
# stuck in one, and a state read then would not be a step's.
GUARD_WAIT_S = 10.0


def failure_reason(exc: BaseException) -> str:
    """What the main thread met, in one line (a gloo error is a page of C++ context)."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    # gloo's source positions ("[.../pair.cc:561] "), DDP's wrapping of its hook's error, its boilerplate
    first = re.sub(r"\[/[^\]]*\]\s*", "", first)
    first = first.replace("Got the following error when running the callback: RuntimeError: ", "")
    first = first.split(". This is typically caused")[0]
    return f"{type(exc).__name__}: {first[:200]}".rstrip(": ")


class LastStep:
    """A rank's guard over the training state, and the writer of its last completed step."""

    def __init__(self, checkpointer: Checkpointer, model: nn.Module, position: Callable[[], Position],
                 enabled: bool, log: logging.Logger, rank: int = 0) -> None:
        self.checkpointer, self.model, self.position = checkpointer, model, position
        self.enabled, self.log, self.rank = enabled, log, rank
        # Claims the one write of this loss for this rank (the watchdog's store); None: rank 0 writes.
        self.claim: Callable[[], bool] | None = None
        self._guard = threading.Lock()
        persistent = set(model.state_dict().keys()) if enabled else set()
        self._names = [name for name, _ in model.named_buffers() if name in persistent]
        self._before: dict[str, torch.Tensor] | None = None  # buffers before the step in flight
        # Called after every write, whatever came of it: the watchdog tells the other ranks, who wait
        # for it before they leave (train/watchdog/stall.py, on_lost).
        self.done: Callable[[], object] | None = None

    def begin(self) -> None:
        """A step starts: keep the buffers its forward pass will change (a few KB for a ResNet)."""
        if self.enabled:
            buffers = dict(self.model.named_buffers())
            self._before = {name: buffers[name].detach().clone() for name in self._names}

    @contextlib.contextmanager
    def advancing(self) -> Iterator[None]:
        """Around the update from one step to the next: no state is read meanwhile."""
        with self._guard:
            yield
            self._before = None

    def write(self, reason: str) -> Path | None:
        """Write the last completed step (the rank that claimed it; once per step; not for ZeRO), or None."""
        if self.enabled and not self._mine():
            return None  # another rank writes it, and says when it is done
        try:
            return self._write(reason) if self.enabled else None
        finally:
            if self.done is not None:
                self.done()

    def _mine(self) -> bool:
        if self.claim is None:
            return self.rank == 0
        try:
            return self.claim()
        except Exception:  # the store went with the node lost: rank 0, as without one
            return self.rank == 0

    def _write(self, reason: str) -> Path | None:
        if not self._guard.acquire(timeout=GUARD_WAIT_S):
            self.log.warning("not writing the last step from memory (%s): the main thread is still updating", reason)
            return None
        try:
            pos = Position(**vars(self.position()))
            last = self.checkpointer.last  # also the file written here before, for this step
            if pos.step == 0 or (last is not None and last.name == checkpoint_name(pos.step)):
                return None  # nothing trained yet, or this step is on disk already
            model = self.model.state_dict()
            if self._before is not None:
                model.update(self._before)
            path = self.checkpointer.save_from_memory(pos, model, reason)
            if path is not None:
                self.log.warning("wrote the last completed step from memory: %s (step %d; %s)", path, pos.step,
                                 reason)
            return path
        except Exception as exc:  # the exit that follows must happen whatever went wrong here
            self.log.warning("could not write the last step from memory (%s): %s", reason, exc)
            return None
        finally:
            self._guard.release()
