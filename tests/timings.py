"""The suite's time: this machine's speed, what each test is expected to
cost, and the run's wall and CPU time in units of that speed.

- `calibrate()`: a fixed CPU workload (a pure-Python loop of 10 million
  additions, one core), timed by the wall clock, so that it also shows how
  busy the machine is. Run times divided by it compare across machines.
- `tests/test_seconds.json`: seconds per test id in a `make test-full` run
  (setup + call + teardown), what the modules are ordered by. Refreshed
  from a run's JUnit XML with `python -m tests.timings JUNIT.xml`, which
  keeps the entries of tests the run did not run (a `make test-fast` run
  would otherwise drop every slow test's figure).
"""

from __future__ import annotations

import json
import resource
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import psutil

TEST_SECONDS = Path(__file__).with_name("test_seconds.json")
CALIBRATION_ADDITIONS = 10_000_000
# What the loop took on the machines of this project's kind it was first timed on.
CALIBRATION_REFERENCE = "~1.0 s on an idle fast CI machine, ~2.9 s on a slow one"


# At module level, as `python -c` runs it (names in a dict, not fast locals):
# the loop the machines of this project's kind were first compared by.
CALIBRATION_LOOP = compile(f"total = 0\nfor i in range({CALIBRATION_ADDITIONS}):\n    total += i\n", "<calibration>", "exec")


def calibrate() -> float:
    """Seconds a 10-million-addition Python loop takes here now (about 1 s on
    an idle fast 2-core machine of this project's kind, 2.9 s on a slow one)."""
    names: dict[str, int] = {}
    start = time.perf_counter()
    exec(CALIBRATION_LOOP, names)
    seconds = time.perf_counter() - start
    assert names["total"] == CALIBRATION_ADDITIONS * (CALIBRATION_ADDITIONS - 1) // 2
    return seconds


def own_cpu_seconds(children: bool = True) -> float:
    """CPU seconds (user + system) of this process and, with `children`, of
    every child it has waited for, and theirs (torchrun, its workers, ssh ...)."""
    seconds = 0.0
    for who in (resource.RUSAGE_SELF, *([resource.RUSAGE_CHILDREN] if children else [])):
        usage = resource.getrusage(who)
        seconds += usage.ru_utime + usage.ru_stime
    return seconds


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (not idle,
    not waiting on I/O): it also counts daemons the suite started but never
    waited for (sshd, slurmd, dockerd and the containers), and any other load."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


@dataclass(frozen=True)
class RunTime:
    calibration_s: float
    wall_s: float
    suite_cpu_s: float
    machine_busy_s: float

    def lines(self) -> list[str]:
        unit = self.calibration_s

        def both(seconds: float) -> str:
            return f"{seconds:7.0f} s = {seconds / unit:6.0f} calibration units"

        return [f"wall time         {both(self.wall_s)}",
                f"suite CPU time    {both(self.suite_cpu_s)}  (pytest and every process it waited for)",
                f"machine CPU busy  {both(self.machine_busy_s)}  (all processes, daemons and containers too)",
                f"calibration       {unit:7.2f} s (a 10-million-addition Python loop at the start; "
                f"{CALIBRATION_REFERENCE})"]


def load_test_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(TEST_SECONDS.read_text()).items()}
    except FileNotFoundError:
        return {}


def junit_seconds(xml: Path) -> dict[str, float]:
    """Test id -> seconds from pytest's JUnit XML (classname `tests.test_x`
    or `tests.test_x.TestClass`, name with its parameters)."""
    found: dict[str, float] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module_parts = [p for p in parts if not p[:1].isupper()]
        classes = [p for p in parts if p[:1].isupper()]
        nodeid = "/".join(module_parts) + ".py::" + "::".join([*classes, case.get("name", "")])
        found[nodeid] = round(found.get(nodeid, 0.0) + float(case.get("time", "0")), 1)
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.timings JUNIT.xml  (refreshes tests/test_seconds.json)", file=sys.stderr)
        return 2
    merged = {**load_test_seconds(), **junit_seconds(Path(argv[0]))}
    TEST_SECONDS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
    print(f"{TEST_SECONDS}: {len(merged)} tests, {sum(merged.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
