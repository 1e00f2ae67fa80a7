"""The Slurm half of bench/scale.py: the same elastic job with
`ddpkit submit slurm --follow` on a real Slurm cluster of N slurmd hosts
(tests/infra/slurm_cluster.py: slurmctld and one slurmd per network-namespace
host, root), one process a host, torchrun mode. Once with `ddpkit train` (the
tiny model) and once with the program of the user's own (bench/scale.py's
OWN_PROGRAM: the tutorials' DDP loop, watched through ddpkit's preamble).

Each run, as bench/scale.py's: 8 steps in, the last host's agent and
workers are SIGKILLed and the survivors' first step timed; 5 steps later
(N >= 3) the next host's are SIGSTOPped and the survivors' first step without
it timed (the others' watch declares it lost after watchdog.loss_s); 5 steps
later the job is cancelled (scancel) and `--follow` exits with its state. The launcher is `submit slurm
--follow` on the controller's host: its CPU (os.wait4), its peak RSS, its
console lines. The figures are bench/scale.py's (its MEASURES), read the same
way (the own program's preamble records from the job's records folder).
`elastic.min_nodes` is N-2 so that the job outlives both losses; --no-freeze
keeps bench/scale.py's N-1 (the crash alone), for a like-for-like crash.

With --ssh (the default) each N then runs bench/scale.py's `launch ssh` half
on as many sshd hosts, one cluster or network up at a time, and the table
gives slurm/ssh for each figure both have.

    .venv/bin/python -m bench.scale_slurm                 # N = 4, 8, 16 -> bench/results/scale-slurm.json, .md
    .venv/bin/python -m bench.scale_slurm --short         # N = 2, Slurm only (tests/test_bench_scale_slurm.py)
    .venv/bin/python -m bench.scale_slurm --nodes 4,8 --no-freeze --name scale-slurm-crash   # min_nodes N-1, as ssh

Writes bench/results/<name>.json, .md and docs/img/scale/slurm_*.png (--no-plots: none).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common, scale  # noqa: E402
from bench.recovery import end_frozen, tail, wait_until  # noqa: E402
from tests.infra import netns, slurm_cluster, sshd  # noqa: E402

SIZES = (4, 8, 16)
SHORT = (2,)
FREEZE_FROM = 3  # a freeze after a crash leaves N-2 nodes: at least one
SSH_MEMORY_GB = 16  # N = 16 runs only with this much available (others' tests share the machine)


class SlurmRun(scale.Run):
    """One `submit slurm --follow` of one program on the cluster's n nodes, in its own folder."""

    def __init__(self, cluster: slurm_cluster.SlurmCluster, work: Path, program: str, n: int, crash: bool,
                 freeze: bool) -> None:
        assert cluster.net is not None
        super().__init__(cluster.net, None, work, program, n, crash)  # type: ignore[arg-type]  # no sshd here
        self.cluster, self.freeze = cluster, freeze

    def spec(self) -> dict[str, Any]:
        spec = super().spec()
        spec.pop("ssh")
        spec["elastic"].pop("max_node_failures")  # launch ssh's: on Slurm nothing brings a node back
        spec["elastic"]["min_nodes"] = max(1, self.n - 1 - self.freeze)
        spec["slurm"] = {"mode": "torchrun"}
        return spec

    def argv(self) -> list[str]:
        job = self.work / "job.yaml"
        job.write_text(yaml.safe_dump(self.spec()))
        return [scale.DDPKIT, "submit", "slurm", "-f", str(job), "--dir", str(self.work), "--follow"]

    def metric_records(self) -> list[dict[str, Any]]:
        """ddpkit train: its --metrics file; the own program: its preamble's records, one file a node in the
        job's records folder, in the order they were written."""
        if self.program == "train":
            return super().metric_records()
        rows = [json.loads(line) for path in self.work.glob("*.records/*.jsonl")
                for line in path.read_text(errors="replace").split("\n")[:-1] if line.strip()]
        return sorted(rows, key=lambda r: float(r.get("time") or 0))

    def job_id(self, out_path: Path) -> int | None:
        text = out_path.read_text(errors="replace")
        if "submitted Slurm job " not in text:
            return None
        return int(text.split("submitted Slurm job ")[1].split(":")[0].split()[0])


