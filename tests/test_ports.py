"""free_port: the master port `ddpkit launch local` and the tests pick lies
below the kernel's ephemeral range, where no outgoing connection and no
kernel-assigned listener (Docker's embedded DNS in every container) can hold
it, and it is free on every address when picked."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ddpkit.launch import local
from ddpkit.shared.agreed import SLURM_PORT_SKIPS, SLURM_PORT_SPAN, quiet_port


def ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low, _ = ephemeral_range()
    for _ in range(50):
        port = local.free_port()
        assert port < low and port not in SLURM_PORT_SKIPS
        with socket.socket() as sock:
            sock.bind(("", port))  # what torchrun's store does next


class _Draws:
    """random.SystemRandom's stand-in: randrange gives these numbers in turn."""

    def __init__(self, numbers: list[int]) -> None:
        self.numbers = iter(numbers)

    def randrange(self, stop: int) -> int:
        assert stop == SLURM_PORT_SPAN
        return next(self.numbers)


def _hold_a_quiet_port() -> tuple[socket.socket, int]:
    """A listening socket on the first quiet port this test can bind, and
    that port's index n (quiet_port(n) is the port)."""
    for n in range(SLURM_PORT_SPAN):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", quiet_port(n)))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock, n
    raise AssertionError("no quiet port could be bound")


def test_a_port_in_use_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    held, n = _hold_a_quiet_port()
    with held:
        monkeypatch.setattr(local.random, "SystemRandom", lambda: _Draws([n, n, n + 1]))
        assert local.free_port() == quiet_port(n + 1) != quiet_port(n)


def test_no_free_port_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, address: object) -> None:
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(local.socket.socket, "bind", refuse)
    with pytest.raises(OSError, match="no free port among 200 tried"):
        local.free_port()
