"""What ddpkit's preamble (ddpkit/preamble) costs a program of the user's own:
the same program under `python -m ddpkit.agent`, with the preamble, with the
preamble and its metrics records (as `launch local` runs it), with every part
but the stop agreement, with every part but the straggler timing, and with
DDPKIT_PREAMBLE=off, side by side in one run (interleaved repeats).

The program (bench/own_program.py) trains a small MLP with DDP on gloo
whose step takes about --step-ms, and writes a wall-clock stamp after every
optimizer step; the bench takes the time just before it starts the agent.

  time to first step   launch -> the end of the first optimizer step (rank 0)
  step time            median of the steps after --warmup (rank 0)

  .venv/bin/python -m bench.preamble [--repeats 3] [--nproc 2] [--steps 200]

Writes bench/results/<name>.json (default preamble).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "bench" / "own_program.py"
# "no stop": every part but the stop agreement (an async all-reduce of one int after each optimizer step);
# "no stragglers": every part but the own-work timing (wrappers of DDP's forward and autograd.backward, a comm hook).
MODES = {"preamble": {}, "preamble+metrics": {}, "no stop": {"DDPKIT_PREAMBLE": "stop"},
         "no stragglers": {"DDPKIT_PREAMBLE": "stragglers"}, "off": {"DDPKIT_PREAMBLE": "off"}}


def run_once(mode: str, a: argparse.Namespace, scratch: Path, index: int) -> dict[str, float]:
    from ddpkit.launch.local import free_port

    stamps = scratch / f"{mode}-{index}.txt"
    cmd = [sys.executable, "-m", "ddpkit.agent", "--nnodes=1", f"--nproc-per-node={a.nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(PROGRAM), "--steps", str(a.steps),
           "--width", str(a.width), "--stamps", str(stamps)]
    env = {k: v for k, v in os.environ.items() if k not in ("DDPKIT_PREAMBLE", "DDPKIT_METRICS")}
    env.update({"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **MODES[mode]})
    if mode == "preamble+metrics":  # as launch local runs it: records into a file every 10 steps
        env["DDPKIT_METRICS"] = str(scratch / f"metrics-{index}.jsonl")
    launched = time.time()
    done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    times = [float(line) for line in stamps.read_text().split()]
    steps = [b - t for t, b in zip(times, times[1:])][a.warmup:]
    return {"first_step_s": times[0] - launched, "step_ms": 1000 * statistics.median(steps)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--width", type=int, default=512, help="the MLP's width: sets the step time (512: about 10 ms here)")
    p.add_argument("--out", type=Path)
    p.add_argument("--name", default="preamble")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common

    a = parse(argv)
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="ddpkit-preamble-") as tmp:
        for i in range(a.repeats):
            for mode in MODES:  # in turn, so a change of load hits both alike
                runs[mode].append(run_once(mode, a, Path(tmp), i))
                print(f"  run {i + 1}/{a.repeats} {mode}: {runs[mode][-1]}", flush=True)
    stats = {mode: {key: common.spread(r[key] for r in rs) for key in ("first_step_s", "step_ms")}
             for mode, rs in runs.items()}
    off = stats["off"]
    print(common.table(["", *[f"{mode} mean" for mode in MODES], *[f"{mode} / off" for mode in MODES if mode != "off"]],
                       [[key, *[stats[mode][key]["mean"] for mode in MODES],
                         *[stats[mode][key]["mean"] / off[key]["mean"] for mode in MODES if mode != "off"]]
                        for key in ("step_ms", "first_step_s")]))
    ratios = {f"{mode}: step / off": stats[mode]["step_ms"]["mean"] / off["step_ms"]["mean"] for mode in MODES
              if mode != "off"}
    ratios |= {f"{mode}: first step - off (s)": stats[mode]["first_step_s"]["mean"] - off["first_step_s"]["mean"]
               for mode in MODES if mode != "off"}
    path = common.write_result(a.name, {"command": common.command_line(), "machine": common.machine(),
                                        "args": vars(a) | {"out": str(a.out)}, "runs": runs, "stats": stats,
                                        "ratios": ratios}, a.out or common.RESULTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
