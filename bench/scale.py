"""The same elastic job on N real hosts: `ddpkit launch ssh` on N network-
namespace hosts with sshd (tests/infra, root), one process a host, once with
`ddpkit train` (the tiny model) and once with a program of the user's own (a
tutorial-style DDP loop, whose gradients are all-reduced every step, watched
through ddpkit's preamble). The simulated control plane to 1,024 nodes is
bench/scale_sim.py; this is its real counterpart, as far as one machine goes.

The job: `elastic: {min_nodes: N-1}` (it re-forms after one loss), gloo,
CPU, the launcher on a host of its own ("login"). Per N and program:

  first step        the command to rank 0's first completed step
                    (ddpkit train: its `startup` record's first_step_done;
                    the own program: its first step's stamp)
  to workers        the command to rank 0's worker process start (ssh, the
                    agent's imports, the elastic rendezvous of N agents, the
                    fork): ddpkit train's `startup` record's process_start
  process group     ddpkit train: the record's rendezvous phase (the
                    process group of N)
  rank report       ddpkit train: the record's rank report phase. The own
                    program's report runs inside its init_process_group (the
                    preamble wraps it), so there the two are one figure: the
                    first rank's call to the last rank's return
  recovery          one host's agent and workers SIGKILLed a few steps in: the
                    loss to the survivors' first step (ddpkit train: its
                    first `train` record after the `resume` record written
                    after the loss; the own program: the first step stamped
                    by a world of N-1)
  launcher CPU      the launcher's CPU seconds (os.wait4's rusage: it and
                    every child it reaped), and up to the first step (psutil)
  launcher memory   the launcher process tree's peak RSS (psutil, sampled)
  console lines/s   the launcher's stdout + stderr lines over its wall time
  host memory       each host's processes' PSS (sshd, agent, zygote,
                    worker) at the first step: what bounds N on this machine

Before each N the machine's available memory is checked against the host
memory measured so far (times N, with a margin); an N that does not fit,
or that the time budget (--budget-s) says cannot finish, is skipped and the
reason written down.

    .venv/bin/python -m bench.scale                 # N = 4, 8, 16, 32 -> bench/results/scale.json
    .venv/bin/python -m bench.scale --short         # N = 2 (the CI test)
    .venv/bin/python -m bench.scale --nodes 4 --programs train --no-crash

Writes bench/results/<name>.json and docs/img/scale/real_*.png (--no-plots: none).
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
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.rdzv_trace import rounds  # noqa: E402
from bench.recovery import end_launcher, tail, take_away, wait_until  # noqa: E402
from bench.scale_sim import growth  # noqa: E402
from tests.infra import netns, sshd  # noqa: E402

DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
IMG = ROOT / "docs" / "img" / "scale"
SIZES = (4, 8, 12, 16, 32)  # 12: where a first start on namespace hosts once left nodes out
SHORT = (2,)
PROGRAMS = {"train": "ddpkit train", "own": "own program"}
CHECKPOINT_EVERY = 5
STEPS_BEFORE_CRASH = 8  # steps rank 0 completes before the host is lost: a checkpoint exists by then
STEPS_AFTER = 5  # steps the survivors train after the recovery before the run is ended
STEP_SLEEP_S = 0.05  # the own program's pause a step: its steps come at a pace the console can show
MEMORY_MARGIN = 1.5  # an N runs when N x a host's measured memory x this fits in what is available
START_LIMIT_S = 900.0  # a first step slower than this is a broken start, not a slow one
RECOVERY_LIMIT_S = 420.0  # a recovery slower than this is written down as not done, and the bench goes on

# The program of the user's own: the tutorials' DDP loop (env:// rendezvous, gloo, a small MLP: DDP
# all-reduces its gradients every step). Each rank appends one line a step ("time step world host") to a
# file of its own, and stamps the time just before init_process_group (which ddpkit's preamble wraps).
OWN_PROGRAM = """\
import os, socket, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

stamps = os.environ["STAMPS"]
before_init = time.time()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
host = socket.gethostname()
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
with open(os.path.join(stamps, f"init.{host}.{os.getpid()}"), "w") as out:
    out.write(f"{before_init:.6f} {time.time():.6f} {world}\\n")
