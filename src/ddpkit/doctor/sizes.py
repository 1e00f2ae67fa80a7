"""Message sizes and the bus-bandwidth formula (pure, no torch)."""

from __future__ import annotations

import re

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
          "g": GIB, "gb": GIB, "gib": GIB}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'64MiB', '1G', '4096' -> bytes. Powers of 1024 throughout, as
    nccl-tests' -b/-e flags use."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 4096, 64KiB, 64MiB or 1GiB")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value


def format_size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{n} B"


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """Geometric steps from min to max, max always included."""
    if min_bytes > max_bytes:
        raise ValueError(f"min size {format_size(min_bytes)} is above max size {format_size(max_bytes)}")
    sizes, n = [], min_bytes
    while n < max_bytes:
        sizes.append(n)
        n *= factor
    sizes.append(max_bytes)
    return sizes


# nccl-tests, doc/PERFORMANCE.md: busbw = algbw * factor, chosen so that the
# figure is comparable with the hardware's peak link bandwidth regardless of
# the number of ranks. "size" is the whole buffer (for all_gather: the output).
def bus_factor(op: str, world_size: int) -> float:
    n = world_size
    if n < 1:
        raise ValueError(f"world size {n} must be at least 1")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {op!r}; use all_reduce, all_gather, reduce_scatter or broadcast")


def algbw(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes, as nccl-tests print)."""
    if seconds <= 0:
        raise ValueError(f"time {seconds} must be positive")
    return size_bytes / seconds / 1e9


def busbw(op: str, size_bytes: int, seconds: float, world_size: int) -> float:
    return algbw(size_bytes, seconds) * bus_factor(op, world_size)
