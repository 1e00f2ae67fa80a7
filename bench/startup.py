"""Start-up time of `ddpkit train` under torchrun: from the launch command to
the end of the first training step, split into phases so the slow part is
visible:

  launcher + interpreter   torchrun's agent starts, spawns the worker, the worker's python starts
  imports                  torch, torchvision and ddpkit.train
  rendezvous               init_distributed: launcher detection, interface, init_process_group
  rank report              gather and print the rank table
  model build              build_model + parallelise (DDP wrap broadcasts the weights)
  data                     datasets, sampler and loaders (Trainer._build_data)
  first step               the first optimizer step (includes the loader's first batch)
  other                    what is left (optimizer, scheduler, resume check, ...)

The trainer exposes no timings, so this script measures it from outside with
no change to it: torchrun starts this file in --probe mode, which stamps the
interpreter start, imports the trainer, wraps those functions with timers and
then runs `python -m ddpkit.train` unchanged. Rank 0 writes the stamps.

  .venv/bin/python -m bench.startup [--nproc 2] [--repeats 2]

Writes bench/results/startup.json and startup.png.
"""

from __future__ import annotations

import time

T_INTERP = time.time()  # first thing the worker's interpreter runs of ours

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("launcher + interpreter", "imports", "rendezvous", "rank report", "model build", "data",
          "first step", "other")


# ---- probe: runs inside each torchrun worker ---------------------------------------
class Stamps:
    def __init__(self) -> None:
        self.spans: dict[str, float] = {}
        self.marks: dict[str, float] = {"interpreter": T_INTERP}

    def timed(self, name: str, fn: Callable[..., Any], once: bool = False) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if once and name in self.spans:
                return fn(*args, **kwargs)
            t0 = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans[name] = self.spans.get(name, 0.0) + time.time() - t0
                self.marks[f"{name} end"] = time.time()
        return wrapper


def probe(out: Path, train_argv: list[str]) -> int:
    stamps = Stamps()
    import torch  # noqa: F401  (what the trainer's start-up imports)
    import torchvision  # noqa: F401

    sys.path.insert(0, str(ROOT / "src"))
    import ddpkit.train.__main__ as entry
    from ddpkit.train import loop, rank_report, startup

    stamps.marks["imported"] = time.time()
    startup.init_distributed = stamps.timed("rendezvous", startup.init_distributed)
    rank_report.report = stamps.timed("rank report", rank_report.report)
    loop.build_model = stamps.timed("model build", loop.build_model)
    loop.parallelise = stamps.timed("model build", loop.parallelise)
    loop.Trainer._build_data = stamps.timed("data", loop.Trainer._build_data)
    first_step = stamps.timed("first step", loop.Trainer._step, once=True)
    loop.Trainer._step = first_step
    code = entry.main(train_argv)
    if os.environ.get("RANK", "0") == "0":
        out.write_text(json.dumps({"marks": stamps.marks, "spans": stamps.spans}))
    return code


# ---- driver -----------------------------------------------------------------------
def phases(launch_t: float, stamps: dict) -> dict[str, float]:
    marks, spans = stamps["marks"], stamps["spans"]
    split = {
        "launcher + interpreter": marks["interpreter"] - launch_t,
        "imports": marks["imported"] - marks["interpreter"],
        "rendezvous": spans["rendezvous"], "rank report": spans["rank report"],
        "model build": spans["model build"], "data": spans["data"], "first step": spans["first step"],
    }
    total = marks["first step end"] - launch_t
    split["other"] = total - sum(split.values())
    split["total"] = total
    return split


def run_once(nproc: int, train_args: list[str], scratch: Path, index: int) -> dict[str, float]:
    from bench import common

    out = scratch / f"stamps{index}.json"
    launch_t = time.time()
    common.torchrun(nproc, [str(Path(__file__).resolve()), "--probe", str(out), "--", *train_args])
    return phases(launch_t, json.loads(out.read_text()))


def train_args(a: argparse.Namespace) -> list[str]:
    return ["--device", a.device, "--model", a.model, "--image-size", str(a.image_size), "--batch-size",
            str(a.batch_size), "--max-steps", "1", "--synthetic-size", str(a.batch_size * a.nproc),
            "--no-eval", "--log-every", "1", "--progress", "plain", "--workers", str(a.workers)]


def plot(runs: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        rest = sys.argv[3:]
        sys.exit(probe(Path(sys.argv[2]), rest[1:] if rest[:1] == ["--"] else rest))
    sys.exit(main())
