"""A rich progress bar as lines where its output is no terminal (the
preamble's bars.py): a real rich `Progress` on a console that writes to a
file, on a fake clock, read as the user reads it; the control, rich alone,
prints nothing until the bar stops. The bar under `launch local` is
tests/test_own_frameworks.py."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator

import pytest
import rich.live
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ddpkit.agent import tailing
from ddpkit.preamble import bars


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    """rich's Live patched for one test, its lines on a fake clock."""
    fake = Clock()
    monkeypatch.setattr(rich.live.Live, "refresh", rich.live.Live.refresh)
    bars.patch(rich.live, bars.BarLines(clock=fake))
    yield fake


def drive(out: io.StringIO, clock: Clock | None, steps: int = 100, step_s: float = 0.5) -> list[tuple[int, str]]:
    """A bar of `steps` steps of `step_s` on a console that is no terminal, as
    Lightning drives its own (auto_refresh off, a refresh per update): each
    line printed while the bar runs, with the step it was printed at."""
    console = Console(file=out, width=60)
    assert not console.is_terminal
    seen: list[tuple[int, str]] = []
    with Progress(TextColumn("Epoch 0"), BarColumn(bar_width=10), MofNCompleteColumn(), console=console,
                  auto_refresh=False) as progress:
        task = progress.add_task("train", total=steps)
        for step in range(1, steps + 1):
            if clock is not None:
                clock.now += step_s
            progress.update(task, completed=step, refresh=True)
            seen += [(step, line) for line in out.getvalue().splitlines()[len(seen):]]
    return seen


def test_a_bar_on_no_terminal_prints_a_line_at_once_then_every_ten_seconds(clock: Clock) -> None:
    out = io.StringIO()
    seen = drive(out, clock)  # 100 steps of 0.5 s: 50 s
    # at once (the task added, at 0 s), then every 20 steps: every 10 s
    assert [line.split()[-1] for _, line in seen] == ["0/100", "20/100", "40/100", "60/100", "80/100", "100/100"]
    assert all(line.startswith("Epoch 0 ") for _, line in seen)
    final = out.getvalue().splitlines()[len(seen):]
    assert [line.split()[-1] for line in final] == ["100/100"]  # rich's own final state, as before
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()  # plain lines: nothing to leak


def test_control_rich_alone_prints_nothing_until_the_bar_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rich.live.Live, "refresh", getattr(rich.live.Live.refresh, "__wrapped__",
                                                           rich.live.Live.refresh))
    out = io.StringIO()
    assert drive(out, None) == []  # nothing while it ran: what the user saw
    assert [line.split()[-1] for line in out.getvalue().splitlines()] == ["100/100"]


def test_a_terminal_is_left_as_rich_draws_it(clock: Clock) -> None:
    out = io.StringIO()
    console = Console(file=out, width=60, force_terminal=True)
    with Progress(TextColumn("Epoch 0"), console=console, auto_refresh=False) as progress:
        task = progress.add_task("train", total=10)
        for step in range(1, 11):
            clock.now += 5
            progress.update(task, completed=step, refresh=True)
    assert out.getvalue().count("\n") <= 2  # redrawn in place, not a line per refresh


def test_the_cadence_is_the_agents_for_a_tqdm_bar() -> None:
    assert bars.BAR_EVERY_S == tailing.PROGRESS_EVERY_S


def test_rich_is_patched_when_the_program_imports_it_and_not_before() -> None:
    code = ("import sys; from ddpkit.preamble import bars; bars.install();"
            "assert 'rich.live' not in sys.modules;"
            "import rich.live; assert rich.live.Live.refresh._ddpkit_lines;"
            "assert not any(isinstance(f, bars.AfterImport) for f in sys.meta_path); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == "ok\n", done.stderr
