"""What this process's environment says, for the rank report's record.

Kept apart from rank_report.py on purpose: the report's own module reads no
environment (tests/test_rank_report.py checks that no hook hides there).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ...shared import envnames


def socket_ifnames() -> dict[str, str | None]:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME as the process group saw them
    (read after start-up, which sets both when the interface is `auto`)."""
    return {name: os.environ.get(name) for name in envnames.SOCKET_IFNAMES}


def values_of(names: Iterable[str]) -> dict[str, str | None]:
    """The value of each named variable (None when unset), byte-exact."""
    return {name: os.environ.get(name) for name in names}
