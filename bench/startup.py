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

The trainer measures itself: rank 0 writes one `startup` record to its
--metrics file with wall-clock stamps from its process start (read from
/proc) to the end of its first step. This script takes the time just before
it runs torchrun and reads that record: the launcher phase is the gap between
the two, the others are the record's own phases.

  .venv/bin/python -m bench.startup [--nproc 2] [--repeats 2]

Writes bench/results/startup.json and startup.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def run_once(nproc: int, train_args: list[str], scratch: Path, index: int) -> dict[str, float]:
    from bench import common

    metrics = scratch / f"metrics{index}.jsonl"
    launch_t = time.time()
    common.torchrun(nproc, ["-m", "ddpkit.train", *train_args, "--metrics", str(metrics)])
    return phases(launch_t, startup_record(metrics))


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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common

    a = parse(argv)
    out_dir = a.out or common.RESULTS
    with tempfile.TemporaryDirectory(prefix="ddpkit-startup-") as tmp:
        runs = [run_once(a.nproc, train_args(a), Path(tmp), i) for i in range(a.repeats)]
    stats = {name: common.spread(r[name] for r in runs) for name in (*PHASES, "total")}
    print(common.table(["phase", "mean s", "min", "max"],
                       [[n, s["mean"], s["min"], s["max"]] for n, s in stats.items()]))
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{a.name}.png"
    plot(runs, png, f"ddpkit train start-up, {a.model}, torchrun x{a.nproc} ({a.device})")
    path = common.write_result(a.name, {"command": common.command_line(), "machine": common.machine(),
                                        "train_args": train_args(a), "nproc": a.nproc, "runs": runs,
                                        "phases": stats, "plot": png.name}, out_dir)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
