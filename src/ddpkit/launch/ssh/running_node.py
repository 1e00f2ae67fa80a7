"""One running node of an SSH launch: its channel, output, log and teardown.

An SshNode is the SSH launcher's NodeHandle (see supervisor). Each node
streams on its own thread and tells the supervisor when it ended, so one
slow or dead host never holds up the others.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import paramiko

from ...targets.sshnode import NodeCommand, parse_pgid
from ..prelude import replay_held_stop
from ..supervise.nodeoutput import NO_EXIT_STATUS, LinePrinter
from .connect import SSH_ERRORS, ConnectError, Endpoint, SshSettings, close, connect
from .keepalive import KeepAlive
from .preflight import GO
from .preflight import verdict as verdict_line

DROPPED = NO_EXIT_STATUS  # paramiko's exit status when a channel closes without one


@dataclass
class SshNode:
    rank: int
    endpoint: Endpoint
    command: NodeCommand
    client: paramiko.SSHClient
    # The preflight's session, paused before the node command (see preflight).
    channel: paramiko.Channel
    stream: paramiko.ChannelFile
    settings: SshSettings
    log_path: Path
    attempt: int = 0  # elastic: how many times this node was started before (its log is appended to)
    # Written right after GO: the secrets' values, which the node script reads
    # from its stdin (launch.secrets.stdin_payload); never on a command line.
    secrets: bytes = field(default=b"", repr=False)
    verdict: bytes = verdict_line(GO)  # what starts it at the gate (preflight.Start)
    pgid: int | None = None
    status: int | None = None
    started: threading.Event = field(default_factory=threading.Event)
    _printer: LinePrinter | None = None
    _went: bool = False  # the verdict was sent: there is something to stop
    _thread: threading.Thread | None = None
    _keepalive: KeepAlive | None = None

    @property
    def index(self) -> int:
        return self.rank

    @property
    def host(self) -> str:
        return self.endpoint.alias

    @property
    def label(self) -> str:
        return f"node{self.rank} {self.endpoint.alias}"

    def start(self, printer: LinePrinter, exited: Callable[[], None]) -> None:
        replay_held_stop()  # a detached run's cancel that came before the supervisor's handlers
        self._printer = printer
        try:
            self.channel.sendall(self.verdict + self.secrets)
        except SSH_ERRORS as exc:
            printer.line(self, f"ddpkit: could not start: {exc}")
            self.status = DROPPED
            self.started.set()
            exited()
            return
        self._went = True
        self._thread = threading.Thread(target=self._pump, args=(exited,), name=self.label, daemon=True)
        self._thread.start()
        transport = self.client.get_transport()
        if transport is not None:
            self._keepalive = KeepAlive(transport, self.settings.alive_interval_s, self.settings.alive_count,
                                        self.label)
            self._keepalive.start()

    def _pump(self, exited: Callable[[], None]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a" if self.attempt else "w", encoding="utf-8") as log:
            try:
                for raw in self.stream:
                    self._line(raw.decode("utf-8", "replace").rstrip("\r\n"), log)
            except SSH_ERRORS as exc:
                self._line(f"ddpkit: connection dropped: {exc}", log)
            self.status = self.channel.recv_exit_status()
            if self.status == DROPPED:
                self._line(f"ddpkit: {self.drop_reason}", log)
        self.started.set()
        exited()

    def exit_code(self) -> int | None:
        return self.status

    def no_status_reason(self) -> str:
        return self.drop_reason

    @property
    def drop_reason(self) -> str:
        if self._keepalive is not None and self._keepalive.unanswered:
            return (f"host stopped answering (no reply to a keepalive for {self._keepalive.deadline_s:g} s; "
                    "down or cut off?)")
        return "connection closed without an exit status"

    def _line(self, line: str, log: TextIO) -> None:
        if self.pgid is None:
            self.pgid = parse_pgid(line)
            if self.pgid is not None:
                self.started.set()
                return
        log.write(line + "\n")
        log.flush()
        assert self._printer is not None
        self._printer.line(self, line)

    def stop(self, grace_s: float) -> str | None:
        """TERM the node's process group, KILL after the grace period (the
        stop script's, ssh.grace_s), then wait for its output to end. Uses a
        fresh connection when this one has dropped. Returns a problem, if any."""
        problem = self._stop_group(grace_s)
        self.join(grace_s + self.settings.timeout_s)
        return problem

    def _stop_group(self, grace_s: float) -> str | None:
        if not self._went:
            return None
        self.started.wait(self.settings.timeout_s)
        if self.pgid is None:
            return None
        # A node that already ended is stopped too: orphans it left behind
        # would still sit in its process group.
        client, fresh = self.client, False
        transport = client.get_transport()
        if transport is None or not transport.is_active():
            try:
                client, fresh = connect(self.endpoint, self.settings), True
            except ConnectError as exc:
                return f"{self.label}: cannot reconnect to stop it: {exc}"
        try:
            _, stdout, _ = client.exec_command(self.command.stop(self.pgid, grace_s),
                                               timeout=self.settings.timeout_s + grace_s + 60)
            stdout.channel.recv_exit_status()
        except SSH_ERRORS as exc:  # the transport looked alive, the host was cut off under it
            return f"{self.label}: stop failed: {exc or type(exc).__name__}"
        finally:
            if fresh:
                close(client)
        return None

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop()
        self.channel.close()
        close(self.client)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
