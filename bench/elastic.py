"""Elastic recovery vs resubmitting by hand (issue 15's benchmark).

Three torchrun elastic agents on this machine act as three nodes (c10d on
node 0, --nnodes=2:3, the rendezvous timeouts ddpkit renders for SSH, and
the job environment ddpkit renders for an elastic job). Mid-run, at a
random step, node 2's agent and workers are SIGKILLed. Measured from the
metrics file (one line per step, wall-clock times) and the logs:

- loss -> resumed: from the kill to the first step the two survivors train;
- steps lost: steps trained since the checkpoint the survivors resumed from;
- by hand: a fresh 2-node job started from that same checkpoint, from its
  launch to its first step (what resubmitting costs once someone noticed; no
  queue here, and no time for noticing).

    python -m bench.elastic [--repeats 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import ROOT, machine, spread

from ddpkit.contract import CONTRACT, Target, elastic_env
from ddpkit.launch import proctree
from ddpkit.spec import JobSpec

NODES, MIN_NODES = 3, 2
ROW = CONTRACT[Target.SSH].elastic  # the SSH launcher's rendezvous timeouts
SPEC = JobSpec.model_validate({"name": "bench", "nodes": NODES, "elastic": {"min_nodes": MIN_NODES}})


@dataclass(frozen=True)
class Recovery:
    loss_to_resumed_s: float
    steps_lost: int
    resumed_from_step: int
    killed_at_step: int
    by_hand_launch_to_first_step_s: float


def train_args(ckpt: Path, metrics: Path, args: argparse.Namespace) -> list[str]:
    return ["--model", "tests.helpers.tiny:cnn", "--image-size", "16", "--workers", "0", "--progress", "plain",
            "--synthetic-size", str(args.samples), "--batch-size", "8", "--epochs", "1", "--no-eval",
            "--device", "cpu", "--backend", "gloo", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
            str(args.checkpoint_every), "--keep", "1000", "--resume", "auto", "--metrics", str(metrics),
            "--log-every", "1", "--dist-timeout", "120"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env(node: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
            "DDPKIT_HOSTNAME": f"benchhost-node{node}", **elastic_env(SPEC)}


def start_agents(work: Path, args: list[str]) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    procs = []
    for node in range(NODES):
        conf = (f"is_host={int(node == 0)},join_timeout=300,last_call_timeout={ROW.last_call_s},"
                f"close_timeout={ROW.close_s}")
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={MIN_NODES}:{NODES}",
                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench", f"--rdzv-conf={conf}", "--max-restarts=3", "-m", "ddpkit.train", *args]
        with open(work / f"node{node}.out", "wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env(node), cwd=work))
    return procs


def steps(metrics: Path) -> list[tuple[int, float]]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().split("\n")[:-1]  # complete lines only
    return [(r["step"], r["time"]) for r in map(json.loads, lines) if r.get("kind") == "train"]


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    for pid in [*proctree.descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def by_hand(work: Path, held: Path, args: argparse.Namespace) -> float:
    """A fresh static 2-node job from the held checkpoint: launch to first step."""
    metrics = work / "byhand.jsonl"
    port, procs = free_port(), []
    started = time.time()
    for node in range(MIN_NODES):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={MIN_NODES}", "--nproc-per-node=1",
                f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "ddpkit.train",
                *train_args(held, metrics, args)]
        with open(work / f"byhand{node}.out", "wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env(node), cwd=work))
    try:
        wait_until(lambda: steps(metrics), 300, "the job started by hand never trained a step")
        return steps(metrics)[0][1] - started
    finally:
        for p in procs:
            kill_tree(p)


def one_run(args: argparse.Namespace) -> Recovery:
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-elastic-") as tmp:
        work = Path(tmp)
        ckpt, metrics = work / "ckpt", work / "m.jsonl"
        procs = start_agents(work, train_args(ckpt, metrics, args))
        try:
            kill_after = random.randint(args.checkpoint_every + 1, 3 * args.checkpoint_every)
            wait_until(lambda: any(s >= kill_after for s, _ in steps(metrics)), 600, "no step to kill at")
            killed_at = max(s for s, _ in steps(metrics))
            lost_at = time.time()
            kill_tree(procs[2])
            seen = len(steps(metrics))
            wait_until(lambda: len(steps(metrics)) > seen and steps(metrics)[-1][1] > lost_at, 600,
                       "the survivors never trained again")
            first_after = next(t for _, t in steps(metrics)[seen:] if t > lost_at)
            logs = "\n".join((work / f"node{n}.out").read_text(errors="replace") for n in range(2))
            resumed = max(int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", logs))
            held = work / "held"
            held.mkdir()
            shutil.copy2(ckpt / f"ckpt-{resumed:08d}.pt", held)
            (held / "latest").write_text(f"ckpt-{resumed:08d}.pt\n")
        finally:
            for p in procs:
                kill_tree(p)
        return Recovery(round(first_after - lost_at, 2), killed_at - resumed, resumed, killed_at,
                        round(by_hand(work, held, args), 2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=6000, help="synthetic samples (sets the run's length)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    runs = [one_run(args) for _ in range(args.repeats)]
    result = {
        "machine": machine(),
        "setup": {"nodes": NODES, "min_nodes": MIN_NODES, "nproc_per_node": 1, "last_call_timeout_s": ROW.last_call_s,
                  "heartbeat_expiry_s": 15, "checkpoint_every": args.checkpoint_every},
        "runs": [asdict(r) for r in runs],
        "loss_to_resumed_s": spread(r.loss_to_resumed_s for r in runs),
        "steps_lost": spread(r.steps_lost for r in runs),
        "by_hand_launch_to_first_step_s": spread(r.by_hand_launch_to_first_step_s for r in runs),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'run':>4} {'loss->resumed s':>16} {'steps lost':>11} {'by hand: launch->first step s':>30}")
    for i, r in enumerate(runs):
        print(f"{i:>4} {r.loss_to_resumed_s:>16.1f} {r.steps_lost:>11} {r.by_hand_launch_to_first_step_s:>30.1f}")
    print(f"wrote {args.out / 'elastic.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
