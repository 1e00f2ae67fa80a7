"""The hang watchdog, measured three ways in one run:

  stop        time from a stall (one worker SIGSTOPped mid-run) to the whole
              job stopped: `ddpkit launch local` 2 nodes x 2 processes with
              the watchdog, side by side with plain torchrun (4 processes, the
              same `ddpkit train` job, watchdog off), which does not stop
              before its collective timeout: it is killed at --torchrun-cap
              seconds (default --cap) and reported as "still running".
  heartbeat   the training loop's cost per step (the 4 phase marks in
              steps.py and loop.py's progress call) against a 10 ms step,
              and the publishing thread's cost (one store `set` per second).
  scale       the store side at --ranks simulated ranks on one real
              TCPStore: every rank's heartbeat written each round, one
              monitor's check (one multi_get, decode, judge), and the
              detection delay past stall_s on a simulated clock.

  .venv/bin/python -m bench.watchdog [--ranks 1024,8192] [--stall-s 10] [--cap 120] [--torchrun-cap S]

Writes bench/results/watchdog.json.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, command_line, machine, table, write_result
from tests.helpers.rank_table import pid_of

from ddpkit.launch.local import free_port
from ddpkit.launch.supervise import proctree
from ddpkit.train.watchdog import stall
from ddpkit.train.watchdog.stall_model import PULSE, Beat, Judge, Phase, Settings, mark, progress

STEP_S = 0.010  # the step the heartbeat's cost is compared with
TRAIN = ["--model", "tiny", "--image-size", "8", "--workers", "0", "--progress", "plain",
         "--log-every", "1", "--data", "synthetic", "--synthetic-size", "400000", "--batch-size", "4",
         "--epochs", "1"]


# ---- stop: a real job, SIGSTOP one worker --------------------------------------------------
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPKIT_", "RANK", "WORLD", "MASTER_"))}
    return {**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def _worker(root: int, rank: int, lines: list[str]) -> int | None:
    """`rank`'s pid from the rank table, if it is a process of this job."""
    pid = pid_of(lines, rank)
    return pid if pid is not None and pid in proctree.descendants(root) else None


