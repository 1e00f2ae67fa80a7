"""Start-up time of `ddpkit train` under torchrun: from the launch command to
the end of the first training step, split into phases so the slow part is
visible:

  launcher + interpreter   torchrun's agent starts and spawns the worker (to the worker's process start)
  imports                  the worker's python starts and imports torch, torchvision and ddpkit.train
  rendezvous               init_distributed: launcher detection, interface, init_process_group
  rank report              gather and print the rank table
  model build              build_model + parallelise (DDP wrap broadcasts the weights)
  data                     datasets, sampler and loaders (Trainer._build_data)
  first step               the first optimizer step (loader workers start, first batch, step)
  other                    what is left: optimizer, scheduler, resume check

Each repeat runs both agents in turn: torch's own torchrun (every worker a new
interpreter that imports torch) and ddpkit.agent, the line every ddpkit target
runs (workers forked from a zygote that imported torch, torch._dynamo and the
trainer once). Beside the wall-clock phases, the CPU seconds of the whole
process tree (agent, zygote, workers: this process is their subreaper, so
every one of them is reaped here and counted), which is what a busy machine
(the 2-core CI) pays. Ratios: torchrun / ddpkit.agent.

The trainer measures itself: rank 0 writes one `startup` record to its
--metrics file with wall-clock stamps from its process start (read from
/proc) to the end of its first step. This script takes the time just before
it runs torchrun and reads that record: the launcher phase is the gap between
the two, the others are the record's own phases.

  .venv/bin/python -m bench.startup [--nproc 2] [--repeats 2] [--agents torch.distributed.run,ddpkit.agent]

Writes bench/results/startup.json and startup.png.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
PHASES = ("launcher + interpreter", "imports", "rendezvous", "rank report", "model build", "data",
          "first step", "other")
# bench phase -> the trainer's startup record phase
FROM_RECORD = {"imports": "imports", "rendezvous": "rendezvous", "rank report": "rank report",
               "model build": "model", "data": "data", "first step": "first step"}


def startup_record(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    found = [r for r in rows if r.get("kind") == "startup"]
    if len(found) != 1:
        raise RuntimeError(f"{metrics}: expected one startup record, found {len(found)}")
    return found[0]


def phases(launch_t: float, record: dict) -> dict[str, float]:
    stamps = record["stamps"]
    split = {"launcher + interpreter": stamps["process_start"] - launch_t,
             **{name: record["phases"][key] for name, key in FROM_RECORD.items()}}
    total = stamps["first_step_done"] - launch_t
    split["other"] = total - sum(split.values())  # the record's "optimizer + resume"
    split["total"] = total
    return split


def run_once(agent: str, nproc: int, train_args: list[str], scratch: Path, index: int) -> dict[str, float]:
    from bench import common

    metrics = scratch / f"metrics-{agent}-{index}.jsonl"
    before = _tree_cpu()
    launch_t = time.time()
    common.torchrun(nproc, ["-m", "ddpkit.train", *train_args, "--metrics", str(metrics)], agent=agent)
    reap_orphans()
    split = phases(launch_t, startup_record(metrics))
    split["cpu"] = _tree_cpu() - before
    return split


def _tree_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def become_subreaper() -> None:
    """Orphans of the runs (a zygote outlives its agent by a moment) come here
    to be reaped, so RUSAGE_CHILDREN counts every process of the tree."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def reap_orphans(timeout: float = 30) -> None:
    """Wait for every process handed to this subreaper to end and reap it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # nothing left
        if pid == 0:
            time.sleep(0.02)
    raise RuntimeError(f"processes of a finished run still alive after {timeout:g} s")


def train_args(a: argparse.Namespace) -> list[str]:
    return ["--device", a.device, "--model", a.model, "--image-size", str(a.image_size), "--batch-size",
            str(a.batch_size), "--max-steps", "1", "--synthetic-size", str(a.batch_size * a.nproc),
            "--no-eval", "--log-every", "1", "--progress", "plain", "--workers", str(a.workers)]


def plot(runs: list[dict[str, float]], path: Path, title: str) -> None:
    from bench import common

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(runs)))
    for i, run in enumerate(runs):
        left = 0.0
        for j, name in enumerate(PHASES):
            width = max(run[name], 0.0)
            ax.barh(i, width, left=left, color=plt.cm.tab10(j), label=name if i == 0 else None)
            left += width
    ax.set_yticks(range(len(runs)), [f"run {i + 1}" for i in range(len(runs))])
    ax.set_xlabel("seconds from launch")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8)
    common.save_figure(fig, path)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path)
    p.add_argument("--name", default="startup")
    p.add_argument("--agents", default="torch.distributed.run,ddpkit.agent",
                   help="comma-separated agent modules, run in turn in every repeat")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common

    a = parse(argv)
    agents = a.agents.split(",")
    out_dir = a.out or common.RESULTS
    become_subreaper()
    runs: dict[str, list[dict[str, float]]] = {agent: [] for agent in agents}
    with tempfile.TemporaryDirectory(prefix="ddpkit-startup-") as tmp:
        for i in range(a.repeats):
            for agent in agents:  # in turn, so a change of load hits both alike
                runs[agent].append(run_once(agent, a.nproc, train_args(a), Path(tmp), i))
    names = (*PHASES, "total", "cpu")
    stats = {agent: {name: common.spread(r[name] for r in agent_runs) for name in names}
             for agent, agent_runs in runs.items()}
    print(common.table(["phase", *[f"{agent} mean s" for agent in agents]],
                       [[n, *[stats[agent][n]["mean"] for agent in agents]] for n in names]))
    ratios = ratios_of(stats, agents)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{a.name}.png"
    plot([r for agent in agents for r in runs[agent]], png,
         f"ddpkit train start-up, {a.model}, x{a.nproc} ({a.device}): {', '.join(agents)} ({a.repeats} runs each)")
    path = common.write_result(a.name, {"command": common.command_line(), "machine": common.machine(),
                                        "train_args": train_args(a), "nproc": a.nproc, "agents": agents,
                                        "runs": runs, "phases": stats, "ratios": ratios, "plot": png.name}, out_dir)
    print(f"wrote {path} and {png}")
    return 0


def ratios_of(stats: dict[str, dict[str, dict[str, float]]], agents: list[str]) -> dict[str, float]:
    """The first agent's mean over each later one's, for the total and the CPU."""
    first = agents[0]
    return {f"{key} {first} / {agent}": stats[first][key]["mean"] / stats[agent][key]["mean"]
            for agent in agents[1:] for key in ("total", "cpu") if stats[agent][key]["mean"] > 0}


if __name__ == "__main__":
    sys.exit(main())
