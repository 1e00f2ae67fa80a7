"""A rich progress bar as a line every BAR_EVERY_S, where its output is no
terminal (a pipe, a file, a container's log: always, under ddpkit).

rich's `Live` display (which `rich.progress.Progress` and Lightning's
default `RichProgressBar` draw with) redraws itself only on a terminal;
anywhere else it prints nothing until it stops, then its final state. A
tqdm bar instead writes every state after a carriage return, and the
agent's tailing (agent/tailing.py) copies one state every PROGRESS_EVERY_S.
So here each `Live.refresh` that finds its console no terminal prints the
display's state as plain lines, the first at once and then at most one every
BAR_EVERY_S: the same cadence. A terminal, a Jupyter console and a nested
display are left as rich draws them.

rich is patched when the program imports `rich.live` (an import hook, so a
program without rich pays nothing for it), or at once where it is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

BAR_EVERY_S = 10.0  # the agent's PROGRESS_EVERY_S for a tqdm bar (agent/tailing.py): the same promise
MODULE = "rich.live"


class BarLines:
    """When each live display last printed its state, and the printing."""

    def __init__(self, every_s: float = BAR_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._printed: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def refreshed(self, live: Any) -> None:
        """After `live` refreshed: print its state when it is due."""
        console = live.console
        if console.is_terminal or console.is_jupyter or live._nested or not live.is_started:
            return
        now = self.clock()
        if now - self._printed.get(live, float("-inf")) < self.every_s:
            return
        with live._lock:
            text = plain(console, live.renderable)
            if text:  # a display with nothing in it yet (no task added) is no state to show
                self._printed[live] = now
                console.out(text, highlight=False)


def plain(console: Any, renderable: Any) -> str:
    """The renderable as the console would print it, without styles, trailing blanks or blank lines."""
    lines = console.render_lines(renderable, console.options, pad=False)
    text = ["".join(segment.text for segment in line).rstrip() for line in lines]
    return "\n".join(line for line in text if line)


LINES = BarLines()


def patch(module: ModuleType, lines: BarLines = LINES) -> None:
    """Make `module.Live.refresh` print its state through `lines` (once)."""
    live = module.Live
    refresh = live.refresh
    if getattr(refresh, "_ddpkit_lines", False):
        return

    def refresh_with_lines(self: Any) -> None:
        refresh(self)
        lines.refreshed(self)

    refresh_with_lines.__wrapped__ = refresh  # type: ignore[attr-defined]
    refresh_with_lines._ddpkit_lines = True  # type: ignore[attr-defined]
    live.refresh = refresh_with_lines


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once the module named `name` was executed. It
    finds nothing itself: it asks the finders after it, and wraps what the
    found loader executes."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: and the finders below never find this one again
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                self._wrap(spec.loader)
                return spec
        return None

    def _wrap(self, loader: Any) -> None:
        execute, then = loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            execute(module)
            then(module)

        loader.exec_module = exec_module


def install() -> None:
    """Patch rich's live display now, or when the program imports it."""
    module = sys.modules.get(MODULE)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, AfterImport) and f.name == MODULE for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(MODULE, patch))
