"""The job's network interface, set before the program makes its process group."""

from __future__ import annotations

import sys
from collections.abc import Mapping

from ..host import netif
from ..shared import envnames
from ..shared.exitcodes import ExitCode, exit_on


def install(env: Mapping[str, str]) -> None:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME from DDPKIT_INTERFACE (the
    spec's `network.interface`), as `ddpkit train` sets them; a value already
    in the environment wins. Nothing for a process that has no master."""
    choice = env.get(envnames.DDPKIT_INTERFACE, "auto")
    master = env.get(envnames.MASTER_ADDR)
    if master is None:
        return
    try:
        netif.apply_interface(choice, master)
    except netif.InterfaceError as err:
        sys.exit(exit_on("ddpkit", err, ExitCode.STARTUP))
