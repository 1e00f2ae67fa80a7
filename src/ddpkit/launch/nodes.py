"""One running node of an SSH launch: its channel, output, log and teardown.

Each node streams on its own thread; the launcher only learns "node i
ended with status s" through a queue, so one slow or dead host never holds
up the others.
"""

from __future__ import annotations

import queue
import re
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import paramiko

from ..targets.sshnode import NodeCommand, parse_pgid
from .alive import Heartbeat
from .conn import ConnectError, Endpoint, SshSettings, close, connect
from .preflight import GO

DROPPED = -1  # paramiko's exit status when a channel closes without one
TAIL_LINES = 20
_OUTPUT_LOCK = threading.Lock()


@dataclass
class NodeRun:
    rank: int
    endpoint: Endpoint
    command: NodeCommand
    client: paramiko.SSHClient
    # The preflight's session, paused before the node command (see preflight).
    channel: paramiko.Channel
    stream: paramiko.ChannelFile
    settings: SshSettings
    log_path: Path
    out: TextIO = sys.stdout
    pgid: int | None = None
    status: int | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    started: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _heartbeat: Heartbeat | None = None

    @property
    def label(self) -> str:
        return f"node{self.rank} {self.endpoint.alias}"

    def start(self, events: queue.Queue[NodeRun]) -> None:
        try:
            self.channel.sendall(GO)
        except (OSError, paramiko.SSHException) as exc:
            self.tail.append(f"ddpkit: could not start: {exc}")
            self.status = DROPPED
            self.started.set()
            events.put(self)
            return
        self._thread = threading.Thread(target=self._pump, args=(events,), name=self.label, daemon=True)
        self._thread.start()
        transport = self.client.get_transport()
        if transport is not None:
            self._heartbeat = Heartbeat(transport, self.settings.alive_interval_s, self.settings.alive_count,
                                        self.label)
            self._heartbeat.start()

    def _pump(self, events: queue.Queue[NodeRun]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w", encoding="utf-8") as log:
            try:
                for raw in self.stream:
                    self._line(raw.decode("utf-8", "replace").rstrip("\r\n"), log)
            except (OSError, paramiko.SSHException) as exc:
                self._line(f"ddpkit: connection lost: {exc}", log)
            self.status = self.channel.recv_exit_status()
            if self.status == DROPPED:
                self._line(f"ddpkit: {self.drop_reason}", log)
        self.started.set()
        events.put(self)

    @property
    def drop_reason(self) -> str:
        if self._heartbeat is not None and self._heartbeat.lost:
            return (f"host stopped answering (no reply to a keepalive for {self._heartbeat.deadline_s:g} s; "
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
        self.tail.append(line)
        with _OUTPUT_LOCK:
            self.out.write(f"[{self.label}] {line}\n")
            self.out.flush()

    def stop(self) -> str | None:
        """TERM the node's process group, KILL after the grace period. Uses
        a fresh connection when this one has dropped. Returns a problem, if any."""
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
            _, stdout, _ = client.exec_command(self.command.stop(self.pgid), timeout=self.settings.timeout_s + 60)
            stdout.channel.recv_exit_status()
        except (OSError, paramiko.SSHException) as exc:
            return f"{self.label}: stop failed: {exc}"
        finally:
            if fresh:
                close(client)
        return None

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.channel.close()
        close(self.client)


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
