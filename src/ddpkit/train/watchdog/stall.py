"""The hang watchdog's thread: publish this rank's heartbeat, judge (on the
monitor ranks), and on a stall dump every rank's stacks and stop the job.

Everything goes through the rendezvous store with a client of our own (never
a collective: those are what is stuck). On a stall, the monitor that saw it
first writes the `stall` key; every rank's thread sees it, writes its stacks
(faulthandler, `py-spy dump --native` when installed, the NCCL flight
recorder's buffer with NCCL) to a file in its log folder (stderr where it has none), acknowledges
with the frame its main thread is in, and waits for `released`; the
declaring monitor collects the acknowledgements, prints the report (lines
for people, and the `stall` record a launcher reads: stall_report.py),
writes the record to the metrics file, and releases everyone. Every rank
then exits with ExitCode.STALLED (os._exit, where an srun task leaves its
node's failure file first: agent/nodefailure.py); the ranks' launchers
(torchrun, srun, a pod) see a failed worker and stop the rest. The stacks themselves: stacks.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import records
from ...agent import nodefailure
from ...rendezvous import runkey
from ...shared.agreed import LOSS_S
from ...shared.exitcodes import ExitCode
from . import node_loss as loss_judge
from .control_store import open_store
from .stacks import dump_stacks
from .stall_model import PULSE, Beat, Judge, Phase, Settings, Verdict, monitors
from .stall_report import Ack, dump_place, report_lines, slow_start_line, stall_record, verdict_record
from .straggler import Stragglers

if TYPE_CHECKING:
    import torch.distributed as dist

STALL_KEY, RELEASED_KEY, WRITTEN_KEY, WRITER_KEY = "stall", "released", "last-step-written", "last-step-writer"
LEAVING_KEY, LEAVE_WAIT_S = "stall-leaving", 5.0  # rank 0 waits this long for the others to leave first
ACK_WAIT_S = 15.0  # the declaring monitor waits this long for every live rank's stacks
# On a lost node, the survivors wait this long for rank 0's last step from memory (a 1 GB state's write fits).
WRITTEN_WAIT_S = 60.0
CLAIM_DEFER_S = 1.0  # a rank other than 0 claims the last step's write only after rank 0 had this long
RELEASE_WAIT_S = 30.0  # a rank waits this long for the release, then exits anyway
# Here one multi_get of 8,192 keys took several times longer than 32 of 256 keys each.
MULTI_GET_KEYS = 256
RANKS_PER_CHECK_S = 2048  # the monitor checks once per interval up to this many ranks


@dataclass(frozen=True)
class Identity:
    rank: int
    world: int
    local_world: int
    node: int
    host: str
    pid: int


@dataclass(frozen=True)
class Outputs:
    """Where a stall's evidence goes (None: stderr only)."""

    log_dir: Path | None = None
    metrics: Path | None = None
    nccl: bool = False


def _hb(rank: int) -> str:
    return f"hb/{rank}"


def _ack(rank: int) -> str:
    return f"ack/{rank}"


