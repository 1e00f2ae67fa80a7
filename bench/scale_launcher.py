"""The launcher's CPU for N nodes' output, and a job's record sends, before
and after, side by side in one run (docs/SCALE.md has the figures).

  launcher  bench/scale_sim.py's `launcher()` (the Supervisor's LinePrinter,
            dedup and MetricsSink included, in a process of its own, fed
            LINES_PER_S lines a second from each of N nodes: 8 rank-tagged
            progress lines, one line a rank of every node prints, one framed
            `train` record; the feeding's own CPU measured apart and taken
            off), once with the code of --baseline (a git ref: its src/ is
            taken out of git into a temporary folder and imported in place
            of this checkout's) and once with this checkout's, one after the
            other at each N, --repeat times: the median of the cores that
            1 s of the job's output costs.
  send      `records.send` to a records folder (DDPKIT_RECORDS), as a job's
            watchdog and progress send each record, in a process of each arm:
            microseconds of CPU and of wall time per record.

  .venv/bin/python -m bench.scale_launcher                   # N = 64, 256, 1,024
  .venv/bin/python -m bench.scale_launcher --nodes 64 --seconds 2 --repeat 1

Writes bench/results/scale_launcher.json and .md, docs/img/scale/launcher_before_after.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img" / "scale"
NODES = (64, 256, 1024)
ARMS = ("before", "after")
# The code before the launcher's output path and records.send were made cheaper.
BASELINE = "27013cf"
GOAL_CORES = 1.0  # at 1,024 nodes x LINES_PER_S lines a second

SEND_CODE = """
import json, os, resource, sys, tempfile, time
from ddpkit import records
count = int(sys.argv[1])
with tempfile.TemporaryDirectory() as folder:
    os.environ[records.CHANNEL_VAR] = folder
    record = records.Train(step=1, loss=0.5, images_per_s=900.0)
    assert records.send(record) is None  # warm: the folder made, the file opened
    use = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, t0 = use.ru_utime + use.ru_stime, time.perf_counter()
    for _ in range(count):
        records.send(record)
    wall = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    cpu = use.ru_utime + use.ru_stime - cpu0
    kept = len(records.read_folder(records.Path(folder)))
print(json.dumps({"ddpkit": records.__file__, "records": count, "kept": kept,
                  "cpu_us_per_record": cpu / count * 1e6, "wall_us_per_record": wall / count * 1e6}))
"""


def baseline_src(ref: str, into: Path) -> Path:
    """`ref`'s src/ taken out of git into `into`: the 'before' arm imports it."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, "src"], check=True,
                             capture_output=True).stdout
    path = into / "archive.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def arm_env(src: Path) -> dict[str, str]:
    """The arm's ddpkit first on the path (ahead of the venv's editable install), then bench/."""
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}"}


