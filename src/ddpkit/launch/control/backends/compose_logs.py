"""A compose run's output as `ddpkit logs` shows every run's: `docker
compose logs` read once per command, each container's lines with the
console's prefix (`[node0]`, `[node0 rank1]` where torchrun tagged the
line; the store's service as `[rdzv]`), a record frame left out. Once: a
batch per service, in node order, its last `tail` lines. Followed: that,
then `logs --follow`'s lines as they come, its replay of what was already
shown skipped (it starts each container's output from its beginning), until
the run has ended."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .... import records
from ..applied import TOOL_S, last_error
from ..common import POLL_S, RunCommandError
from ..logs import LogRequest

ASK_EVERY_S = 2.0  # how often a follow asks whether the run has ended: a `docker compose ps` each time
END_S = 10.0  # once it has, how long the follower may take to pass on the containers' last lines
QUIET_S = 2.0  # ... and how long it may say nothing before they are taken to be all
READ_S = TOOL_S * 4  # one `logs` of a whole run: longer than a query, bounded all the same

Order = Callable[[str], tuple[int, str]]


def service_line(line: str) -> tuple[str, str] | None:
    """(service, text) of a `docker compose logs` line (`node1-1  | text`:
    the container's service and replica); None for a line without one."""
    head, bar, text = line.partition("|")
    container = head.strip()
    if not bar or not container or " " in container:
        return None
    service, dash, replica = container.rpartition("-")
    return (service if dash and replica.isdecimal() else container), text.removeprefix(" ")


def shown(service: str, text: str, rank: int | None) -> str | None:
    """A container's line as `ddpkit logs` prints it, or None to leave it out:
    a frame, or another rank's tagged line when one rank was asked for."""
    number = service.removeprefix("node")
    if not number.isdecimal():
        return None if records.is_frame(text) else f"[{service}] {text}"
    tag = records.rank_tagged(text)
    if rank is not None and tag is not None and tag[0] != rank:
        return None
    body = tag[1] if tag else text
    if records.is_frame(body):
        return None
    return f"[node{number} rank{tag[0]}] {body}" if tag else f"[node{number}] {text}"


@dataclass
class ComposeLogs:
    """`words`: `docker compose -f FILE -p PROJECT logs --no-color [SERVICE]`;
    `active`: whether the run still runs (asked while following)."""

    words: list[str]
    request: LogRequest
    active: Callable[[], bool]
    order: Order
    shown_once: dict[str, int] = field(default_factory=dict)  # each service's lines read once: the follower replays them
    followed: dict[str, int] = field(default_factory=dict)  # each service's lines the follower passed on

    def __iter__(self) -> Iterator[list[str]]:
        for service, texts in self._once():
            self.shown_once[service] = len(texts)
            lines = [s for text in texts if (s := shown(service, text, self.request.rank)) is not None]
            if self.request.tail is not None:
                lines = lines[-self.request.tail:] if self.request.tail > 0 else []
            yield lines
        if self.request.follow:
            yield from self._followed()

    def _once(self) -> list[tuple[str, list[str]]]:
        try:
            done = subprocess.run(self.words, capture_output=True, text=True, errors="replace", check=False,
                                  timeout=READ_S)
        except subprocess.TimeoutExpired:
            raise RunCommandError(f"docker compose logs gave no answer in {READ_S:g} s") from None
        if done.returncode != 0:
            raise RunCommandError(f"docker compose logs: {last_error(done)}")
        by_service: dict[str, list[str]] = {}
        for line in done.stdout.split("\n"):  # as the follower reads them: text mode made \r\n and \r a \n
            parsed = service_line(line)
            if parsed is not None:
                by_service.setdefault(parsed[0], []).append(parsed[1])
        return sorted(by_service.items(), key=lambda item: self.order(item[0]))

    def _followed(self) -> Iterator[list[str]]:
        """`logs --follow`'s new lines a batch per poll; once `active()` says the
        run has ended, those the follower still passes on: until it ends (every
        container stopped), is quiet for QUIET_S (a paused one never stops), or END_S."""
        came: queue.Queue[str | None] = queue.Queue()
        with subprocess.Popen([*self.words, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, errors="replace") as proc:
            threading.Thread(target=_pass_on, args=(proc, came), daemon=True).start()
            asked = last_line = time.monotonic()
            ended_at: float | None = None
            try:
                while True:
                    lines, finished = self._drain(came)
                    yield lines
                    now = time.monotonic()
                    last_line = now if lines else last_line
                    if finished or (ended_at is not None and (now - last_line >= QUIET_S or now - ended_at >= END_S)):
                        return
                    if ended_at is None and now - asked >= ASK_EVERY_S:
                        asked = now
                        ended_at = None if self.active() else now
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:
                    proc.terminate()

    def _drain(self, came: queue.Queue[str | None]) -> tuple[list[str], bool]:
        """The lines the follower passed on since the last drain, those it
        replays skipped; whether it ended."""
        lines: list[str] = []
        while True:
            try:
                line = came.get_nowait()
            except queue.Empty:
                return lines, False
            if line is None:
                return lines, True
            parsed = service_line(line.rstrip("\n"))
            if parsed is None:
                continue
            service, text = parsed
            self.followed[service] = self.followed.get(service, 0) + 1
            if self.followed[service] > self.shown_once.get(service, 0):
                picked = shown(service, text, self.request.rank)
                lines += [] if picked is None else [picked]


def _pass_on(proc: subprocess.Popen[str], came: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        came.put(line)
    came.put(None)
