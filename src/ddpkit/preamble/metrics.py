"""Metrics records for a program of the user's own, in the format `ddpkit
train --metrics` writes, so that `ddpkit report RUN` draws any program's run.

Rank 0 appends to the file DDPKIT_METRICS names (launch local: the run
folder's `metrics.jsonl`); every `LOG_EVERY` counted optimizer steps:

- `train`: the step, the loss (the value the last `backward()` was called
  on, read only then: one device sync per LOG_EVERY steps, none in between;
  under GradScaler that is the scaled loss, and the record says what it is)
  and the throughput of all ranks, in the unit of the batch (`batch_size`):
  tokens per second where the batch names its tokens (an `input_ids`
  tensor, among DDP's keyword arguments as a Hugging Face `Trainer` passes
  them, or in a dict batch as a Lightning `training_step` gets it: all its
  elements, padding included, as transformers' `num_input_tokens_seen`
  counts them), else samples per second (the first dimension of the first
  tensor, looked for inside tuples, lists and dicts too: Lightning passes
  the batch as it came from the loader); only forwards with gradients count
  (an evaluation is no training), times the world size;
- `step_times`: each rank's mean time between its optimizer steps over the
  window, exchanged through the process group's store (never the program's
  collectives). Rank 0 writes each window once every rank published it,
  never waiting for one inside training; at exit it gives the last window
  a moment (`LAST_WINDOW_S`), so the report's heat map ends where training
  did.

The rank table's rows go in as `rank_report` records (ranks.py).
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..records import StepTimes, Train
from ..shared import envnames
from .store import group_store

LOG_EVERY = 10
SUBPREFIX = "step-times"  # under the run's control prefix (runkey)
LOSS_IS = "the tensor backward() was called on"
TOKENS, SAMPLES = "tokens", "samples"  # the units of a batch (records.Train.unit)
TOKEN_KEY = "input_ids"  # the name Hugging Face models, tokenizers and collators give a batch's tokens
# At exit rank 0 waits at most this long for the last window's times: the other
# ranks publish theirs at the same optimizer step, long before rank 0's exit.
LAST_WINDOW_S = 2.0
PENDING_MAX = 3  # windows rank 0 keeps asking for; an older one (a rank far behind) is left out
DEPTH = 3  # how deep a batch is looked into (a tuple of dicts of tensors)


class Recorder:
    """One rank's side: timings between steps, the loss and batch sizes seen."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.loss: Any = None  # the detached tensor of the last backward(); read at log steps only
        self.counted = {TOKENS: 0, SAMPLES: 0}  # batch sizes given to DDP since the last record, by unit
        self.unit: str | None = None  # the unit of the records: tokens once a batch named them
        self._began = False  # a training forward seen: the clocks below start there
        self._last = time.monotonic()
        self._window_s = 0.0
        self._steps = 0
        self._step = 0
        self._logged_at = time.monotonic()
        self._metrics: Any = None
        self._store: Any = None
        self._group: tuple[int, int] | None = None  # (rank, world), kept for the exit
        self._pending: list[int] = []  # rank 0: windows not yet written, oldest first

    def on_backward(self, tensor: Any) -> None:
        if tensor.numel() == 1:
            self.loss = tensor.detach()

    def on_batch(self, count: int, unit: str) -> None:
        if not self._began:  # the first training forward: start-up before it is no step's time
            self._began = True
            self._last = self._logged_at = time.monotonic()
        self.counted[unit] += count
        if unit == TOKENS or self.unit is None and count:
            self.unit = unit

    def on_step(self, step: int) -> None:
        if self.path is None:
            return  # not installed: no file to write to
        now = time.monotonic()
        self._window_s += now - self._last
        self._last, self._step = now, step
        self._steps += 1
        if step % LOG_EVERY == 0:
            self._flush(step, now)

    def _flush(self, step: int, now: float) -> None:
        group = self._joined()
        if group is None:
            return
        rank, world = group
        store = self._step_store()
        self._publish(store, step, rank)
        if rank != 0:
            return
        metrics = self._writer()
        metrics.put(self._train(step, now, world))
        if store is not None:
            self._pending = [*self._pending, step][-PENDING_MAX:]
            self._write_ready(store, metrics, world)

    def _joined(self) -> tuple[int, int] | None:
        """(rank, world) of the process group; None before it is made."""
        import torch.distributed as dist

        if self._group is None and dist.is_initialized():
            self._group = (dist.get_rank(), dist.get_world_size())
            atexit.register(self.finish)
        return self._group

    def _publish(self, store: Any, step: int, rank: int) -> None:
        mean = self._window_s / max(self._steps, 1)
        self._window_s, self._steps = 0.0, 0
        if store is not None:
            store.set(f"{step}/{rank}", f"{mean:.6f}")

    def _train(self, step: int, now: float, world: int) -> Train:
        elapsed = max(now - self._logged_at, 1e-9)
        loss = float(self.loss.item()) if self.loss is not None else None
        unit = self.unit or SAMPLES
        per_s = round(self.counted[unit] * world / elapsed, 3)
        self.counted, self._logged_at = {TOKENS: 0, SAMPLES: 0}, now
        return Train(step=step, loss=loss, loss_is=LOSS_IS, images_per_s=per_s, unit=unit)

    def _write_ready(self, store: Any, metrics: Any, world: int) -> None:
        """Write each pending window every rank published; leave the others pending."""
        for step in list(self._pending):
            keys = [f"{step}/{r}" for r in range(world)]
            if not store.check(keys):
                continue  # a rank is behind: asked again at the next record, never waited for
            values = [float(v) for v in store.multi_get(keys)]
            for key in keys:
                store.delete_key(key)
            metrics.put(StepTimes(step=step, step_s=tuple(round(v, 5) for v in values)))
            self._pending.remove(step)

    def finish(self, wait_s: float = LAST_WINDOW_S) -> None:
        """At exit: the steps since the last record as a window of their own,
        and rank 0's last windows, waited for at most `wait_s`."""
        if self._group is None or self.path is None:
            return
        rank, world = self._group
        try:
            store = self._step_store()
            if self._steps:
                self._publish(store, self._step, rank)
                if rank == 0:
                    self._writer().put(self._train(self._step, self._last, world))
                    self._pending.append(self._step)
            if rank == 0 and store is not None:
                # An exception ended the program: the other ranks may be gone, so none is waited for.
                crashed = getattr(sys, "last_value", None) is not None
                self._drain(store, world, time.monotonic() + (0.0 if crashed else wait_s))
        except Exception:  # the program has ended: a store gone with it costs the window, not the exit
            return

    def _drain(self, store: Any, world: int, until: float) -> None:
        while True:
            self._write_ready(store, self._writer(), world)
            if not self._pending or time.monotonic() >= until:
                return
            time.sleep(0.05)

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
        if torch.is_grad_enabled():  # an evaluation's forward is no training
            RECORDER.on_batch(*batch_size(inputs, kwargs))
        return forward(self, *inputs, **kwargs)

    recording_backward.__wrapped__ = backward  # type: ignore[attr-defined]
    counting_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    torch.Tensor.backward = recording_backward  # type: ignore[method-assign]
    DistributedDataParallel.forward = counting_forward  # type: ignore[method-assign]
    return RECORDER


