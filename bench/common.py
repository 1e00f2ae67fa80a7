"""Helpers shared by the benchmark scripts: the machine description, starting
a torchrun job, reading per-step timestamps back, and writing results.

Every entrypoint measured here (ddpkit train, the reference loop, the ceiling)
writes JSON lines with a wall-clock `time` and a `step` on rank 0; throughput
is computed the same way for all of them from those lines, warm-up excluded.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Workload:
    """One model/input/batch setting, identical for every entrypoint compared."""

    model: str
    image_size: int
    batch: int          # per process
    nproc: int
    warmup: int         # steps excluded from the figure
    measure: int        # steps timed

    @property
    def steps(self) -> int:
        return self.warmup + self.measure

    @property
    def log_every(self) -> int:
        # timestamps are needed at the end of warm-up and at the end; logging
        # less often keeps device syncs (loss.item()) out of a GPU run
        from math import gcd
        return gcd(self.warmup, self.measure)

    @property
    def label(self) -> str:
        return f"{self.model}@{self.image_size}px b{self.batch}x{self.nproc}"


def machine() -> dict[str, Any]:
    import torch
    import torchvision

    info: dict[str, Any] = {
        "host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "cpu_model": _cpu_model(), "torch": torch.__version__,
        "torchvision": torchvision.__version__, "load_avg_1m": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def torchrun(nproc: int, module_or_script: list[str], extra_env: dict[str, str] | None = None,
             timeout: float = 900, agent: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    """Run `python -m AGENT --standalone` with nproc workers (AGENT: torch's
    torchrun, or ddpkit.agent, torchrun with workers forked from a zygote)."""
    cmd = [sys.executable, "-m", agent, "--standalone", f"--nproc-per-node={nproc}", *module_or_script]
    env = {**os.environ, **(extra_env or {})}
    env.setdefault("PYTHONPATH", str(ROOT / "src"))
    # the same thread count for every entry, also for nproc=1 (torchrun only sets it for nproc > 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def read_steps(path: Path, kind: str | None = "train") -> dict[int, float]:
    """step -> wall-clock time of the JSON lines of `kind` (None: every line with a step)."""
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if (kind is None or row.get("kind") == kind) and "step" in row:
            out[int(row["step"])] = float(row["time"])
    return out


def images_per_s(steps: dict[int, float], w: Workload) -> float:
    """Global images/s between the end of warm-up and the last step."""
    if w.warmup not in steps or w.steps not in steps:
        raise RuntimeError(f"timestamps for steps {w.warmup} and {w.steps} missing; got {sorted(steps)}")
    seconds = steps[w.steps] - steps[w.warmup]
    if seconds <= 0:
        raise RuntimeError(f"non-positive timed span {seconds}s (clock resolution?); use more --measure steps")
    return w.measure * w.batch * w.nproc / seconds


def spread(values: Iterable[float]) -> dict[str, float]:
    vals = list(values)
    return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals),
            "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0, "runs": len(vals)}


def write_result(name: str, payload: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def command_line() -> str:
    """The command as typed: `python -m bench.x ...` when run as a module."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["-m", spec.name] if spec is not None and spec.name else [sys.argv[0]]
    return " ".join([".venv/bin/python", *head, *sys.argv[1:]])


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_mark(path: Path, text: str) -> None:
    """Write a mark another process polls for: a temp file renamed into
    place, so a reader that sees the name always reads the whole content."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
