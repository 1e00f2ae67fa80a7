"""Liveness of one SSH connection, as ssh's ServerAliveInterval/CountMax.

A host that vanishes (power loss, a network partition) sends no reset: its
connection just goes quiet. The launcher would wait on it for good, and the
other ranks would block in their next collective until its timeout (30 min
for gloo by default; NCCL's watchdog is no quicker). So every interval a
`keepalive@openssh.com` request goes out and any answer counts (sshd refuses
the request: that is an answer). When none comes within interval x count the
transport is closed: the node's channel ends without an exit status, and the
launcher's fail-fast stops every other node.
"""

from __future__ import annotations

import threading

import paramiko

REQUEST = "keepalive@openssh.com"


class KeepAlive(threading.Thread):
    """One connection's keep-alive requests; `unanswered` once none came back
    within interval x count (and the transport was closed for it)."""

    def __init__(self, transport: paramiko.Transport, interval_s: float, count: int, name: str):
        super().__init__(name=f"alive {name}", daemon=True)
        self.transport, self.interval_s, self.count = transport, interval_s, count
        self.unanswered = False
        self._stop_event = threading.Event()

    @property
    def deadline_s(self) -> float:
        return self.interval_s * self.count

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            if not self.transport.is_active():
                return
            if not self._answered(self.deadline_s) and not self._stop_event.is_set():
                self.unanswered = True
                self.transport.close()
                return

    def _answered(self, timeout: float) -> bool:
        # global_request(wait=True) has no timeout of its own; it returns
        # once answered or once the transport closes.
        answered = threading.Event()

        def ask() -> None:
            self.transport.global_request(REQUEST, wait=True)
            answered.set()

        threading.Thread(target=ask, name=f"{self.name} request", daemon=True).start()
        return answered.wait(timeout)

    def stop(self) -> None:
        self._stop_event.set()
