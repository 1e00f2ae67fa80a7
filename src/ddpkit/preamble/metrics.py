"""Metrics records for a program of the user's own, in the format `ddpkit
train --metrics` writes, so that `ddpkit report RUN` draws any program's run.

Rank 0 appends to the file DDPKIT_METRICS names (launch local: the run
folder's `metrics.jsonl`); every `LOG_EVERY` counted optimizer steps:

- `train`: the step, the loss (the value the last `backward()` was called
  on, read only then: one device sync per LOG_EVERY steps, none in between;
  under GradScaler that is the scaled loss, and the record says what it is)
  and samples per second (the batch dimension of what the program passed to
  its DistributedDataParallel, times the world size);
- `step_times`: each rank's mean time between its optimizer steps over the
  window before, exchanged through the process group's store (never the
  program's collectives); a window some rank has not published yet is left
  out rather than waited for.

The rank table's rows go in as `rank_report` records (ranks.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import envnames
from ..records import StepTimes, Train
from .store import group_store

LOG_EVERY = 10
SUBPREFIX = "step-times"  # under the run's control prefix (runkey)
LOSS_IS = "the tensor backward() was called on"


class Recorder:
    """One rank's side: timings between steps, the loss and batch sizes seen."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.loss: Any = None  # the detached tensor of the last backward(); read at log steps only
        self.samples = 0  # batch rows given to DDP since the last record
        self._last = time.monotonic()
        self._window_s = 0.0
        self._steps = 0
        self._logged_at = time.monotonic()
        self._metrics: Any = None
        self._store: Any = None

    def on_backward(self, tensor: Any) -> None:
        if tensor.numel() == 1:
            self.loss = tensor.detach()

    def on_batch(self, rows: int) -> None:
        self.samples += rows

    def on_step(self, step: int) -> None:
        if self.path is None:
            return  # not installed: no file to write to
        now = time.monotonic()
        self._window_s += now - self._last
        self._last = now
        self._steps += 1
        if step % LOG_EVERY == 0:
            self._flush(step, now)

    def _flush(self, step: int, now: float) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        store = self._step_store()
        mean = self._window_s / max(self._steps, 1)
        self._window_s, self._steps = 0.0, 0
        if store is not None:
            store.set(f"{step}/{rank}", f"{mean:.6f}")
        if rank != 0:
            return
        metrics = self._writer()
        elapsed = max(now - self._logged_at, 1e-9)
        loss = float(self.loss.item()) if self.loss is not None else None
        metrics.put(Train(step=step, loss=loss, loss_is=LOSS_IS, images_per_s=round(self.samples * world / elapsed, 3)))
        self.samples, self._logged_at = 0, now
        if store is not None and step > LOG_EVERY:
            self._step_times(store, metrics, step - LOG_EVERY, world)

    def _step_times(self, store: Any, metrics: Any, step: int, world: int) -> None:
        keys = [f"{step}/{r}" for r in range(world)]
        if not store.check(keys):
            return  # a rank is behind: its window is left out, never waited for
        values = [float(v) for v in store.multi_get(keys)]
        for key in keys:
            store.delete_key(key)
        metrics.put(StepTimes(step=step, step_s=tuple(round(v, 5) for v in values)))

    def _step_store(self) -> Any:
        if self._store is None:
            self._store = group_store(SUBPREFIX) or False  # False: asked once, none to be had
        return self._store or None

    def _writer(self) -> Any:
        if self._metrics is None:
            from ..train.outputs.progress import Metrics

            self._metrics = Metrics(self.path, enabled=True)
        return self._metrics


RECORDER = Recorder(None)


def install_from(env: Mapping[str, str]) -> None:
    """The metrics part, when the launcher names a file for the records."""
    path = env.get(envnames.DDPKIT_METRICS)
    if path:
        install(Path(path))


def install(path: Path | None) -> Recorder:
    """Record the loss and the batch size the program trains on (two small
    wrappers: Tensor.backward, DistributedDataParallel.forward)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    RECORDER.path = path
    backward = torch.Tensor.backward

    def recording_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        RECORDER.on_backward(self)
        return backward(self, *args, **kwargs)

    forward = DistributedDataParallel.forward

    def counting_forward(self: DistributedDataParallel, *inputs: Any, **kwargs: Any) -> Any:
        RECORDER.on_batch(batch_rows(inputs, kwargs))
        return forward(self, *inputs, **kwargs)

    recording_backward.__wrapped__ = backward  # type: ignore[attr-defined]
    counting_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    torch.Tensor.backward = recording_backward  # type: ignore[method-assign]
    DistributedDataParallel.forward = counting_forward  # type: ignore[method-assign]
    return RECORDER


def batch_rows(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The batch dimension of the first tensor among a forward's arguments (0: none)."""
    import torch

    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0
