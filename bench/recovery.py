"""What the recovery benchmarks share (bench/elastic.py, bench/torchft_anchor.py):
waiting with a deadline, a run's work folder, taking a node away by each kind
of loss, one measurement per run, and the side-by-side table of medians.

A loss kind is how a node goes:
- crash: its agent and workers SIGKILLed (connections close: peers see it at once);
- freeze: its agent and workers SIGSTOPped (connections stay open, nothing
  answers: peers see it only by a timeout or a missing heartbeat);
- link: the host's link cut at the switch (network-namespace targets only;
  as freeze, but the processes run on).
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ddpkit.launch.supervise import proctree

LOSSES = ("crash", "freeze", "link")
T = TypeVar("T")


@dataclass(frozen=True)
class Measurement:
    """One run: a node lost at `killed_at_step`, the survivors trained again."""

    target: str
    variant: str  # "torchrun-defaults", "ddpkit-fast", "torchft" ("torchft-patched": its comm hook mended)
    loss: str  # one of LOSSES
    loss_to_first_step_s: float  # from the loss to the survivors' first completed step
    steps_lost: int  # completed steps the survivors train again (rolled back to a checkpoint)
    killed_at_step: int  # the last step completed before the loss
    resumed_from_step: int  # the step the survivors went on from
    discarded_in_flight: int = 0  # torchft: step attempts thrown away (not committed) after the loss
    survivor_restarted: bool = False  # torchft: the survivor's worker died and its torchrun started it again
    # ddpkit: where the time went, s: "to new workers" (the loss seen, the rendezvous, the agent's restart),
    # then the new rank 0's start-up phases (imports, rendezvous, model, data, ..., first step)
    restart_s: dict[str, float] = field(default_factory=dict)
    # the lost node's rank where it is not the last node (node 0: the one that held the rendezvous
    # store before the launchers hosted it); None: the last node, as every earlier run
    node: int | None = None

    @property
    def row(self) -> str:
        """The table's row label: the loss kind, and the node where it is not the last."""
        return self.loss if self.node is None else f"{self.loss}, node {self.node}"


def end_launcher(proc: subprocess.Popen[Any], wait_s: float = 120) -> None:
    """Ctrl-C's path: the launcher stops every node (within the grace chain)
    and exits; killed if it has not within `wait_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Polls until `predicate` returns something truthy, and returns that; raises
    TimeoutError(what) after `timeout` s (kept under the tests' 600 s limit, so a
    bench smoke test fails with the reason rather than a timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


@contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    """One run's temporary folder. A timeout inside carries the last lines of
    every `*.out` in it (the launcher's, the nodes', Slurm's): the folder is
    gone by the time anyone reads the failure, and "no step to kill at" alone
    says nothing of why."""
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        try:
            yield work
        except TimeoutError as exc:
            tails = "".join("\n" + tail(p, 15) for p in sorted(work.rglob("*.out")))
            raise TimeoutError(f"{exc}{tails}") from None


def tail(path: Path, lines: int = 40) -> str:
    """A file's last lines under a header naming it, for a failure message."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(none)"]
    return f"--- {path.name}, last {lines} lines:\n" + "\n".join(text[-lines:])


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and everything under it (a stopped process dies too)."""
    proctree.signal_all([*proctree.descendants(proc.pid), proc.pid], signal.SIGKILL)
    proc.wait(30)


def take_away(pids: list[int], loss: str) -> None:
    """crash or freeze the given processes (a node's agent and workers)."""
    if not pids:
        raise RuntimeError("no processes to take away: the node's agent was not found")
    proctree.signal_all(pids, signal.SIGKILL if loss == "crash" else signal.SIGSTOP)


def end_frozen(pids: list[int]) -> None:
    """A frozen node's processes are killed once the run is measured (SIGKILL reaches a stopped process)."""
    proctree.signal_all(pids, signal.SIGKILL)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(runs: list[Measurement]) -> dict[str, dict[str, dict[str, dict[str, float | int | None]]]]:
    """target -> row (the loss, and the node where not the last) -> variant -> medians (and the run
    count, and the spread of the time)."""
    out: dict[str, dict[str, dict[str, dict[str, float | int | None]]]] = {}
    for r in runs:
        cell = out.setdefault(r.target, {}).setdefault(r.row, {})
        same = [m for m in runs if (m.target, m.row, m.variant) == (r.target, r.row, r.variant)]
        times = [m.loss_to_first_step_s for m in same]
        cell[r.variant] = {"loss_to_first_step_s": median(times), "min_s": min(times), "max_s": max(times),
                           "steps_lost": median([float(m.steps_lost) for m in same]),
                           "discarded_in_flight": median([float(m.discarded_in_flight) for m in same]),
                           "runs": len(same)}
    return out


def ratio(a: float | int | None, b: float | int | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def table(runs: list[Measurement], variants: list[str]) -> str:
    """One line per target and loss kind: each ddpkit variant's median time
    from the loss to the survivors' first step (and steps lost), torchft's
    (the anchor, run on this machine) for the same loss kind, and each
    variant over torchft."""
    anchors = {loss: cell.get("torchft") or cell["torchft-patched"]
               for loss, cell in summary(runs).get("local", {}).items() if {"torchft", "torchft-patched"} & set(cell)}
    cells = summary([r for r in runs if not r.variant.startswith("torchft")])
    for loss in anchors:  # torchft alone for a loss: its row still prints
        cells.setdefault("local", {}).setdefault(loss, {})
    head = f"{'target':<7} {'loss':<14} " + " ".join(f"{v + ' s (lost)':>24}" for v in variants)
    head += f" {'torchft s (lost)':>17} " + " ".join(f"{v + '/torchft':>26}" for v in variants)
    lines = [head]
    for target, by_loss in cells.items():
        for loss, by_variant in by_loss.items():
            ft = anchors.get(loss, {})
            row = f"{target:<7} {loss:<14} " + " ".join(f"{_cell(by_variant.get(v)):>24}" for v in variants)
            row += f" {_cell(ft):>17} " + " ".join(
                f"{ratio((by_variant.get(v) or {}).get('loss_to_first_step_s'), ft.get('loss_to_first_step_s')):>26}"
                for v in variants)
            lines.append(row)
    return "\n".join(lines)


def _cell(medians: dict[str, float | int | None] | None) -> str:
    if not medians or medians["loss_to_first_step_s"] is None:
        return "-"
    return f"{medians['loss_to_first_step_s']:.1f} ({medians['steps_lost']:g})"
