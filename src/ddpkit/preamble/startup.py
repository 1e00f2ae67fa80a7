"""A rank still in start-up while the others wait for it, in a program of
the user's own (docs/guides/hangs.md, "A rank stuck before its first step").

Once the program's `init_process_group` returns, the rank's hang watchdog
starts (progress.py's StepCounter starts it), in phase setup, which is not
judged alone: a start-up may be long. Until the first optimizer step the
liveness sampler (progress.py) looks at the main thread once a second and
sets the phase from what it sees: waiting in a collective (DDP's broadcast
of the parameters, a barrier, the first backward's all-reduce) is phase
sync, which the judge times with `first_step_s`; anything else (a
checkpoint's `torch.load`, the data loader's first batch, a lock) is setup.
When no rank made progress for `first_step_s` while one waits, the judge
names the ranks still in setup, with the line each sits on. A rank in setup
that shows signs of life (its stack changes, it keeps giving up the CPU: a
slow read that moves) keeps the job from being judged stalled.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..train.watchdog import stall_model as _wd
from ..train.watchdog.stacks import torch_folder

# torch's code in which a thread waits for the other ranks: c10d's collectives,
# DDP's construction and forward, autograd's backward (DDP's all-reduce runs in it).
COLLECTIVE_CODE = ("distributed", os.path.join("nn", "parallel"), "autograd")


def install(on_group: Callable[[], None]) -> None:
    """Call `on_group` each time the program's init_process_group returned."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group
    if getattr(original, "__ddpkit_start_up__", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        on_group()

    init_process_group.__ddpkit_start_up__ = True  # type: ignore[attr-defined]
    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    init_process_group.__doc__ = original.__doc__
    dist.init_process_group = init_process_group
    distributed_c10d.init_process_group = init_process_group


def waits_in_a_collective(frame: FrameType | None) -> bool:
    """Whether a thread whose innermost frame is `frame` sits in torch's
    collective code: only the frames of torch above the program's innermost
    own frame count (not a forward of the program's model, which DDP's
    forward calls, nor torch.load or the data loader, nor torchrun's `record`
    wrapper far below around the program's main)."""
    torch_dir = torch_folder()
    places = tuple(os.path.join(torch_dir, part) + os.sep for part in COLLECTIVE_CODE)
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        if frame.f_code.co_filename.startswith(places):
            return True
        frame = frame.f_back
    return False


def follow(frame: FrameType | None) -> None:
    """Set the start-up phase (sync or setup) from the main thread's `frame`;
    nothing once the rank left start-up (its first step, a checkpoint write)."""
    now = _wd.Phase.SYNC if waits_in_a_collective(frame) else _wd.Phase.SETUP
    if _wd.PULSE.phase in _wd.START_UP and _wd.PULSE.phase is not now:
        _wd.mark(now)