def batch_size(inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[int, str]:
    """What one forward's batch holds, and in which unit: its tokens where it
    names them (`input_ids`: all their elements), else its samples (the first
    dimension of the first tensor); (0, samples) where it holds no tensor."""
    tokens = _tokens([kwargs, *inputs], DEPTH)
    if tokens is not None:
        return tokens, TOKENS
    rows = _rows([*inputs, *kwargs.values()], DEPTH)
    return (rows or 0), SAMPLES


def _tokens(values: Iterable[Any], depth: int) -> int | None:
    import torch

    for value in values:
        if isinstance(value, Mapping):
            found = value.get(TOKEN_KEY)
            if isinstance(found, torch.Tensor) and found.dim() > 0:
                return int(found.numel())
        if depth > 1 and isinstance(value, (Mapping, list, tuple)):
            inner = _tokens(value.values() if isinstance(value, Mapping) else value, depth - 1)
            if inner is not None:
                return inner
    return None


def _rows(values: Iterable[Any], depth: int) -> int | None:
    import torch

    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dim() > 0:
                return int(value.shape[0])
        elif depth > 1 and isinstance(value, (Mapping, list, tuple)):
            inner = _rows(value.values() if isinstance(value, Mapping) else value, depth - 1)
            if inner is not None:
                return inner
    return None