def launcher_arm(n: int, seconds: float, src: Path) -> dict[str, Any]:
    """bench.scale_sim's launcher() at N nodes, with the ddpkit in `src`, in a process of its own."""
    code = ("import json, sys; import ddpkit; from bench import scale_sim;"
            " r = scale_sim.launcher(int(sys.argv[1]), float(sys.argv[2])); r['ddpkit'] = ddpkit.__file__;"
            " print(json.dumps(r))")
    done = subprocess.run([sys.executable, "-c", code, str(n), str(seconds)], cwd=ROOT, env=arm_env(src),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the launcher at N={n} failed:\n{done.stderr[-3000:]}")
    result = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    if not result["ddpkit"].startswith(str(src)):
        raise RuntimeError(f"the arm imported {result['ddpkit']}, not the code in {src}")
    return result


def send_arm(count: int, src: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", SEND_CODE, str(count)], cwd=ROOT, env=arm_env(src),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"records.send failed:\n{done.stderr[-3000:]}")
    result = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    if result["kept"] != count + 1:
        raise RuntimeError(f"records.send kept {result['kept']} of {count + 1} records")
    return result


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(float(r[key]) for r in runs))


def run(a: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="scale-launcher-") as tmp:
        srcs = dict(zip(ARMS, (baseline_src(a.baseline, Path(tmp)), ROOT / "src")))
        launcher: list[dict[str, Any]] = []
        for n in a.nodes:
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for rep in range(a.repeat):
                for arm in ARMS:  # alternated, so that the machine's load falls on both alike
                    r = launcher_arm(n, a.seconds, srcs[arm])
                    runs[arm].append(r)
                    say(f"N={n} {arm} #{rep + 1}: {r['launcher_cores']:.3f} cores, "
                        f"{r['lines_per_s']:.0f} of {r['target_lines_per_s']} lines/s, kept up: {r['kept_up']}")
            row = {"nodes": n, "lines_per_s": n * 10}
            for arm in ARMS:
                row[arm] = {"launcher_cores": median_of(runs[arm], "launcher_cores"),
                            "cpu_us_per_line": median_of(runs[arm], "cpu_s_per_line") * 1e6,
                            "kept_up": all(r["kept_up"] for r in runs[arm]),
                            "console_bytes": [r["console_bytes"] for r in runs[arm]], "runs": runs[arm]}
            row["ratio"] = row["before"]["launcher_cores"] / max(row["after"]["launcher_cores"], 1e-9)
            launcher.append(row)
        send = {arm: [send_arm(a.records, srcs[arm]) for _ in range(a.repeat)] for arm in ARMS}
    send_row: dict[str, Any] = {arm: {"cpu_us_per_record": median_of(send[arm], "cpu_us_per_record"),
                      "wall_us_per_record": median_of(send[arm], "wall_us_per_record"), "runs": send[arm]}
                for arm in ARMS}
    send_row["ratio"] = send_row["before"]["wall_us_per_record"] / max(send_row["after"]["wall_us_per_record"], 1e-9)
    return {"baseline": a.baseline, "seconds": a.seconds, "repeat": a.repeat, "records": a.records,
            "load_avg_1m": os.getloadavg()[0], "wall_s": time.monotonic() - began,
            "launcher": launcher, "send": send_row}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Launcher CPU per second of job output (10 lines/s a node), --baseline {result['baseline']} "
             f"(before) and this checkout (after), median of {result['repeat']} runs of {result['seconds']:g} s:",
             "", "| nodes | lines/s | before: cores | after: cores | before/after | before: CPU us/line "
             "| after: CPU us/line | kept up (before, after) |", "|---|---|---|---|---|---|---|---|"]
    for row in result["launcher"]:
        b, f = row["before"], row["after"]
        lines.append(f"| {row['nodes']:,} | {row['lines_per_s']:,} | {b['launcher_cores']:.3g} | "
                     f"{f['launcher_cores']:.3g} | x{row['ratio']:.2f} | {b['cpu_us_per_line']:.1f} | "
                     f"{f['cpu_us_per_line']:.1f} | {b['kept_up']}, {f['kept_up']} |")
    s = result["send"]
    lines += ["", f"records.send to a records folder, {result['records']:,} records:", "",
              "| arm | CPU us/record | wall us/record |", "|---|---|---|",
              *(f"| {arm} | {s[arm]['cpu_us_per_record']:.1f} | {s[arm]['wall_us_per_record']:.1f} |"
                for arm in ARMS),
              f"| before/after (wall) | | x{s['ratio']:.2f} |"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench import common

    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [row["nodes"] for row in result["launcher"]]
    for arm, style in zip(ARMS, ("o--", "o-")):
        ax.plot(ns, [row[arm]["launcher_cores"] for row in result["launcher"]], style, label=arm)
    ax.axhline(GOAL_CORES, color="grey", linestyle=":", label="goal at 1,024 nodes")
    ax.set(xscale="log", yscale="log", xlabel="simulated nodes (10 lines/s each)", ylabel="cores",
           title="the launcher's CPU per second of job output")
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    common.save_figure(fig, path)
    return path


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale_launcher", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default=",".join(map(str, NODES)), help="N to run, comma-separated")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of output fed at each N, each arm")
    p.add_argument("--repeat", type=int, default=3, help="runs of each arm at each N (the median is kept)")
    p.add_argument("--records", type=int, default=20000, help="records sent in the send bench, each arm")
    p.add_argument("--baseline", default=BASELINE, help="the git ref of the code before (default %(default)s)")
    p.add_argument("--name", default="scale_launcher")
    p.add_argument("--out", type=Path, help="results folder (default bench/results)")
    p.add_argument("--img", type=Path, default=IMG)
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    a.nodes = [int(n) for n in a.nodes.split(",")]
    if a.repeat < 1 or any(n < 1 for n in a.nodes):
        p.error("--nodes and --repeat: 1 at least")
    return a


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common

    a = parse(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    result = run(a, say) | {"command": common.command_line(), "machine": common.machine()}
    path = common.write_result(a.name, result, a.out or common.RESULTS)
    text = markdown(result)
    path.with_suffix(".md").write_text(text)
    say(text)
    if not a.no_plots:
        say(f"wrote {plot(result, a.img / 'launcher_before_after.png')}")
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
