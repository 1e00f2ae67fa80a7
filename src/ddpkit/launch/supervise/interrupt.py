"""Ctrl-C and SIGTERM as one KeyboardInterrupt, for the launchers.

A launcher started from a script or in the background inherits SIGINT
ignored (Python then installs no handler of its own), and a scheduler,
supervisor or CI timeout stops it with SIGTERM. Either way it must stop every
node it started instead of leaving them running without it.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Inside: SIGINT and SIGTERM raise KeyboardInterrupt. Afterwards the
    previous handlers are back, so the teardown that follows is not cut short
    by a second Ctrl-C unless the user's shell would deliver one anyway."""
    previous = {sig: signal.signal(sig, _raise) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
