"""Training throughput side by side, in one run: `ddpkit train` vs the
reference loop of the source documents (bench/reference_ddp.py) vs the compute
ceiling (bench/ceiling.py), same model, process count, per-process batch and
step counts, all under `python -m ddpkit.agent --standalone` (torchrun with
workers forked from a pre-imported zygote, the line every ddpkit target runs;
it changes a worker's start, not its steps). Repeats are interleaved
(every entry once, then again) so load from other work on the machine hits
every entry alike; the table prints mean and spread and the ratios
ddpkit / reference and ddpkit / ceiling.

  .venv/bin/python -m bench.train_throughput                 # CPU set (make bench)
  .venv/bin/python -m bench.train_throughput --device cuda   # bf16, channels_last, compile

Writes bench/results/train_throughput[-<device>].json and a PNG plot.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.common import Workload  # noqa: E402

from ddpkit.shared.agreed import AGENT_MODULE  # noqa: E402

CPU_SET = (Workload("resnet18", 32, 32, 2, warmup=2, measure=8),
           Workload("resnet50", 224, 4, 2, warmup=1, measure=2))
CUDA_SET = (Workload("resnet18", 32, 256, 1, warmup=20, measure=100),
            Workload("resnet50", 224, 256, 1, warmup=20, measure=60))


@dataclass
class Entry:
    """One way of training the workload; `argv` builds its torchrun arguments."""

    name: str
    kind: str  # ddpkit | reference | ceiling
    argv: Callable[[Workload, Path], list[str]]
    runs: list[float] = field(default_factory=list)


def ddpkit_argv(extra: list[str], device: str) -> Callable[[Workload, Path], list[str]]:
    def build(w: Workload, timing: Path) -> list[str]:
        return ["-m", "ddpkit.train", "--device", device, "--model", w.model, "--image-size", str(w.image_size),
                "--batch-size", str(w.batch), "--max-steps", str(w.steps),
                # exactly one epoch: no end-of-epoch evaluation inside the timed span
                "--synthetic-size", str(w.steps * w.batch * w.nproc), "--eval-size", str(2 * w.nproc),
                "--log-every", str(w.log_every), "--progress", "plain", "--metrics", str(timing), *extra]
    return build


def reference_argv(device: str) -> Callable[[Workload, Path], list[str]]:
    def build(w: Workload, timing: Path) -> list[str]:
        return [str(ROOT / "bench" / "reference_ddp.py"), "--device", device, "--model", w.model,
                "--image-size", str(w.image_size), "--batch-size", str(w.batch), "--steps", str(w.steps),
                "--train-size", str(w.steps * w.batch * w.nproc), "--eval-size", str(2 * w.nproc),
                "--log-every", str(w.log_every), "--timing", str(timing)]
    return build


def ceiling_argv(variant: str, device: str) -> Callable[[Workload, Path], list[str]]:
    def build(w: Workload, timing: Path) -> list[str]:
        return [str(ROOT / "bench" / "ceiling.py"), "--device", device, "--variant", variant, "--model", w.model,
                "--image-size", str(w.image_size), "--batch-size", str(w.batch), "--warmup", str(w.warmup),
                "--measure", str(w.measure), "--timing", str(timing)]
    return build


def entries(device: str, compile_ceiling: bool) -> list[Entry]:
    variants = ["eager", "channels_last"] + (["compile", "compile_channels_last"] if compile_ceiling else [])
    out = [Entry(f"ceiling:{v}", "ceiling", ceiling_argv(v, device)) for v in variants]
    out.append(Entry("reference", "reference", reference_argv(device)))
    out.append(Entry("ddpkit", "ddpkit", ddpkit_argv([], device)))
    fast = ["--gpu-resident-data", "--workers", "0"]
    if device == "cuda":
        fast += ["--precision", "bf16", "--channels-last", "--compile", "--cudnn-benchmark"]
    out.append(Entry("ddpkit --gpu-resident-data" + (" bf16 cl compile" if device == "cuda" else ""),
                     "ddpkit", ddpkit_argv(fast, device)))
    if device == "cpu":
        # the ceiling keeps the better of eager and channels_last; ddpkit
        # gets the same choice through its --channels-last flag
        out.append(Entry("ddpkit --gpu-resident-data --channels-last", "ddpkit",
                         ddpkit_argv([*fast, "--channels-last"], device)))
    return out


def measure(entry: Entry, w: Workload, scratch: Path) -> float:
    timing = scratch / f"{entry.name.replace(' ', '_').replace(':', '_')}-{len(entry.runs)}.jsonl"
    common.torchrun(w.nproc, entry.argv(w, timing), agent=AGENT_MODULE)
    steps = common.read_steps(timing, kind="train" if entry.kind == "ddpkit" else None)
    return common.images_per_s(steps, w)


def chosen_entries(device: str, compile_ceiling: bool, names: list[str] | None) -> list[Entry]:
    """Every entry, or those named; each kind must stay, or there is no ratio to print."""
    todo = entries(device, compile_ceiling)
    if names is None:
        return todo
    unknown = sorted(set(names) - {e.name for e in todo})
    if unknown:
        raise SystemExit(f"train_throughput: --entries: no entry {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(repr(e.name) for e in todo)}")
    todo = [e for e in todo if e.name in names]
    missing = sorted({"ceiling", "reference", "ddpkit"} - {e.kind for e in todo})
    if missing:
        raise SystemExit(f"train_throughput: --entries leaves no {' or '.join(missing)} entry to compare with")
    return todo


def run_workload(w: Workload, todo: list[Entry], repeats: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
        for r in range(repeats):
            for entry in todo:
                ips = measure(entry, w, Path(tmp))
                entry.runs.append(ips)
                print(f"  [{w.label}] run {r + 1}/{repeats} {entry.name}: {ips:,.1f} img/s", flush=True)
    return summarise(w, todo)


def summarise(w: Workload, todo: list[Entry]) -> dict:
    stats = {e.name: common.spread(e.runs) for e in todo}
    best = lambda kind: max((e for e in todo if e.kind == kind), key=lambda e: stats[e.name]["mean"])  # noqa: E731
    ceiling, ddpkit, reference = best("ceiling"), best("ddpkit"), best("reference")
    mean = lambda e: stats[e.name]["mean"]  # noqa: E731
    return {
        "workload": asdict(w), "label": w.label, "entries": {e.name: {"kind": e.kind, "images_per_s": e.runs,
                                                                      **stats[e.name]} for e in todo},
        "best": {"ddpkit": ddpkit.name, "reference": reference.name, "ceiling": ceiling.name},
        "ratios": {"ddpkit/reference": mean(ddpkit) / mean(reference), "ddpkit/ceiling": mean(ddpkit) / mean(ceiling),
                   "reference/ceiling": mean(reference) / mean(ceiling)},
    }


def print_report(results: list[dict]) -> None:
    rows = []
    for res in results:
        for name, e in res["entries"].items():
            rows.append([res["label"], name, e["mean"], e["min"], e["max"], e["runs"]])
    print(common.table(["workload", "entry", "img/s mean", "min", "max", "runs"], rows))
    print()
    print(common.table(["workload", "ddpkit/reference", "ddpkit/ceiling", "reference/ceiling", "best ddpkit"],
                       [[r["label"], r["ratios"]["ddpkit/reference"], r["ratios"]["ddpkit/ceiling"],
                         r["ratios"]["reference/ceiling"], r["best"]["ddpkit"]] for r in results]))


def plot(results: list[dict], path: Path, title: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = list(res["entries"])
        means = [res["entries"][n]["mean"] for n in names]
        errs = [[m - res["entries"][n]["min"] for n, m in zip(names, means)],
                [res["entries"][n]["max"] - m for n, m in zip(names, means)]]
        colors = [{"ceiling": "#999999", "reference": "#d62728", "ddpkit": "#1f77b4"}[res["entries"][n]["kind"]]
                  for n in names]
        ax.barh(names, means, xerr=errs, color=colors)
        ax.set_title(res["label"])
        ax.set_xlabel("images/s (mean, min-max bars)")
        ax.invert_yaxis()
    fig.suptitle(title)
    common.save_figure(fig, path)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of every entry (default 2)")
    p.add_argument("--only", choices=("resnet18", "resnet50"), help="one workload of the set")
    p.add_argument("--nproc", type=int, help="override processes per run")
    p.add_argument("--batch-size", type=int, help="override per-process batch")
    p.add_argument("--warmup", type=int, help="override warm-up steps")
    p.add_argument("--measure", type=int, help="override timed steps")
    p.add_argument("--compile-ceiling", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure torch.compile ceilings (default: on for cuda, off for cpu: see docs/BENCHMARKS.md)")
    p.add_argument("--entries", type=lambda text: text.split(","), metavar="NAME,...",
                   help="only these entries (comma-separated names as printed; at least one of each kind)")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="folder for the JSON and PNG")
    p.add_argument("--name", help="result file stem (default train_throughput[-cuda])")
    return p.parse_args(argv)


def workloads(a: argparse.Namespace) -> list[Workload]:
    chosen = []
    for w in CUDA_SET if a.device == "cuda" else CPU_SET:
        if a.only and w.model != a.only:
            continue
        chosen.append(Workload(w.model, w.image_size, a.batch_size or w.batch, a.nproc or w.nproc,
                               a.warmup or w.warmup, a.measure or w.measure))
    return chosen


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    compile_ceiling = a.device == "cuda" if a.compile_ceiling is None else a.compile_ceiling
    results = [run_workload(w, chosen_entries(a.device, compile_ceiling, a.entries), a.repeats)
               for w in workloads(a)]
    print_report(results)
    name = a.name or ("train_throughput" + ("-cuda" if a.device == "cuda" else ""))
    png = a.out / f"{name}.png"
    a.out.mkdir(parents=True, exist_ok=True)
    plot(results, png, f"ddpkit train vs reference vs ceiling ({a.device})")
    path = common.write_result(name, {"command": common.command_line(), "machine": common.machine(),
                                       "device": a.device, "repeats": a.repeats, "results": results,
                                       "plot": png.name}, a.out)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
