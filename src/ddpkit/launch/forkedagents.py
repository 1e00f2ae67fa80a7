"""launch local's end of the agents' fork server (agent/forkserver.py): one
process per run imports torch, torchrun and the workers' preload once, and
every node's agent is forked from it, where each would otherwise start an
interpreter and import them again (about 4 of the 5 CPU-seconds a node
costs to start).

A ForkedAgent answers what the supervisor asks of a Popen (pid, stdout,
poll, wait); the server tells when an agent ends and with what code. Where
the server cannot fork (it did not start or answer, DDPKIT_AGENT_FORK=0,
not Linux, an interpreter without ddpkit), `spawn` returns None and the
caller starts that agent with Popen, as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import IO, cast

from ..shared import envnames

SERVER_MODULE = "ddpkit.agent.forkserver"
# How long a spawn waits for the server's answer: its imports (a few seconds;
# minutes only on a machine in trouble) come before its first answer.
SPAWN_REPLY_S = 120.0


def forks(env: dict[str, str]) -> bool:
    """Whether agents are forked (Linux only; off with DDPKIT_AGENT_FORK=0, as the zygote)."""
    return sys.platform.startswith("linux") and env.get(envnames.DDPKIT_AGENT_FORK, "1") != "0"


class ForkedAgent:
    """One agent the server forked: what the supervisor reads of a Popen."""

    def __init__(self, server: AgentServer, pid: int, stdout: IO[bytes], argv: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.stdout = stdout
        self.args = argv

    def poll(self) -> int | None:
        return self.server.returncode(self.pid, 0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.returncode(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


class AgentServer:
    """The launcher's end: asks for agents, hears of their exits."""

    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection, log: Path | None = None) -> None:
        self.proc = proc
        self.log = log
        self._conn = conn
        self._send = threading.Lock()
        self._news = threading.Condition()
        self._answers: deque[tuple[str, object]] = deque()
        self._exits: dict[int, int] = {}
        self.alive = True
        threading.Thread(target=self._read, name="agent fork server", daemon=True).start()

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], log: Path | None) -> AgentServer | None:
        """The server, run by the agents' interpreter (argv[0]) with `env`
        (what every node's environment shares); `argv`, the longest agent
        line, sizes its argument area for the agents' lines. None when it
        cannot be started."""
        if not forks(env) or argv[1:3] != ["-m", "ddpkit.agent"]:
            return None
        ours, theirs = socket.socketpair()
        try:
            with contextlib.ExitStack() as stack:
                err: IO[bytes] | int = subprocess.DEVNULL
                if log is not None:  # where its import error, if any, is
                    log.parent.mkdir(parents=True, exist_ok=True)
                    err = stack.enter_context(log.open("ab"))
                proc = subprocess.Popen([argv[0], "-m", SERVER_MODULE, str(theirs.fileno()), *argv[3:]], env=env,
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(proc, Connection(ours.detach()), log)

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedAgent | None:
        """The agent `argv` forked with `env`, its stdout and stderr on a new
        pipe; None when the server cannot fork it (the caller starts it
        with Popen) and from then on."""
        if not self.alive:
            return None
        read_end, write_end = os.pipe()
        try:
            # One request at a time, answer included: the server answers in order, and two nodes
            # revived at once (their own threads) must not take each other's pid.
            with self._send:
                send_handle(self._conn, write_end, self.proc.pid)
                self._conn.send((argv, env, os.getcwd()))
                answer = self._answer()
        except OSError:
            answer = None
        finally:
            os.close(write_end)
        if answer is None or answer[0] != "pid":
            self.close()
            os.close(read_end)
            return None
        return ForkedAgent(self, cast(int, answer[1]), os.fdopen(read_end, "rb"), argv)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The agent's exit code once it ended, waiting up to `timeout` s
        (None: for as long as it runs). An agent that ends after the server
        did (something killed it) has no exit code to tell: 1."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._news:
            while pid not in self._exits:
                if not self.alive and not _exists(pid):
                    return 1
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._news.wait(0.5 if left is None else min(left, 0.5))
            return self._exits[pid]

    def close(self) -> None:
        """End the server and reap it (its agents stay, each in its session)."""
        self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._conn.close()
        if self.log is not None and self.log.exists() and self.log.stat().st_size == 0:
            self.log.unlink()  # it had nothing to say

    def _answer(self) -> tuple[str, object] | None:
        deadline = time.monotonic() + SPAWN_REPLY_S
        with self._news:
            while not self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return None
                self._news.wait(left)
            return self._answers.popleft()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (OSError, EOFError):
                break
            with self._news:
                if message[0] == "exit":
                    self._exits[int(message[1])] = int(message[2])
                else:
                    self._answers.append((str(message[0]), message[1]))
                self._news.notify_all()
        with self._news:
            self.alive = False
            self._news.notify_all()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