with open(os.path.join(stamps, f"steps.{host}.{os.getpid()}"), "a", buffering=1) as out:
    for step in range(1, int(os.environ["STEPS"]) + 1):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        out.write(f"{time.time():.6f} {step} {world} {rank}\\n")
        time.sleep(float(os.environ["STEP_SLEEP_S"]))
dist.destroy_process_group()
"""


# How often --watch-rendezvous reads the rendezvous from the store (bench/rdzv_trace.py).
WATCH_PERIOD_S = 0.25


def rendezvous_id(host: netns.Host) -> str | None:
    """The rendezvous' id in the store (ddpkit's membership and torch's state alike), from node 0's agent's
    environment (the run key tags the rendered id: runkey.rdzv_run_id), once the agent runs."""
    from ddpkit.rendezvous import runkey
    from ddpkit.shared.envnames import DDPKIT_RDZV_ID

    for pid in agents_and_workers(host):
        try:
            env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text(errors="replace").split("\0") if "=" in e)
        except OSError:
            continue
        if DDPKIT_RDZV_ID in env:
            return runkey.rdzv_run_id(env[DDPKIT_RDZV_ID], env)
    return None


# ---- one run ------------------------------------------------------------------------------------

class Watch:
    """The launcher's process tree, sampled: peak RSS, and CPU seconds at a moment asked for."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_rss = pid, 0
        self.cpu_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def tree(self) -> list[psutil.Process]:
        try:
            top = psutil.Process(self.pid)
            return [top, *top.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return total

    def note_cpu(self, name: str) -> None:
        self.cpu_at[name] = self.cpu()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            rss = 0
            for p in self.tree():
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys set in it, nested mappings merged (--spec)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def host_memory_mb(hosts: Sequence[netns.Host]) -> list[float]:
    """Each host's processes' proportional set size (forked workers share their zygote's pages), MB."""
    out = []
    for host in hosts:
        total = 0
        for pid in host.pids():
            try:
                p = psutil.Process(pid)
                total += getattr(p.memory_full_info(), "pss", p.memory_info().rss)
            except psutil.Error:
                pass
        out.append(total / 2**20)
    return out


def agents_and_workers(host: netns.Host) -> list[int]:
    from tests.helpers.elastic_gate import agents_and_workers as found

    return found(host.pids())


class Run:
    """One `launch ssh` of one program on the first n hosts, in its own folder."""

    def __init__(self, net: netns.Network, ssh: sshd.SshHosts, work: Path, program: str, n: int,
                 crash: bool, extra: dict[str, Any] | None = None, src: Path | None = None) -> None:
        self.net, self.ssh, self.work, self.program, self.n, self.crash = net, ssh, work, program, n, crash
        self.extra = extra or {}
        self.src = src or ROOT / "src"  # the ddpkit the hosts' agents and workers import (--baseline: another)
        self.hosts = net.hosts[1:n + 1]
        self.metrics = work / "metrics.jsonl"  # ddpkit train's --metrics (rank 0)
        self.stamps = work / "stamps"
        self.stamps.mkdir()
        self.runs = work / "runs"
        self.watcher: subprocess.Popen[str] | None = None

    def spec(self) -> dict[str, Any]:
        n = self.n
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{self.src}", "OMP_NUM_THREADS": "1"}
        if self.program == "train":
            # no --max-steps when a host is lost: the run is ended once the survivors trained
            steps = 100000 if self.crash else STEPS_BEFORE_CRASH + STEPS_AFTER
            command: dict[str, Any] = {
                "python": sys.executable, "module": "ddpkit.train",
                "args": ["--model", "tiny", "--image-size", "16", "--workers", "0", "--progress", "plain",
                         "--data", "synthetic", "--synthetic-size", "100000", "--batch-size", "4", "--no-eval",
                         "--device", "cpu", "--backend", "gloo", "--max-steps", str(steps),
                         "--checkpoint-dir", str(self.work / "ckpt"), "--checkpoint-every",
                         str(CHECKPOINT_EVERY), "--resume", "auto", "--metrics", str(self.metrics),
                         "--log-every", "1", "--dist-timeout", "300"]}
        else:
            script = self.work / "own_allreduce.py"
            script.write_text(OWN_PROGRAM)
            command = {"python": sys.executable, "script": str(script), "args": []}
            env |= {"STAMPS": str(self.stamps), "STEP_SLEEP_S": str(STEP_SLEEP_S),
                    "STEPS": str(100000 if self.crash else STEPS_BEFORE_CRASH + STEPS_AFTER)}
        return merged({
            "name": f"scale-{self.program}-{n}", "nodes": n, "nproc_per_node": 1, "device": "cpu",
            "backend": "gloo", "command": command, "env": env,
            "rendezvous": {"timeout_s": 900},
            "elastic": {"min_nodes": max(1, n - 1), "max_restarts": 3, "max_node_failures": 1},
            "ssh": {"workdir": str(self.work), "log_dir": str(self.work / "logs"), "grace_s": 3,
                    "connect_timeout_s": 10, "alive_interval_s": 1, "alive_count": 3},
        }, self.extra)

    def argv(self) -> list[str]:
        job = self.work / "job.yaml"
        job.write_text(yaml.safe_dump(self.spec()))
        hostfile = self.work / "hostfile"
        hostfile.write_text("".join(f"{h.addr}\n" for h in self.hosts))
        return [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(hostfile), *self.ssh.launcher_flags()]

    # -- what the job wrote --
    def metric_records(self) -> list[dict[str, Any]]:
        if self.program == "train":
            path = self.metrics
        else:  # the preamble's records, kept by the launcher in the run folder
            found = list(self.runs.glob("*/metrics.jsonl")) if self.runs.exists() else []
            if not found:
                return []
            path = found[0]
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]

    def own_steps(self) -> list[tuple[float, int, int, int, str]]:
        """Every rank's steps: (time, step, world, rank, host)."""
        out = []
        for path in self.stamps.glob("steps.*"):
            host = path.name.split(".")[1]
            for line in path.read_text().split("\n")[:-1]:
                t, step, world, rank = line.split()
                out.append((float(t), int(step), int(world), int(rank), host))
        return sorted(out)

    def first_step(self) -> float | None:
        """Wall clock of rank 0's first step in the full world, once every host trained."""
        if self.program == "train":
            start = [r for r in self.metric_records() if r.get("kind") == "startup"]
            return start[0]["stamps"]["first_step_done"] if start else None
        steps = [s for s in self.own_steps() if s[2] == self.n]
        if {s[4] for s in steps} != {h.name for h in self.hosts}:
            return None
        return min(s[0] for s in steps if s[3] == 0)

    def trained_steps(self) -> int:
        if self.program == "train":
            return sum(1 for r in self.metric_records() if r.get("kind") == "train")
        return sum(1 for s in self.own_steps() if s[3] == 0)

    def rounds_since(self, t: float) -> float:
        """How many times the workers were started since `t`: ddpkit train's resume records; the own program's
        first lines (a world of w starts w of them). 1 after a loss: the survivors re-formed once."""
        if self.program == "train":
            return sum(1 for r in self.metric_records() if r.get("kind") == "resume" and r["time"] > t)
        started = [path.read_text().split() for path in self.stamps.glob("init.*")]
        return round(sum(1 / int(world) for before, _, world in started if float(before) > t), 2)

    def survivors_first_step(self, lost_at: float, world: int | None = None) -> float | None:
        """The first step after `lost_at` (ddpkit train: after its resume record; the own program: in a world
        of `world`, N-1 unless said)."""
        if self.program == "train":
            recs = self.metric_records()
            for i, r in enumerate(recs):
                if r.get("kind") == "resume" and r["time"] > lost_at:
                    return next((s["time"] for s in recs[i + 1:] if s.get("kind") == "train"), None)
            return None
        after = [s[0] for s in self.own_steps() if s[2] == (world or self.n - 1) and s[0] > lost_at]
        return min(after) if after else None

    def phases(self, t0: float) -> dict[str, float]:
        """The start-up figures from what the job wrote (see the module's docstring)."""
        recs = self.metric_records()
        if self.program == "train":
            [rec] = [r for r in recs if r.get("kind") == "startup"][:1]
            stamps = rec["stamps"]
            return {"to_workers_s": stamps["process_start"] - t0,
                    "process_group_s": rec["phases"]["rendezvous"],
                    "rank_report_s": rec["phases"]["rank report"],
                    "imports_s": rec["phases"]["imports"]}
        inits = []
        for path in self.stamps.glob("init.*"):
            before, after, world = path.read_text().split()
            if int(world) == self.n:
                inits.append((float(before), float(after)))
        rows = [r for r in recs if r.get("kind") == "rank_report"]
        first_before = min(b for b, _ in inits)
        out = {"to_workers_s": first_before - t0,  # the program's first line, not its process start
               "process_group_and_report_s": max(a for _, a in inits) - first_before}
        if rows:  # rank 0 writes the rows once every rank's is in and checked
            out["rank_report_written_s"] = rows[0]["time"] - first_before
        return out

    def rank_hosts(self) -> list[str]:
        """The hosts of the ranks of the world that took the first step (the rank report's rows before it)."""
        rows = []
        for r in self.metric_records():
            if r.get("kind") in ("startup", "train"):
                break
            if r.get("kind") == "rank_report":
                rows = [*rows, r] if r["rank"] else [r]  # a round that formed again starts at rank 0
        return sorted(r["host"] for r in rows)