class Watchdog:
    """One rank's watchdog thread (see the module docstring)."""

    def __init__(self, store: dist.Store, ident: Identity, settings: Settings, outputs: Outputs,
                 exit: Callable[[int], None] = nodefailure.exit_now, loss_s: float = LOSS_S) -> None:
        self.store, self.ident, self.settings, self.outputs = store, ident, settings, outputs
        # A node silent this long is lost (train/watchdog/node_loss.py); with stall_s
        # no longer than loss_s the stall verdict comes first, and alone.
        period = settings.interval_s * max(1, ident.world // RANKS_PER_CHECK_S)  # as check_every below
        self.loss = loss_judge.LossWatch(loss_s, period) if loss_s < settings.stall_s else None
        self.judge = Judge(ident.world, settings) if ident.rank in monitors(ident.world, ident.local_world) else None
        self._exit = exit
        self.loss_s = loss_s
        self._rank0_lost = False  # a verdict named rank 0 lost: another rank claims the last step at once
        self._stop = threading.Event()
        self._seq = 0
        self._step_times: deque[float] = deque(maxlen=20)
        self._last_step: tuple[int, float] | None = None
        self._initial_step = PULSE.step  # a step reported after this one ends the first-step allowance
        self._keys = [_hb(r) for r in range(ident.world)]
        # A check reads and decodes every heartbeat (about 50 ms of Python at
        # 8,192 ranks, bench/watchdog.py): past RANKS_PER_CHECK_S ranks the
        # monitor checks less often, a delay of seconds against a limit of a minute.
        self.check_every = max(1, ident.world // RANKS_PER_CHECK_S)
        self._all_published = False
        # Stragglers ride on this thread: every rank publishes its own work, rank 0 judges (train/watchdog/straggler.py).
        self.stragglers = Stragglers(store, ident.rank, ident.world, ident.node, ident.host, outputs.metrics)
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)
        # Called with the reason before this rank leaves on a verdict: rank 0
        # writes its last completed step there (train/checkpoint/last_step.py).
        self.last_words: Callable[[str], object] | None = None

    def start(self) -> None:
        self.publish()  # at once: the monitors see every rank from its start
        self._thread.start()

    def retire(self) -> None:
        """Stop without a word: another watchdog of this process publishes this
        rank's heartbeat from now on."""
        self._stop.set()

    def stop(self) -> None:
        """Training ended: say so (a finished rank is not a stalled one) and stop."""
        PULSE.phase = Phase.DONE
        self._stop.set()
        self._thread.join(timeout=5 * self.settings.interval_s)
        with contextlib.suppress(Exception):  # the store may be gone with rank 0's agent
            self.publish()

    # ---- the thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.tick(time.monotonic())
            except Exception as exc:  # a store that went away ends the job some other way; say why we stop
                if not self._stop.is_set():
                    print(f"ddpkit watchdog: rank {self.ident.rank}: stopped watching ({exc})", file=sys.stderr)
                return

    def tick(self, now: float) -> None:
        """One round: publish, judge (monitors), act on a stall."""
        self.publish(now)
        if self.judge is not None and self._seq % self.check_every == 0:
            verdict = self._check(now)
            if verdict is not None:
                self.store.compare_set(STALL_KEY, "", json.dumps(verdict_record(verdict, self.ident.rank)))
            else:
                self._judge_loss(now)
                self._name_slow_starters(now)
        if self._seq % self.check_every == 0:
            self.stragglers.check()
        if self.store.check([STALL_KEY]):  # the one verdict key: a stall, or a lost node
            record = json.loads(self.store.get(STALL_KEY))
            if record.get("kind") == records.NodeLost.kind:
                lost = records.from_fields(record).record
                assert isinstance(lost, records.NodeLost)
                self.on_lost(lost)
            self.on_stall(record)

    def publish(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._seq += 1
        beat = Beat(self.ident.rank, self._seq, PULSE.beats, PULSE.step, PULSE.phase, self._step_s(now),
                    PULSE.step != self._initial_step, self.ident.node, self.ident.pid, self.ident.host)
        self.store.set(_hb(self.ident.rank), beat.encode().decode())  # the stub takes str; bytes go the same way
        self.stragglers.publish()

    def _step_s(self, now: float) -> float:
        """The slowest of the last steps' times, measured here between publishes.
        An evaluation or a checkpoint restarts the measurement (it is not a step)."""
        step, phase = PULSE.step, PULSE.phase
        if phase in (Phase.EVAL, Phase.CHECKPOINT, Phase.SETUP, Phase.SYNC):
            self._last_step = None
        elif self._last_step is None or step < self._last_step[0]:
            self._last_step = (step, now)
        elif step > self._last_step[0]:
            self._step_times.append((now - self._last_step[1]) / (step - self._last_step[0]))
            self._last_step = (step, now)
        return max(self._step_times, default=0.0)

    def _check(self, now: float) -> Verdict | None:
        assert self.judge is not None
        if not self._all_published:
            self._all_published = self.store.check(self._keys)
        if self._all_published:
            raws = [raw for at in range(0, len(self._keys), MULTI_GET_KEYS)
                    for raw in self.store.multi_get(self._keys[at:at + MULTI_GET_KEYS])]
            beats: list[Beat | None] = [Beat.decode(r, raw) for r, raw in enumerate(raws)]
        else:  # a rank still starting: judge the others (one get each, only until all have published)
            beats = [Beat.decode(r, self.store.get(k)) if self.store.check([k]) else None
                     for r, k in enumerate(self._keys)]
        return self.judge.observe(beats, now)

    def _name_slow_starters(self, now: float) -> None:
        assert self.judge is not None
        waited, slow = self.judge.slow_starters(now)
        for beat in slow if self.ident.rank == 0 else ():  # rank 0 says it; the backup monitor only judges
            print(slow_start_line(beat, waited), file=sys.stderr, flush=True)

    # ---- on a lost node (train/watchdog/node_loss.py) --------------------------------------------
    def _judge_loss(self, now: float) -> None:
        assert self.judge is not None
        lost = [] if self.loss is None else self.loss.observe(self.judge, now)
        if lost and self.loss is not None:
            verdict = loss_judge.verdict(lost, self.loss.loss_s, self.ident.rank, loss_judge.elastic_restarts_left())
            self.store.compare_set(STALL_KEY, "", records.encode(verdict))

    def on_lost(self, verdict: records.NodeLost) -> None:
        """Every rank leaves with NODE_LOST: its main thread may wait in a
        collective with the lost node that gloo cannot abort. The declarer
        reports first. The lowest surviving rank (rank 0 unless its node is
        the one lost) writes the last completed step, where no other rank
        claimed that write first; each other rank waits for the write (up to
        WRITTEN_WAIT_S, and only while the writer's heartbeats go on), says
        so and leaves: a survivor that left sooner would have its agent
        re-form the job, and the writer's agent would stop it mid-write. The
        writer, whose process may hold the store (rank 0), leaves last (once
        every other rank said so, or after ACK_WAIT_S). Never returns."""
        self._stop.set()
        try:
            if verdict.by == self.ident.rank:
                loss_judge.report(verdict, self.outputs.metrics)
            lost = {r.rank for r in verdict.lost}
            self._rank0_lost = 0 in lost
            writer = min(r for r in range(self.ident.world) if r not in lost)
            if self.ident.rank == writer:
                if self.last_words is None:  # no trainer writes here (a program's own): nothing to wait for
                    self.last_step_written()
                with self._beating():  # this thread writes: the others still see the writer alive
                    self._last_words(loss_judge.reason(verdict))
                keys = [_ack(r) for r in range(self.ident.world) if r not in lost and r != writer]
                deadline = time.monotonic() + ACK_WAIT_S
                while time.monotonic() < deadline and not self.store.check(keys):
                    time.sleep(0.1)
            else:
                self._wait_for_last_step(writer)
                self.store.set(_ack(self.ident.rank), verdict.kind)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self._exit(ExitCode.NODE_LOST)

    # ---- on a stall ----------------------------------------------------------------------
    def on_stall(self, record: dict[str, Any]) -> None:
        """Dump, acknowledge, (declarer:) report, then exit STALLED. Never returns."""
        self._stop.set()
        try:  # whatever fails here (the store's host gone), this rank still exits
            self.store.set(_ack(self.ident.rank), json.dumps(asdict(self._dump())))
            suspects = ", ".join(str(r["rank"]) for r in record.get("suspects", []))
            self._last_words(f"the job stalled: no progress for {record.get('idle_s')}s (rank(s) {suspects})")
            if record["by"] == self.ident.rank:
                self._report(record)
                self.store.set(RELEASED_KEY, "1")
            else:
                self._wait_for(RELEASED_KEY, RELEASE_WAIT_S)
            self._leave_last_on_rank0(self.ident.world - len(record.get("frozen", [])))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self._exit(ExitCode.STALLED)

    def _leave_last_on_rank0(self, leaving: int) -> None:
        """Rank 0's process may hold the store (an srun task: the process group's): it leaves
        once the `leaving` ranks that read the release said so, so that none asks a store that
        is gone (c10d's warning and its C++ frames on that rank's stderr)."""
        done, deadline = int(self.store.add(LEAVING_KEY, 1)), time.monotonic() + LEAVE_WAIT_S
        while self.ident.rank == 0 and done < leaving and time.monotonic() < deadline:
            time.sleep(0.1)
            done = int(self.store.add(LEAVING_KEY, 0))

    def claim_last_step(self) -> bool:
        """Whether this rank is the one to write the last completed step of this
        loss: the first rank to ask, from either thread of any rank. Rank 0
        asks at once; the others give it CLAIM_DEFER_S first, so that where it
        lives it writes (its log says so), unless a verdict named it lost."""
        if self.ident.rank != 0 and not self._rank0_lost:
            deadline = time.monotonic() + CLAIM_DEFER_S
            while time.monotonic() < deadline and not self.store.check([WRITER_KEY]):
                time.sleep(0.05)
        mine = str(self.ident.rank).encode()
        return bytes(self.store.compare_set(WRITER_KEY, "", mine.decode())) == mine

    def last_step_written(self) -> None:
        """The writer is done with the last completed step (or found nothing to
        write), from this thread or from the main thread's failure path: the
        other ranks may leave."""
        with contextlib.suppress(Exception):  # the store's host gone: nobody waits
            self.store.set(WRITTEN_KEY, "1")

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Heartbeats from a thread of their own while this one is busy."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.settings.interval_s):
                with contextlib.suppress(Exception):
                    self.publish()

        thread = threading.Thread(target=beat, name="ddpkit-watchdog-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()

    def _wait_for_last_step(self, writer: int) -> None:
        """Until the last step is written, at most WRITTEN_WAIT_S; not once the
        writer's heartbeats stopped for loss_s: it died writing (its node lost
        too), and its agent's SIGTERM cannot reach this rank's main thread,
        which waits in a collective, so only leaving ends this rank."""
        deadline = time.monotonic() + WRITTEN_WAIT_S
        seq, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            try:
                if self.store.check([WRITTEN_KEY]):
                    return
                beat = Beat.decode(writer, self.store.get(_hb(writer))) if self.store.check([_hb(writer)]) else None
            except Exception:  # the store's host exited: nothing more to wait for
                return
            now = time.monotonic()
            if beat is not None and beat.seq != seq:
                seq, since = beat.seq, now
            elif now - since > self.loss_s:
                print(f"ddpkit watchdog: rank {self.ident.rank}: rank {writer} fell silent for {self.loss_s:g}s "
                      "while writing the last step; leaving without it", file=sys.stderr, flush=True)
                return
            time.sleep(0.2)

    def _last_words(self, reason: str) -> None:
        if self.last_words is not None:
            self.last_words(reason)

    def _wait_for(self, key: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.store.check([key]):
                    return True
            except Exception:  # the store's host exited: nothing more to wait for
                return False
            time.sleep(0.2)
        return False

    def _dump(self) -> Ack:
        who = f"rank {self.ident.rank} ({self.ident.host}, pid {self.ident.pid})"
        return dump_stacks(self.ident.rank, f"{who} at step {PULSE.step}, phase {PULSE.phase.value}",
                           self.outputs.log_dir, self.outputs.nccl)

    def _report(self, record: dict[str, Any]) -> None:
        expected = [r for r in range(self.ident.world) if r not in record["frozen"]]
        deadline = time.monotonic() + ACK_WAIT_S
        acks: dict[int, Ack] = {}
        while time.monotonic() < deadline and len(acks) < len(expected):
            for r in expected:
                if r not in acks and self.store.check([_ack(r)]):
                    acks[r] = Ack(**json.loads(self.store.get(_ack(r))))
            time.sleep(0.2)
        report = stall_record(record, acks, self.ident.world, dump_place(acks, self.outputs.nccl))
        for line in report_lines(report, [s["rank"] for s in record["suspects"]]):
            print(line, file=sys.stderr, flush=True)
        records.emit(report)
        if self.outputs.metrics is not None:
            records.append(self.outputs.metrics, report, time.time())


# ---- starting it --------------------------------------------------------------------------
_RUNNING: list[Watchdog] = []  # this process's watchdog: one, whoever started it (running())


def running() -> Watchdog | None:
    """The watchdog `start` started in this process, if any."""
    return _RUNNING[-1] if _RUNNING else None


def start(ident: Identity, master_addr: str | None, master_port: int | None, outputs: Outputs,
          settings: Settings | None = None, loss_s: float = LOSS_S) -> Watchdog | None:
    """Start this rank's watchdog thread; None when the settings turn it off."""
    settings = settings or Settings.from_env()
    if not settings.enabled:
        return None
    if ident.rank == 0 and master_addr and runkey.key_from() is None:  # a network store, open to any client
        print(runkey.UNKEYED_NOTE, file=sys.stderr, flush=True)
    dog = Watchdog(open_store(master_addr, master_port, ident.rank), ident, settings, outputs, loss_s=loss_s)
    # One publisher per rank: ddpkit train's watchdog, started inside a program of the user's
    # own, takes over from the one the program's start-up started (two would judge twice).
    for earlier in _RUNNING:
        earlier.retire()
    dog.start()
    _RUNNING.append(dog)
    return dog
