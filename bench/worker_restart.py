"""A worker killed mid-run and started again by its agent: how long until
the new worker has trained its first step, and where that time goes.

One node (`--standalone`), `--max-restarts=1`. Once rank 0 has trained its
first step (its `startup` record is in the --metrics file), this script
SIGKILLs it; the agent notices, stops the other workers and starts every
worker again. The restarted rank 0 writes a second `startup` record; from it
and the moment of the kill:

  detect + restart   kill -> the new worker's process start (the agent's monitor
                     interval, the other workers' stop, torchrun's restart, and a
                     fork or an interpreter's start)
  imports            the new worker's imports (a forked worker: what its zygote lacks)
  rendezvous         init_distributed: on CUDA, torch.cuda.set_device (the worker's
                     CUDA context) and init_process_group
  rank report        the rank table (the first collective: on NCCL, the communicator's set-up)
  model build        build the model, move it to the device, wrap it in DDP (which broadcasts)
  data, other        data set and loaders; optimizer and resume check
  first step         the first optimizer step

Each repeat runs every agent in turn: torch's torchrun (each worker a new
interpreter) and ddpkit.agent (each worker forked from its zygote, which
imported torch, torch._dynamo and the trainer once, before any CUDA call).

  .venv/bin/python -m bench.worker_restart [--device cuda --nproc 1] [--repeats 2]

Writes bench/results/<name>.json (default worker-restart-<device>).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("detect + restart", "imports", "rendezvous", "rank report", "model build", "data", "other",
          "first step")
FROM_RECORD = {"imports": "imports", "rendezvous": "rendezvous", "rank report": "rank report",
               "model build": "model", "data": "data", "other": "optimizer + resume", "first step": "first step"}
WAIT_S = 300.0


def startups(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "startup"]


def wait_for_startups(metrics: Path, count: int, agent: subprocess.Popen[str]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = startups(metrics)
        if len(found) >= count:
            return found
        if agent.poll() is not None:
            raise RuntimeError(f"the agent exited {agent.returncode} before start-up record {count}:\n"
                               f"{agent.communicate()[1][-3000:]}")
        time.sleep(0.01)
    raise RuntimeError(f"no start-up record {count} in {metrics} after {WAIT_S:g} s")


def run_once(agent: str, a: argparse.Namespace, scratch: Path, index: int) -> dict[str, float]:
    metrics = scratch / f"metrics-{agent}-{index}.jsonl"
    cmd = [sys.executable, "-m", agent, "--standalone", f"--nproc-per-node={a.nproc}", "--max-restarts=1",
           "--monitor-interval=0.1", "-m", "ddpkit.train", *train_args(a), "--metrics", str(metrics)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.nproc)))
    with subprocess.Popen(cmd, cwd=scratch, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as proc:
        [first] = wait_for_startups(metrics, 1, proc)
        killed_at = time.time()
        os.kill(first["pid"], signal.SIGKILL)
        second = wait_for_startups(metrics, 2, proc)[1]
        _, err = proc.communicate(timeout=WAIT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-3000:]}")
    stamps = second["stamps"]
    split = {"detect + restart": stamps["process_start"] - killed_at,
             **{name: second["phases"].get(key, 0.0) for name, key in FROM_RECORD.items()}}
    split["total"] = stamps["first_step_done"] - killed_at
    return split


def train_args(a: argparse.Namespace) -> list[str]:
    return ["--device", a.device, "--model", a.model, "--image-size", str(a.image_size), "--batch-size",
            str(a.batch_size), "--max-steps", str(a.steps), "--synthetic-size", str(a.batch_size * a.nproc * 4),
            "--no-eval", "--log-every", "1", "--progress", "plain", "--workers", "0"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="--max-steps of each run (the kill comes after the first)")
    p.add_argument("--agents", default="torch.distributed.run,ddpkit.agent")
    p.add_argument("--out", type=Path)
    p.add_argument("--name")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common
    from bench.startup import become_subreaper, reap_orphans

    a = parse(argv)
    agents = a.agents.split(",")
    become_subreaper()
    runs: dict[str, list[dict[str, float]]] = {agent: [] for agent in agents}
    with tempfile.TemporaryDirectory(prefix="ddpkit-restart-") as tmp:
        for i in range(a.repeats):
            for agent in agents:  # in turn, so a change of load hits every agent alike
                runs[agent].append(run_once(agent, a, Path(tmp), i))
                reap_orphans()
    names = (*PHASES, "total")
    stats = {agent: {name: common.spread(r[name] for r in agent_runs) for name in names}
             for agent, agent_runs in runs.items()}
    print(common.table(["kill -> first step", *[f"{agent} mean s" for agent in agents]],
                       [[n, *[stats[agent][n]["mean"] for agent in agents]] for n in names]))
    first = agents[0]
    ratios = {f"total {first} / {agent}": stats[first]["total"]["mean"] / stats[agent]["total"]["mean"]
              for agent in agents[1:]}
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    name = a.name or f"worker-restart-{a.device}"
    path = common.write_result(name, {"command": common.command_line(), "machine": common.machine(),
                                      "train_args": train_args(a), "nproc": a.nproc, "agents": agents,
                                      "runs": runs, "phases": stats, "ratios": ratios}, a.out or common.RESULTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