def run_one(cluster: slurm_cluster.SlurmCluster, program: str, n: int, crash: bool, freeze: bool,
            say: Callable[[str], None], keep: Path | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"ddpkit-bench-scale-slurm-{program}{n}-"))
    os.chmod(work, 0o755)
    run = SlurmRun(cluster, work, program, n, crash, freeze)
    out_path = work / "submit.out"
    argv = run.argv()
    result: dict[str, Any] = {"program": f"{scale.PROGRAMS[program]} (slurm)", "launcher": "slurm", "nodes": n}
    t0 = time.time()
    with out_path.open("w") as out:
        proc = cluster.ctl.popen(argv, cwd=str(work), env=cluster.env({"DDPKIT_RUNS_DIR": str(run.runs)}),
                                 stdout=out, stderr=subprocess.STDOUT)
    watch = scale.Watch(proc.pid)
    frozen: list[int] = []
    try:
        first = wait_until(lambda: proc.poll() is not None or run.first_step(), scale.START_LIMIT_S,
                           f"no first step on {n} Slurm nodes within {scale.START_LIMIT_S:.0f} s")
        if first is True:
            raise RuntimeError(f"submit --follow exited {proc.returncode} before the first step\n{tail(out_path)}")
        scale.at_first_step(result, run, watch, out_path, first, t0)
        if crash:
            result |= scale.lose_one(run, proc, run.hosts[-1], "crash", out_path)
        if freeze:
            result |= scale.lose_one(run, proc, run.hosts[-2], "freeze", out_path, world=n - 2)
            frozen = result.pop("frozen")
        end_frozen(frozen)  # what Slurm cannot end: a stopped task would hold the step past its cancel
        cancel(cluster, run, out_path)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        ended = time.time()
    except BaseException:
        end_frozen(frozen)
        cancel(cluster, run, out_path)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        say(tail(out_path, 60))
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        watch.stop()
    result.pop("lost_at", None)
    result |= scale.closing(run, proc.returncode, usage, ended - t0, watch, out_path)
    result["closing_line"] = (out_path.read_text(errors="replace").rstrip().splitlines() or [""])[-1]
    if keep is not None:
        shutil.copytree(work, keep / f"slurm-{program}-{n}", ignore=shutil.ignore_patterns("ckpt"), dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    cluster.wait_nodes_idle(timeout=120)  # the cancelled step's nodes back before the next run
    return result


def cancel(cluster: slurm_cluster.SlurmCluster, run: SlurmRun, out_path: Path) -> None:
    """scancel the run's job: `--follow` then sees it end and exits with its state."""
    job = run.job_id(out_path)
    if job is not None:
        cluster.run(["scancel", str(job)])


# ---- side by side -----------------------------------------------------------------------------

def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """slurm/ssh for each program, N and figure both runs have."""
    out = []
    for r in results:
        if r.get("launcher") != "slurm" or "figures" not in r:
            continue
        base = r["program"].removesuffix(" (slurm)")
        ssh = next((s for s in results if s.get("launcher") == "ssh" and s["nodes"] == r["nodes"]
                    and s["program"] == f"{base} (ssh)" and "figures" in s), None)
        if ssh is None:
            continue
        for name, value in r["figures"].items():
            other = ssh["figures"].get(name)
            if other:
                out.append({"program": base, "nodes": r["nodes"], "measure": name, "slurm": value, "ssh": other,
                            "slurm_over_ssh": value / other})
    return out


def ratio_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    ns = sorted({r["nodes"] for r in rows})
    lines = ["| program | measure | " + " | ".join(f"N={n} slurm / ssh" for n in ns) + " |",
             "|" + "---|" * (len(ns) + 2)]
    order = list(scale.MEASURES)
    for key in sorted(dict.fromkeys((r["program"], r["measure"]) for r in rows), key=lambda k: (k[0], order.index(k[1]))):
        by_n = {r["nodes"]: r for r in rows if (r["program"], r["measure"]) == key}
        cells = [f"{by_n[n]['slurm']:.3g} / {by_n[n]['ssh']:.3g} = x{by_n[n]['slurm_over_ssh']:.2f}"
                 if n in by_n else "-" for n in ns]
        lines.append(f"| {key[0]} | {scale.MEASURES[key[1]][1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ssh_runs(n: int, programs: tuple[str, ...], say: Callable[[str], None], keep: Path | None) -> list[dict[str, Any]]:
    """bench/scale.py's half at the same N: N sshd hosts and a launcher host, torn down after."""
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-scale-slurm-ssh-"))
    os.chmod(folder, 0o755)
    out = []
    try:
        names = ["login", *(f"h{i:02d}" for i in range(1, n + 1))]
        with netns.Network(names, prefix=f"dkq{os.getpid() % 10000}", subnet="10.213.81") as net:
            net.wait_reachable(timeout=60)
            with sshd.SshHosts(net.hosts[1:], net.hosts[0], folder) as ssh:
                for program in programs:
                    label = f"{scale.PROGRAMS[program]} (ssh)"
                    say(f"N={n} {label} ...")
                    result = scale.run_one(net, ssh, program, n, True, say, keep, label=label)
                    result["launcher"] = "ssh"
                    out.append(result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def slurm_runs(n: int, programs: tuple[str, ...], say: Callable[[str], None], keep: Path | None,
               crash: bool, freeze: bool) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-scale-slurm-cluster-"))
    out = []
    try:
        with slurm_cluster.SlurmCluster(folder, nodes=n, prefix=f"sq{os.getpid() % 10000}") as cluster:
            for program in programs:
                say(f"N={n} {scale.PROGRAMS[program]} (slurm) ...")
                out.append(run_one(cluster, program, n, crash, crash and freeze and n >= FREEZE_FROM, say, keep))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


# ---- the command ------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=lambda t: tuple(int(x) for x in t.split(",")), default=None)
    p.add_argument("--short", action="store_true", help="N = 2, Slurm only (the smoke test)")
    p.add_argument("--programs", type=lambda t: tuple(t.split(",")), default=tuple(scale.PROGRAMS))
    p.add_argument("--no-crash", action="store_true", help="no host lost or frozen: the job is cancelled at once")
    p.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="after the crash, freeze a second node (N >= 3; min_nodes N-2): --no-freeze keeps "
                        "bench/scale.py's min_nodes N-1")
    p.add_argument("--ssh", action=argparse.BooleanOptionalAction, default=None,
                   help="launch ssh at each N too, side by side (default: on, off with --short)")
    p.add_argument("--with-ssh", type=Path, default=None,
                   help="another run's JSON (of this bench): its launch ssh results join the tables and ratios")
    p.add_argument("--from", dest="from_", type=Path, default=None,
                   help="run nothing: an earlier run's JSON, its tables and plots drawn again (after a stop)")
    p.add_argument("--budget-s", type=float, default=3600, help="stop before an N that would pass this")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--name", default="scale-slurm")
    p.add_argument("--img", type=Path, default=scale.IMG)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--keep", type=Path, default=None, help="copy each run's folder (console, logs) here")
    a = p.parse_args(argv)
    a.nodes = a.nodes or (SHORT if a.short else SIZES)
    a.ssh = (not a.short) if a.ssh is None else a.ssh
    if unknown := set(a.programs) - set(scale.PROGRAMS):
        p.error(f"unknown program {', '.join(sorted(unknown))}: choose from {', '.join(scale.PROGRAMS)}")
    return a


def why_not(n: int, results: list[dict[str, Any]], started: float, budget_s: float) -> str | None:
    """bench/scale.py's memory and time rule, and N = 16 only with SSH_MEMORY_GB available."""
    have_gb = psutil.virtual_memory().available / 2**30
    if n >= 16 and have_gb < SSH_MEMORY_GB:
        return f"memory: {have_gb:.1f} GB available, {SSH_MEMORY_GB} GB wanted for {n} hosts beside others' tests"
    return scale.why_not(n, results, started, budget_s)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.from_ is not None:
        earlier = json.loads(a.from_.read_text())
        stopped = {int(k): v for k, v in earlier["stopped"].items()}
        print(f"wrote {write(a, earlier['results'], stopped, not a.no_plots, earlier)}")
        return 0
    reason = slurm_cluster.available() or (sshd.available() if a.ssh else None)
    if reason:
        print(f"bench/scale_slurm.py: {reason}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the cluster torn down
    results: list[dict[str, Any]] = [] if a.with_ssh is None else [
        r for r in json.loads(a.with_ssh.read_text())["results"] if r.get("launcher") == "ssh"]
    stopped: dict[int, str] = {}
    started = time.time()
    for n in a.nodes:
        if why := why_not(n, results, started, a.budget_s):
            stopped[n] = why
            say(f"N={n}: not run: {why}")
            break
        try:
            done = slurm_runs(n, a.programs, say, a.keep, not a.no_crash, a.freeze)
            if a.ssh:
                done += ssh_runs(n, a.programs, say, a.keep)
        except (TimeoutError, RuntimeError) as exc:  # this N did not start: the larger ones will not
            stopped[n] = str(exc).splitlines()[0]
            say(f"N={n}: stopped: {stopped[n]}")
            break
        for result in done:
            result["figures"] = scale.figures(result)
            result["load_avg_1m"] = os.getloadavg()[0]
            say(f"N={n} {result['program']}: " + ", ".join(f"{k} {v:.3g}" for k, v in result["figures"].items()))
        results += done
        write(a, results, stopped, plot=False)  # what is measured so far survives a later N
    path = write(a, results, stopped, plot=not a.no_plots)
    say(f"wrote {path}")
    return 0


def write(a: argparse.Namespace, results: list[dict[str, Any]], stopped: dict[int, str], plot: bool,
          earlier: dict[str, Any] | None = None) -> Path:
    """The results so far (or `earlier`'s, --from, keeping its command and machine): JSON, tables, plots."""
    analysis = scale.analyse(results)
    side = ratios(results)
    text = scale.markdown(results, analysis) + ("\n" + ratio_table(side) if side else "")
    a.out.mkdir(parents=True, exist_ok=True)
    pngs = scale.plots(analysis, a.img, stem="slurm") if plot else []
    if plot:
        print(text)
    data = earlier or {
        "command": common.command_line(), "machine": common.machine(), "nodes": list(a.nodes),
        "programs": [scale.PROGRAMS[p] for p in a.programs], "crash": not a.no_crash, "freeze": a.freeze,
        "ssh": a.ssh, "with_ssh": str(a.with_ssh) if a.with_ssh else None}
    path = common.write_result(a.name, data | {
        "results": results, "stopped": {str(k): v for k, v in stopped.items()}, "analysis": analysis,
        "slurm_over_ssh": side,
        "plots": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in pngs]}, a.out)
    (a.out / f"{a.name}.md").write_text(text)
    return path


if __name__ == "__main__":
    sys.exit(main())