def watch_rendezvous(net: netns.Network, run: Run, proc: subprocess.Popen[str], trace: Path) -> None:
    """Start the rendezvous' reader (bench/rdzv_trace.py) on the launcher's host, where the store is on
    its private network, once node 0's agent is there (a thread: the start is not held up)."""
    def start() -> None:
        found = wait_until(lambda: proc.poll() is not None or rendezvous_id(run.hosts[0]), 600, "no agent")
        if found is True:
            return
        watcher = net["login"].popen([sys.executable, "-m", "bench.rdzv_trace", net["login"].addr, "29500",
                                      str(found), str(trace), str(WATCH_PERIOD_S)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"})
        run.watcher = watcher

    threading.Thread(target=start, daemon=True).start()


def run_one(net: netns.Network, ssh: sshd.SshHosts, program: str, n: int, crash: bool,
            say: Callable[[str], None], keep: Path | None = None, watch_rdzv: bool = False,
            extra: dict[str, Any] | None = None, start_limit_s: float = START_LIMIT_S, src: Path | None = None,
            label: str = "", no_start_ok: bool = False) -> dict[str, Any]:
    """One run; `no_start_ok`: a first step not within start_limit_s is a result (its `failed`, and what
    the rendezvous did meanwhile), not an error."""
    work = Path(tempfile.mkdtemp(prefix=f"ddpkit-bench-scale-{program}{n}-"))
    os.chmod(work, 0o755)
    run = Run(net, ssh, work, program, n, crash, extra, src)
    out_path = work / "launcher.out"
    env = {**os.environ, "DDPKIT_RUNS_DIR": str(run.runs), "DDPKIT_SSH_OPTS": f"-F {ssh.ssh_config}"}
    argv = run.argv()
    result: dict[str, Any] = {"program": label or PROGRAMS[program], "nodes": n, "src": str(run.src)}
    t0 = time.time()
    with out_path.open("w") as out:
        proc = net["login"].popen(argv, cwd=str(work), env=env, stdout=out, stderr=subprocess.STDOUT)
    watch = Watch(proc.pid)
    trace = work / "rendezvous.jsonl"
    if watch_rdzv:
        watch_rendezvous(net, run, proc, trace)
    try:
        try:
            first = wait_until(lambda: proc.poll() is not None or run.first_step(), start_limit_s,
                               f"no first step on {n} hosts within {start_limit_s:.0f} s")
        except TimeoutError as exc:
            if not no_start_ok:
                raise
            end_launcher(proc, wait_s=60)
            result["failed"] = str(exc)
            crash = False
            first = None
        if first is True:
            raise RuntimeError(f"the launcher exited {proc.returncode} before the first step\n{tail(out_path)}")
        if first is None:
            return _not_started(result, run, trace, t0, out_path, watch, work)
        at_first_step(result, run, watch, out_path, first, t0)
        if crash:
            result |= lose_one(run, proc, run.hosts[-1], "crash", out_path)
            lost_at = result["lost_at"]
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops every node and exits
        pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        ended = time.time()
    except BaseException:
        end_launcher(proc, wait_s=60)
        say(tail(out_path, 60))
        raise
    finally:
        watch.stop()
        if run.watcher is not None:
            run.watcher.kill()
            run.watcher.wait()
    if trace.exists():
        result["rendezvous"] = rounds([json.loads(x) for x in trace.read_text().split("\n")[:-1]], t0)
        if crash:
            result["rendezvous"]["lost_at_s"] = round(lost_at - t0, 2)
    result |= closing(run, proc.returncode, usage, ended - t0, watch, out_path)
    if keep is not None:  # the launcher's console and the nodes' logs, to read what happened at this N
        shutil.copytree(work, keep / f"{program}-{n}", ignore=shutil.ignore_patterns("ckpt"), dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    return result


def at_first_step(result: dict[str, Any], run: Run, watch: Watch, out_path: Path, first: float, t0: float) -> None:
    """What is read at the first step: the launcher's CPU so far, what its console said up to then (a worker
    stopped, a node restarted or left out), the hosts' memory, the start-up phases, the first world."""
    watch.note_cpu("first_step")
    start_lines = out_path.read_text(errors="replace").splitlines()
    result["console_lines_to_first_step"] = len(start_lines)
    result["stopped_at_start"] = [ln for ln in start_lines if "restart 0 of" not in ln and any(  # not the first
        word in ln for word in ("stops now", "restart", "excluded", "left out"))][:20]
    result["host_memory_mb"] = host_memory_mb(run.hosts)
    result["first_step_s"] = first - t0
    result |= run.phases(t0)
    result["rank_hosts"] = run.rank_hosts()
    result["first_world"] = len(result["rank_hosts"])


def lose_one(run: Run, proc: subprocess.Popen[str], host: netns.Host, loss: str, out_path: Path,
             world: int | None = None) -> dict[str, Any]:
    """`host`'s agent and workers crashed (SIGKILL) or frozen (SIGSTOP, left so: `frozen` names them), a few
    steps in; the loss to the survivors' first step in a world of `world` (N-1), then STEPS_AFTER steps of
    theirs. A recovery not done within RECOVERY_LIMIT_S is written down as such (the larger N still run)."""
    key = "recovery_s" if loss == "crash" else f"{loss}_recovery_s"
    wait_until(lambda: proc.poll() is not None or run.trained_steps() >= STEPS_BEFORE_CRASH, 300,
               f"rank 0 never reached step {STEPS_BEFORE_CRASH}")
    pids = agents_and_workers(host)
    take_away(pids, loss)
    lost_at = time.time()
    out: dict[str, Any] = {"lost_at": lost_at} | ({"frozen": pids} if loss != "crash" else {})
    try:
        back = wait_until(lambda: proc.poll() is not None or run.survivors_first_step(lost_at, world),
                          RECOVERY_LIMIT_S, "")
    except TimeoutError:
        out[key.removesuffix("_s") + "_note"] = (f"the survivors had not trained {RECOVERY_LIMIT_S:.0f} s "
                                                 f"after the {loss}")
        return out
    if back is True or back is None:
        raise RuntimeError(f"the launcher exited {proc.returncode} before the survivors trained\n{tail(out_path)}")
    out[key] = back - lost_at
    done = run.trained_steps()
    wait_until(lambda: proc.poll() is not None or run.trained_steps() >= done + STEPS_AFTER, 300,
               "the survivors stopped training")
    out[key.removesuffix("_s") + "_rounds"] = run.rounds_since(lost_at)  # more than 1: the survivors restarted again
    return out


def closing(run: Run, exit_code: int | None, usage: Any, wall_s: float, watch: Watch,
            out_path: Path) -> dict[str, Any]:
    """The whole run's figures once the launcher exited: its rusage (os.wait4), peak memory, console."""
    lines = out_path.read_text(errors="replace").splitlines()
    return {"exit_code": exit_code, "wall_s": wall_s, "launcher_cpu_s": usage.ru_utime + usage.ru_stime,
            "launcher_cpu_to_first_step_s": watch.cpu_at.get("first_step"),
            "launcher_peak_rss_mb": watch.peak_rss / 2**20, "console_lines": len(lines),
            "console_lines_per_s": len(lines) / wall_s, "trained_steps": run.trained_steps()}


def _not_started(result: dict[str, Any], run: Run, trace: Path, t0: float, out_path: Path, watch: Watch,
                 work: Path) -> dict[str, Any]:
    """A run that never reached its first step (no_start_ok): what its rendezvous did, its console's end."""
    watch.stop()
    if run.watcher is not None:
        run.watcher.kill()
        run.watcher.wait()
        run.watcher = None
    if trace.exists():
        result["rendezvous"] = rounds([json.loads(x) for x in trace.read_text().split("\n")[:-1]], t0)
    result["console_tail"] = tail(out_path, 20)
    result["wall_s"] = time.time() - t0
    shutil.rmtree(work, ignore_errors=True)
    return result


# ---- the figures ------------------------------------------------------------------------------

# name -> (unit, what it is)
MEASURES = {
    "first_step_s": ("s", "command to rank 0's first step"),
    "to_workers_s": ("s", "command to rank 0's worker (ssh or sbatch, agents' imports, elastic rendezvous, fork)"),
    "process_group_s": ("s", "ddpkit train: the process group of N (its startup record)"),
    "rank_report_s": ("s", "ddpkit train: the rank report (its startup record)"),
    "process_group_and_report_s": ("s", "own program: init_process_group with the preamble's rank report"),
    "recovery_s": ("s", "a host SIGKILLed to the survivors' first step"),
    "freeze_recovery_s": ("s", "a host SIGSTOPped to the survivors' first step"),
    "launcher_cpu_s": ("CPU s", "the launcher's CPU over the run"),
    "launcher_cpu_to_first_step_s": ("CPU s", "the launcher's CPU to the first step"),
    "launcher_peak_rss_mb": ("MB", "the launcher's peak RSS"),
    "console_lines_per_s": ("lines/s", "lines a second on the launcher's console"),
    "host_memory_mb_mean": ("MB", "one host's processes' PSS at the first step"),
}
PLOTS = {
    "start": ("first_step_s", "to_workers_s", "process_group_s", "rank_report_s",
              "process_group_and_report_s", "recovery_s", "freeze_recovery_s"),
    "launcher": ("launcher_cpu_s", "launcher_cpu_to_first_step_s", "launcher_peak_rss_mb",
              "console_lines_per_s", "host_memory_mb_mean"),
}


def figures(result: dict[str, Any]) -> dict[str, float]:
    out = {k: result[k] for k in MEASURES if isinstance(result.get(k), (int, float))}
    if result.get("host_memory_mb"):
        out["host_memory_mb_mean"] = sum(result["host_memory_mb"]) / len(result["host_memory_mb"])
    return out


def analyse(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """program -> measure -> growth (bench.scale_sim.growth: ratios, exponent, a + b·N)."""
    out: dict[str, dict[str, Any]] = {}
    for program in dict.fromkeys(r["program"] for r in results):  # each label once, as first run
        mine = sorted((r for r in results if r["program"] == program and "figures" in r), key=lambda r: r["nodes"])
        if not mine:
            continue
        ns = [r["nodes"] for r in mine]
        out[program] = {name: growth(ns, [r["figures"].get(name) for r in mine]) for name in MEASURES
                        if any(name in r["figures"] for r in mine)}
    return out


def markdown(results: list[dict[str, Any]], analysis: dict[str, dict[str, Any]]) -> str:
    ns = sorted({r["nodes"] for r in results if "figures" in r})
    head = "| program | measure | unit | " + " | ".join(f"N={n}" for n in ns) + " | fit a + b·N | ~N^k |"
    lines = [head, "|" + "---|" * (len(ns) + 5)]
    for program, measures in analysis.items():
        for name, g in measures.items():
            by_n = dict(zip(g["n"], g["values"]))
            cells = [f"{by_n[n]:.3g}" if n in by_n else "-" for n in ns]
            fit = f"{g['a']:.3g} + {g['b']:.3g}·N" if len(g["values"]) >= 2 else "-"
            k = f"{g['exponent']:.2f}" if len(g["values"]) >= 2 else "-"
            lines.append(f"| {program} | {MEASURES[name][1]} | {MEASURES[name][0]} | " + " | ".join(cells)
                         + f" | {fit} | {k} |")
    return "\n".join(lines) + "\n"


def plots(analysis: dict[str, dict[str, Any]], out_dir: Path, stem: str = "real") -> list[Path]:
    """One PNG per group of PLOTS (STEM_GROUP.png): each measure against N, a line per program, with its
    a + b·N fit."""
    import textwrap

    plt = common.pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for group, names in PLOTS.items():
        names = tuple(n for n in names if any(n in m for m in analysis.values()))
        if not names:
            continue
        cols = min(3, len(names))
        rows = -(-len(names) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.5 * rows), squeeze=False)
        for ax in axes.flat[len(names):]:
            ax.set_visible(False)
        for ax, name in zip(axes.flat, names):
            unit, what = MEASURES[name]
            ax.set_title("\n".join(textwrap.wrap(what, 44)), fontsize=8)
            for i, (program, measures) in enumerate(analysis.items()):  # a program's colour in every panel
                g = measures.get(name)
                if not g or not g["values"]:
                    continue
                line = ax.plot(g["n"], g["values"], "o-", label=program, color=f"C{i}")[0]
                if len(g["values"]) >= 2:
                    ax.plot(g["n"], [g["a"] + g["b"] * n for n in g["n"]], "--", color=line.get_color(),
                            alpha=0.5, label=f"{program}: {g['a']:.2g} + {g['b']:.2g}·N")
            ax.set_xlabel("hosts (1 process each)")
            ax.set_ylabel(unit)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
        path = out_dir / f"{stem}_{group}.png"
        common.save_figure(fig, path)
        paths.append(path)
    return paths


# ---- the command ------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=lambda t: tuple(int(x) for x in t.split(",")), default=None)
    p.add_argument("--short", action="store_true", help=f"N = {', '.join(map(str, SHORT))} (the CI test)")
    p.add_argument("--programs", type=lambda t: tuple(t.split(",")), default=tuple(PROGRAMS),
                   help="train, own")
    p.add_argument("--no-crash", action="store_true", help="no host lost: the job ends by itself")
    p.add_argument("--budget-s", type=float, default=3600, help="stop before an N that would pass this")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--name", default="scale")
    p.add_argument("--img", type=Path, default=IMG)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--with", dest="with_", type=Path, action="append", default=[],
                   help="another run's JSON: its N not run here join the tables, fits and plots")
    p.add_argument("--spec", type=json.loads, default={},
                   help='JSON merged into the job spec, e.g. \'{"elastic": {"rendezvous": "torchrun"}}\'')
    p.add_argument("--start-limit-s", type=float, default=START_LIMIT_S, help="a first step later than this "
                   "stops the bench at this N")
    p.add_argument("--watch-rendezvous", action="store_true",
                   help="read the rendezvous from the store every 0.25 s on the launcher's host (ddpkit's membership, "
                        "or torch's state with elastic.rendezvous torchrun): rounds, drops")
    p.add_argument("--keep", type=Path, default=None, help="copy each run's folder (console, logs) here")
    p.add_argument("--baseline", type=Path, default=None,
                   help="a checkout of the code before a change: each N and program runs with this checkout's "
                        "ddpkit on the hosts (after), then with the baseline's src/ (before), side by side")
    a = p.parse_args(argv)
    a.nodes = a.nodes or (SHORT if a.short else SIZES)
    if unknown := set(a.programs) - set(PROGRAMS):
        p.error(f"unknown program {', '.join(sorted(unknown))}: choose from {', '.join(PROGRAMS)}")
    return a


def why_not(n: int, done: list[dict[str, Any]], started: float, budget_s: float) -> str | None:
    """Why N cannot run here now: memory (N hosts of the largest measured so far, with a margin, against
    what is available) or time (the last N's wall time, scaled by N, past the budget)."""
    measured = [r for r in done if r.get("host_memory_mb")]
    if measured:
        per_host = max(max(r["host_memory_mb"]) for r in measured)
        need = n * per_host * MEMORY_MARGIN
        have = psutil.virtual_memory().available / 2**20
        if need > have:
            return (f"memory: {n} hosts x {per_host:.0f} MB (the largest host measured) x {MEMORY_MARGIN} = "
                    f"{need:,.0f} MB > {have:,.0f} MB available")
    timed = [r for r in done if r.get("wall_s")]
    if timed:
        last = max(timed, key=lambda r: r["nodes"])
        guess = sum(r["wall_s"] for r in timed if r["nodes"] == last["nodes"]) * n / last["nodes"]
        left = budget_s - (time.time() - started)
        if guess > left:
            return f"time: {n} hosts would take about {guess:.0f} s (scaled from N={last['nodes']}), {left:.0f} s left"
    return None


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    reason = netns.available() or sshd.available()
    if reason:
        print(f"bench/scale.py: {reason}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # SIGTERM ends the bench as Ctrl-C does: the running launcher is stopped, the hosts torn down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-scale-hosts-"))
    os.chmod(folder, 0o755)
    results: list[dict[str, Any]] = [r for path in a.with_ for r in json.loads(path.read_text())["results"]
                                     if r["nodes"] not in a.nodes]
    stopped: dict[int, str] = {}
    started = time.time()
    names = ["login", *(f"h{i:02d}" for i in range(1, max(a.nodes) + 1))]
    try:
        with netns.Network(names, prefix=f"dks{os.getpid() % 10000}", subnet="10.213.79") as net:
            net.wait_reachable(timeout=60)
            with sshd.SshHosts(net.hosts[1:], net.hosts[0], folder) as ssh:
                for n in a.nodes:
                    if why := why_not(n, results, started, a.budget_s):
                        stopped[n] = why
                        say(f"N={n}: not run: {why}")
                        break
                    arms = [("after", None), ("before", a.baseline / "src")] if a.baseline else [("", None)]
                    try:
                        for program in a.programs:
                            for arm, src in arms:
                                label = f"{PROGRAMS[program]} ({arm})" if arm else PROGRAMS[program]
                                say(f"N={n} {label} ...")
                                result = run_one(net, ssh, program, n, not a.no_crash, say, a.keep,
                                                 a.watch_rendezvous, a.spec, a.start_limit_s, src, label,
                                                 no_start_ok=bool(arm))
                                result["figures"] = figures(result)
                                result["load_avg_1m"] = os.getloadavg()[0]
                                result["arm"] = arm or None
                                results.append(result)
                                say(f"N={n} {label}: " + (result.get("failed") or ", ".join(
                                    f"{k} {v:.3g}" for k, v in result["figures"].items())) + (
                                    f"; rendezvous {result['rendezvous']}" if "rendezvous" in result else ""))
                        write(a, results, stopped, plot=False)  # what is measured so far survives a later N
                    except (TimeoutError, RuntimeError) as exc:  # this N did not start: the larger ones will not
                        stopped[n] = f"{PROGRAMS[program]}: {str(exc).splitlines()[0]}"
                        say(f"N={n}: stopped: {stopped[n]}")
                        break
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    path = write(a, results, stopped, plot=not a.no_plots)
    say(f"wrote {path}")
    return 0


def write(a: argparse.Namespace, results: list[dict[str, Any]], stopped: dict[int, str], plot: bool) -> Path:
    """The results so far: JSON, the table as Markdown, the plots."""
    analysis = analyse(results)
    table = markdown(results, analysis)
    a.out.mkdir(parents=True, exist_ok=True)
    pngs = plots(analysis, a.img) if plot else []
    if plot:
        print(table)
    path = common.write_result(a.name, {
        "command": common.command_line(), "machine": common.machine(), "nodes": list(a.nodes),
        "with": [str(p) for p in a.with_],
        "programs": [PROGRAMS[p] for p in a.programs], "crash": not a.no_crash, "spec": a.spec, "results": results,
        "stopped": {str(k): v for k, v in stopped.items()}, "analysis": analysis,
        "plots": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in pngs]}, a.out)
    (a.out / f"{a.name}.md").write_text(table)
    return path


if __name__ == "__main__":
    sys.exit(main())
