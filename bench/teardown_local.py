"""Teardown on one machine, side by side: a plain DDP loop (gloo) in which
one rank exits 1 mid-training, started by

  ddpkit launch local     (N torchrun agents as N nodes, fail-fast)
  plain torchrun          (N agents with a static rendezvous on 127.0.0.1,
                           started by a shell loop, the usual hand-written way)

and the time from the failure until no process of the run is left. Needs no
root (compare bench/launch.py for the same over SSH).

  .venv/bin/python -m bench.teardown_local [--nodes 2] [--nproc 2] [--repeats 2]

Writes bench/results/teardown_local.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.launch import PLAIN_DDP, TEARDOWN_CAP_S, describe, kill_all, running  # noqa: E402

from ddpkit.launch.local import free_port  # noqa: E402

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
METHODS = ("ddpkit launch local", "plain torchrun")


@dataclass
class Result:
    method: str
    repeat: int
    seconds: float | None
    note: str = ""


def argv(method: str, script: Path, nodes: int, nproc: int, port: int) -> list[str]:
    if method == "ddpkit launch local":
        return [DDPKIT, "launch", "local", "--nodes", str(nodes), "--nproc-per-node", str(nproc),
                "--grace", "5", "--set", f"command.script={script}"]  # it picks its own free port
    agents = " ".join(
        f"{sys.executable} -m torch.distributed.run --nnodes={nodes} --nproc-per-node={nproc} --node-rank={i} "
        f"--master-addr=127.0.0.1 --master-port={port} {script} &" for i in range(nodes))
    return ["bash", "-c", f"{agents} wait"]


def once(method: str, repeat: int, folder: Path, script: Path, a: argparse.Namespace) -> Result:
    marks = folder / f"{method.replace(' ', '_')}-{repeat}"
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks), "FAIL_RANK": str(a.nodes * a.nproc - 1), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src")}
    port = free_port()
    proc = subprocess.Popen(argv(method, script, a.nodes, a.nproc, port), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    failed = marks / "failed"
    deadline = time.time() + 120
    while not failed.exists() and time.time() < deadline:
        time.sleep(0.05)
    if not failed.exists():
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
        kill_all(running(str(marks)))
        return Result(method, repeat, None, "the failure was never injected (run did not start)")
    failed_at = float(failed.read_text())
    while running(str(marks)) and time.time() < failed_at + a.cap_s:
        time.sleep(0.05)
    left = running(str(marks))
    gone, what = time.time() - failed_at, describe(left)
    kill_all(left)
    proc.wait(60)
    if left:
        return Result(method, repeat, None,
                      f"{len(left)} processes still running {a.cap_s:.0f}s after the failure ({what})")
    return Result(method, repeat, gone)


def main(argv_: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--name", default="teardown_local")
    p.add_argument("--cap-s", type=float, default=TEARDOWN_CAP_S,
                   help=f"stop measuring a teardown after this long and report it still running "
                        f"(default {TEARDOWN_CAP_S:.0f})")
    a = p.parse_args(argv_)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-teardown-") as tmp:
        script = Path(tmp) / "plain_ddp.py"
        script.write_text(PLAIN_DDP)
        for repeat in range(a.repeats):
            for method in METHODS:
                results.append(once(method, repeat, Path(tmp), script, a))
                print(f"  {method:<20} run {repeat + 1}: {results[-1].seconds} {results[-1].note}", file=sys.stderr)
    rows = []
    for method in METHODS:
        done = [r.seconds for r in results if r.method == method and r.seconds is not None]
        notes = [r.note for r in results if r.method == method and r.seconds is None]
        s = common.spread(done) if done else None
        rows.append([method, s["mean"] if s else "-", s["min"] if s else "-", s["max"] if s else "-", len(done),
                     notes[0][:70] if notes else ""])
    print(f"teardown on one machine, {a.nodes} nodes x {a.nproc} processes: one rank exits 1 -> no process left (s)")
    print(common.table(["method", "mean", "min", "max", "runs", "note"], rows))
    path = common.write_result(a.name, {"command": common.command_line(), "machine": common.machine(),
                                        "nodes": a.nodes, "nproc": a.nproc, "runs": [asdict(r) for r in results]},
                               a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