def stall_to_stop(argv: list[str], env: dict[str, str], cap: float) -> dict[str, Any]:
    """Start the job, SIGSTOP rank 3 once rank 0 logged step 3, and time until
    the job's last process is gone (or `cap` seconds: then kill it)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"step 3\b", line):
            break
    pid = _worker(proc.pid, 3, lines)
    if pid is None:
        proc.kill()
        raise RuntimeError("no rank 3 worker found:\n" + "".join(lines[-30:]))
    job = [proc.pid, *proctree.descendants(proc.pid)]
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    stopped = True
    try:
        proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        stopped = False
    while proctree.alive(job) and time.monotonic() - t0 < cap:
        time.sleep(0.1)
    took = time.monotonic() - t0
    left = proctree.alive(job)
    proctree.signal_all(left, signal.SIGCONT)
    proctree.signal_all(left, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return {"seconds": round(took, 1), "stopped_by_itself": stopped and not left, "exit_code": proc.returncode,
            "named_rank_3": "stalled rank(s): rank 3" in "".join(lines)}


def bench_stop(stall_s: float, cap: float, torchrun_cap: float) -> dict[str, Any]:
    ddpkit = [sys.executable, "-m", "ddpkit.cli", "launch", "local", "--nodes", "2", "--nproc-per-node", "2",
              "--grace", "5", "--set", f"watchdog.stall_s={stall_s:g}", "--", *TRAIN]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "ddpkit.train", *TRAIN]
    return {"ddpkit": stall_to_stop(ddpkit, _env(), cap),
            "torchrun": stall_to_stop(torchrun, {**_env(), "DDPKIT_WATCHDOG_STALL_S": "0"}, torchrun_cap)}


# ---- heartbeat: the loop's cost and the thread's -------------------------------------------
def one_step(step: int) -> None:
    """What a `ddpkit train` step adds: steps.py's four marks, loop.py's progress."""
    mark(Phase.DATA)
    mark(Phase.FORWARD)
    mark(Phase.BACKWARD)
    mark(Phase.OPTIMIZER)
    progress(step)


def bench_heartbeat(calls: int, publishes: int) -> dict[str, Any]:
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for step in range(calls):
            one_step(step)
        rounds.append((time.perf_counter() - t) / calls)
    per_step = statistics.median(rounds)
    server = _server()
    dog = stall.Watchdog(stall.open_store("127.0.0.1", server.port), stall.Identity(0, 2, 2, 0, "here", 1),
                         Settings(), stall.Outputs())
    t = time.perf_counter()
    for _ in range(publishes):
        dog.publish()
    publish = (time.perf_counter() - t) / publishes
    return {"loop_ns_per_step": round(per_step * 1e9, 1), "loop_fraction_of_10ms_step": per_step / STEP_S,
            "publish_us": round(publish * 1e6, 1), "thread_fraction_of_one_core": publish / Settings().interval_s}


# ---- scale: the store side with N simulated ranks ------------------------------------------
def _server() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def bench_scale(ranks: int, stall_s: float, rounds: int) -> dict[str, Any]:
    """Round r = second r of a simulated clock: every rank publishes (one
    multi_set standing in for N clients' sets), rank `ranks-1` freezes at
    round 3 (the others then wait), and one monitor checks."""
    server = _server()
    store = stall.open_store("127.0.0.1", server.port)
    settings = Settings(stall_s=stall_s, first_step_s=stall_s)
    dog = stall.Watchdog(store, stall.Identity(0, ranks, 8, 0, "sim", 1), settings, stall.Outputs())
    keys = [f"hb/{r}" for r in range(ranks)]
    writes: list[float] = []
    checks: list[float] = []
    detected: int | None = None
    named: list[int] | None = None
    stop_at = 3
    for second in range(rounds):
        # From stop_at on, the last rank is frozen (no heartbeat at all) and
        # the others wait for it in a collective (heartbeats, no progress).
        values = [Beat(r, second if r != ranks - 1 else min(second, stop_at), min(second, stop_at),
                       10 + min(second, stop_at), Phase.BACKWARD, 0.01, True, r // 8, 1000 + r,
                       f"sim{r // 8}").encode().decode() for r in range(ranks)]
        t = time.perf_counter()
        store.multi_set(keys, values)
        writes.append(time.perf_counter() - t)
        if second % dog.check_every:
            continue  # as the thread does: at many ranks it checks every few intervals
        t = time.perf_counter()
        verdict = dog._check(float(second))
        checks.append(time.perf_counter() - t)
        if verdict is not None and detected is None:
            detected = second
            named = [s.beat.rank for s in verdict.suspects]
    delay = None if detected is None else detected - stop_at - stall_s
    return {"ranks": ranks, "check_every_s": dog.check_every, "check_ms_median": round(statistics.median(checks) * 1e3, 2),
            "check_ms_max": round(max(checks) * 1e3, 2),
            "write_all_heartbeats_ms_median": round(statistics.median(writes) * 1e3, 2),
            "detection_delay_past_stall_s": delay, "named": named}


def judge_only(ranks: int) -> float:
    """The judge's own cost per check (no store): decode and compare N heartbeats."""
    raw = [Beat(r, 1, 1, 10, Phase.BACKWARD, 0.01, True, r // 8, r, "h").encode() for r in range(ranks)]
    judge = Judge(ranks, Settings())
    t = time.perf_counter()
    judge.observe([Beat.decode(r, b) for r, b in enumerate(raw)], 0.0)
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="1024,8192", help="simulated ranks, comma-separated")
    parser.add_argument("--stall-s", type=float, default=10.0, help="watchdog.stall_s for the jobs and the simulation")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a job may run after the stall")
    # plain torchrun never stops before its collective timeout: how long to watch it still running
    parser.add_argument("--torchrun-cap", type=float, default=None, help="--cap for plain torchrun (default --cap)")
    parser.add_argument("--calls", type=int, default=200_000, help="steps timed for the loop's cost")
    parser.add_argument("--rounds", type=int, default=0, help="simulated seconds (default stall_s + 8)")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results)")
    parser.add_argument("--name", default="watchdog")
    args = parser.parse_args()
    torchrun_cap = args.cap if args.torchrun_cap is None else args.torchrun_cap
    PULSE.phase = Phase.TRAIN
    heartbeat = bench_heartbeat(args.calls, 200)
    rounds = args.rounds or int(args.stall_s) + 8
    scale = [bench_scale(int(n), args.stall_s, rounds) | {"judge_ms": round(judge_only(int(n)) * 1e3, 2)}
             for n in args.ranks.split(",")]
    with tempfile.TemporaryDirectory():
        stop = bench_stop(args.stall_s, args.cap, torchrun_cap)
    print(table(["launcher", "stall -> job gone (s)", "stopped by itself", "exit", "named rank 3"],
                [[k, v["seconds"], v["stopped_by_itself"], v["exit_code"], v["named_rank_3"]] for k, v in stop.items()]))
    print(f"\nheartbeat: {heartbeat['loop_ns_per_step']} ns per step in the loop "
          f"({heartbeat['loop_fraction_of_10ms_step']:.5%} of a 10 ms step); publish {heartbeat['publish_us']} us "
          f"once a second ({heartbeat['thread_fraction_of_one_core']:.4%} of one core)\n")
    print(table(["ranks", "check every s", "check ms (median)", "check ms (max)", "judge ms", "write all ms",
                 "delay past stall_s"],
                [[s["ranks"], s["check_every_s"], s["check_ms_median"], s["check_ms_max"], s["judge_ms"],
                  s["write_all_heartbeats_ms_median"], s["detection_delay_past_stall_s"]] for s in scale]))
    payload = {"machine": machine(), "command": command_line(), "stall_s": args.stall_s, "cap_s": args.cap,
               "torchrun_cap_s": torchrun_cap,
               "stop": stop, "heartbeat": heartbeat, "scale": scale}
    path = write_result(args.name, payload, **({"out_dir": args.out} if args.out else {}))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
