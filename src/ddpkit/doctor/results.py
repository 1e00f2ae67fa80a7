"""What every doctor check produces: a row with a verdict and, for every
failure, the fix. Plain dataclasses so rows pickle across ranks and dump to
JSON unchanged."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class Status(str, Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"  # not applicable here (e.g. GPU checks on a CPU run)


@dataclass(frozen=True)
class Check:
    section: str  # "local", "network", "distributed"
    name: str
    status: Status
    detail: str
    fix: str = ""
    rank: int | None = None  # None: a check about the whole job
    host: str = ""
    # A blocking failure means this process cannot join the job at all
    # (no interface, master unreachable): it reports alone and exits.
    blocking: bool = False

    def __post_init__(self) -> None:
        if self.status is Status.FAIL and not self.fix:
            raise ValueError(f"check {self.name!r} failed without a fix; every FAIL names one")

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["status"] = self.status.value
        return out


@dataclass(frozen=True)
class BenchRow:
    backend: str
    op: str
    size_bytes: int
    dtype: str
    iterations: int
    time_us: float  # per iteration, slowest rank
    algbw_gbps: float  # GB/s, 1e9 bytes
    busbw_gbps: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class DoctorResult:
    world_size: int
    checks: list[Check] = field(default_factory=list)
    bench: list[BenchRow] = field(default_factory=list)
    barrier_us: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(c.status is Status.FAIL for c in self.checks)

    @property
    def verdict(self) -> str:
        if self.failed:
            return "FAIL"
        return "WARN" if any(c.status is Status.WARN for c in self.checks) else "PASS"

    def to_json(self) -> dict[str, object]:
        return {
            "verdict": self.verdict,
            "world_size": self.world_size,
            "checks": [c.to_json() for c in self.checks],
            "barrier_us": self.barrier_us,
            "bench": [b.to_json() for b in self.bench],
        }
