"""A chaos run: one long elastic job, faults injected at moments a seed draws,
and proof that they cost time, never work.

The job: `ddpkit train` on 3 nodes x 1 process (min_nodes 2, CPU/gloo,
`keep_global_batch: true`, a fixed seed), under `ddpkit launch local` or
`ddpkit launch ssh` (three network-namespace hosts with sshd, root). The
launcher brings a failed node back (elastic.max_node_failures is set above the
number of faults), so after every fault the job shrinks, then grows to 3
nodes again, and the next fault comes only once all 3 train.

Faults (a node is any of the three, node 0 too):
- crash: the node's agent and workers SIGKILLed;
- freeze: they are SIGSTOPped; once the others train without it, the frozen
  node is killed (a hung machine is rebooted) and comes back;
- link: the host's link cut at the switch (ssh only); restored once the
  others train without it;
- worker: one worker SIGKILLed, its agent lives;
- preempt: the node's agent and workers get SIGTERM, as a reclaimed spot
  instance's do.

Moments (each episode has one):
- step: at a random point of a step;
- checkpoint: while a checkpoint file is being written (its temporary file seen);
- rendezvous: a second node crashes while the survivors of a first fault re-form
  (their old workers gone, the new ones not yet started);
- last-step: rank 0's node crashes while rank 0 writes the last step from memory
  after another node's loss;
- back-to-back: two faults on two nodes, under half a second apart.

Then, from the job's own records, a fault-free reference: the same job run
without faults (plain torchrun, one agent, no launcher), changing world size at
exactly the steps the chaos run resumed at, each segment stopped at the next
segment's step. The final weights must be equal bit for bit. Also checked:
the launcher's exit 0, every checkpoint file loads, nothing of the job left
running. Printed: faults survived of faults injected, the time each episode
cost (to the survivors' first step, and to all 3 nodes training again), and the
steps trained twice.

    python -m bench.chaos [--target local|ssh] [--seed 1] [--episodes 5] [--steps 600]
        [--pace-s 0.05] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch
import yaml
from bench.common import ROOT, machine
from bench.recovery import tail, wait_until

from ddpkit.launch.supervise import proctree

NODES, MIN_NODES = 3, 2
KINDS = ("crash", "freeze", "link", "worker", "preempt")
LOSS_KINDS = ("crash", "freeze", "link")  # a node gone (not merely restarted)
MOMENTS = ("step", "checkpoint", "rendezvous", "last-step", "back-to-back")
DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
HOSTS = ["node1", "node2", "node3"]
MARK = "CHAOS_RUN_MARK"  # in every process of the job's environment: what is left running is found by it
WAIT_S = 240  # the longest any one condition is waited for


def train_args(args: argparse.Namespace) -> list[str]:
    """The trainer's flags, the chaos run's and the reference's alike (the pace aside)."""
    return ["--model", "bench.chaos_model:paced", "--image-size", "8", "--workers", "0", "--progress", "plain",
            "--synthetic-size", "4800", "--batch-size", "4", "--epochs", "100", "--max-steps", str(args.steps),
            "--no-eval", "--device", "cpu", "--backend", "gloo", "--lr", "0.05", "--base-batch", "12",
            "--seed", str(args.seed), "--keep", "100000", "--resume", "auto", "--log-every", "1",
            "--dist-timeout", "120"]


# ---- the plan -------------------------------------------------------------------------

@dataclass(frozen=True)
class Episode:
    """What one episode does: its moment, its faults' kinds and nodes (None: picked when injected)."""

    moment: str
    kinds: tuple[str, ...]
    nodes: tuple[int | None, ...]
    after_steps: int  # steps the full world trains before it


def plan(seed: int, episodes: int, kinds: list[str]) -> list[Episode]:
    """Each moment once per len(MOMENTS) episodes, in a drawn order; kinds and nodes drawn; node 0 hit."""
    rng = random.Random(seed)
    moments: list[str] = []
    while len(moments) < episodes:
        moments += rng.sample(MOMENTS, len(MOMENTS))
    out = [_episode(rng, m, kinds) for m in moments[:episodes]]
    if not any(0 in e.nodes or e.moment == "last-step" for e in out):  # rank 0's node is node 0 at first
        first = out[0]
        out[0] = Episode(first.moment, first.kinds, (0, *first.nodes[1:]), first.after_steps)
    return out


def _episode(rng: random.Random, moment: str, kinds: list[str]) -> Episode:
    after = rng.randint(3, 8)
    losses = [k for k in kinds if k in LOSS_KINDS]
    if moment in ("step", "checkpoint"):
        return Episode(moment, (rng.choice(kinds),), (rng.randrange(NODES),), after)
    if moment == "back-to-back":
        a, b = rng.sample(range(NODES), 2)
        return Episode(moment, (rng.choice(kinds), rng.choice(kinds)), (a, b), after)
    if moment == "rendezvous":  # the second: one of the first fault's survivors
        return Episode(moment, (rng.choice(kinds), "crash"), (rng.randrange(NODES), None), after)
    return Episode(moment, (rng.choice(losses), "crash"), (None, None), after)  # last-step: both at run time


# ---- what the job writes ------------------------------------------------------------------

def metric_records(metrics: Path) -> list[dict[str, Any]]:
    """Rank 0's records, complete lines only (it may be writing the last one)."""
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().split("\n")[:-1] if line]


@dataclass(frozen=True)
class World:
    """One run of the workers: the step it started from and its world size."""

    start: int
    size: int
    time: float  # its resume record's (0 for the first run)


def worlds(records: list[dict[str, Any]], first_size: int) -> list[World]:
    out = [World(0, first_size, 0.0)]
    out += [World(r["step"], r["world_size"], r["time"]) for r in records if r["kind"] == "resume"]
    return out


def trained_after(records: list[dict[str, Any]], t: float, size: int | None = None) -> float | None:
    """The time of the first step trained by workers that resumed after `t` (of `size` ranks, if given)."""
    resumed = False  # the run now writing resumed after t, with that size
    for r in records:
        if r["kind"] == "resume":
            resumed = r["time"] > t and (size is None or r["world_size"] == size)
        elif resumed and r["kind"] == "train":
            return float(r["time"])
    return None


def steps_trained_twice(records: list[dict[str, Any]]) -> int:
    """For each resume, the steps completed before it beyond the step it resumed from."""
    twice, done = 0, 0
    for r in records:
        if r["kind"] in ("train", "checkpoint"):
            done = max(done, r["step"])
        elif r["kind"] == "resume":
            twice += max(0, done - r["step"])
            done = r["step"]
    return twice


# ---- the target: a node's processes, its link ----------------------------------------------

class Nodes(Protocol):
    def pids(self, node: int) -> list[int]: ...  # its agent, zygote and workers

    def set_link(self, node: int, up: bool) -> None: ...


def workers(pids: list[int]) -> list[int]:
    """The workers among a node's processes: `-m ddpkit.train` on their line, which the agent's
    own line (`-m ddpkit.agent ... -m ddpkit.train`) also has."""
    from tests.helpers.elastic_gate import AGENTS

    return [p for p in pids if b"ddpkit.train" in (words := _cmdline(p).split(b"\0")) and not AGENTS & set(words)]


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (an ended worker its parent has not reaped yet is not)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass
class LocalNodes:
    launcher: int

    def pids(self, node: int) -> list[int]:
        from tests.helpers.elastic_gate import local_node_agent

        return local_node_agent(self.launcher, node)

    def set_link(self, node: int, up: bool) -> None:
        raise RuntimeError("launch local: one machine, no link to cut")


@dataclass
class HostNodes:
    net: Any

    def pids(self, node: int) -> list[int]:
        from tests.helpers.elastic_gate import agents_and_workers

        return agents_and_workers(self.net[HOSTS[node]].pids())

    def set_link(self, node: int, up: bool) -> None:
        self.net.set_link(self.net[HOSTS[node]], up)


# ---- injecting ----------------------------------------------------------------------------

@dataclass
class Injected:
    """One episode as it happened."""

    moment: str
    faults: list[tuple[str, int]]  # (kind, node), in order
    at: float  # the first fault's time
    hit: bool  # the moment was caught (a temporary file seen; the survivors between two worlds)
    to_first_step_s: float | None = None  # to the first step of workers started after it
    to_full_world_s: float | None = None  # to the first step of 3 nodes again
    notes: list[str] = field(default_factory=list)


@dataclass
class Chaos:
    nodes: Nodes
    metrics: Path
    ckpt: Path
    rng: random.Random
    pace_s: float
    undo: list[Callable[[], None]] = field(default_factory=list)  # thaw a frozen node, restore a link
    full: int = NODES  # the world the job trains with again once an episode is over

    def records(self) -> list[dict[str, Any]]:
        return metric_records(self.metrics)

    def hit(self, kind: str, node: int) -> None:
        pids = self.nodes.pids(node)
        if kind == "link":
            self.nodes.set_link(node, False)
            self.undo.append(lambda: self.nodes.set_link(node, True))
            return
        if not pids:
            raise RuntimeError(f"node {node} has no agent to take a {kind} fault")
        if kind == "worker":
            one = workers(pids)[:1]
            if not one:
                raise RuntimeError(f"node {node} has no worker to kill")
            proctree.signal_all(one, signal.SIGKILL)
        elif kind == "freeze":
            proctree.signal_all(pids, signal.SIGSTOP)
            self.undo.append(lambda: proctree.signal_all(pids, signal.SIGKILL))
        else:
            proctree.signal_all(pids, signal.SIGTERM if kind == "preempt" else signal.SIGKILL)

    def full_world_trains(self, since: float) -> bool:
        """The full world trains: the last run has its ranks and has stepped since `since`."""
        recs = self.records()
        runs = [r for r in recs if r["kind"] == "resume"]
        size = runs[-1]["world_size"] if runs else NODES
        last_start = runs[-1]["time"] if runs else 0.0
        return size == self.full and any(r["kind"] == "train" and r["time"] > max(since, last_start) for r in recs)

    def steps_done(self) -> int:
        return max((r["step"] for r in self.records() if r["kind"] == "train"), default=0)

    def inject_all(self, episodes: list[Episode], alive: Callable[[], bool],
                   fulls: list[int] | None = None) -> tuple[list[Injected], str]:
        """Every episode in turn while the job runs (each followed by the world `fulls` names,
        default the whole job); the episodes done, and why it stopped before the last ('' if not)."""
        done: list[Injected] = []
        for i, ep in enumerate(episodes):
            if not alive():
                return done, f"the job ended before episode {i + 1}"
            self.full = fulls[i] if fulls else NODES
            try:
                done.append(self.episode(ep, alive))
            except (RuntimeError, TimeoutError) as exc:
                print(f"chaos: {ep.moment}: {exc}", flush=True)
                return done, f"{ep.moment}: {exc}"
            print(f"chaos: {said(done[-1])}", flush=True)
        return done, ""

    def episode(self, ep: Episode, alive: Callable[[], bool]) -> Injected:
        start = self.steps_done()
        wait_until(lambda: self.steps_done() >= start + ep.after_steps or not alive(), WAIT_S,
                   "the full world trained no steps before the episode")
        moment = getattr(self, "_" + ep.moment.replace("-", "_"))
        done: Injected = moment(ep)
        try:
            self.settle(done, alive)
        finally:
            while self.undo:
                self.undo.pop()()
        return done

    def settle(self, done: Injected, alive: Callable[[], bool]) -> None:
        first = wait_until(lambda: trained_after(self.records(), done.at) or (not alive() and -1.0), WAIT_S,
                           "nobody trained after the fault")
        if first < 0:
            raise RuntimeError("the job ended before it trained again after the fault")
        done.to_first_step_s = round(first - done.at, 2)
        while self.undo:  # the others train without the node: a frozen one is rebooted, a link mended
            self.undo.pop()()
        full = wait_until(lambda: trained_after(self.records(), done.at, self.full) or (not alive() and -1.0),
                          WAIT_S, f"the job never trained on {self.full} nodes again after the fault")
        if full < 0:
            raise RuntimeError(f"the job ended before {self.full} nodes trained again")
        done.to_full_world_s = round(full - done.at, 2)

    # each moment: inject the episode's faults, return what happened

    def _step(self, ep: Episode) -> Injected:
        time.sleep(self.rng.uniform(0, max(self.pace_s, 0.01)))
        return self._now(ep, True)

    def _checkpoint(self, ep: Episode) -> Injected:
        seen = self._temporary_file(lambda pid: True, timeout=120)
        return self._now(ep, seen is not None)

    def _back_to_back(self, ep: Episode) -> Injected:
        done = self._now(Episode(ep.moment, ep.kinds[:1], ep.nodes[:1], 0), True)
        time.sleep(self.rng.uniform(0, 0.5))
        self.hit(ep.kinds[1], _known(ep.nodes[1]))
        done.faults.append((ep.kinds[1], _known(ep.nodes[1])))
        return done

    def _rendezvous(self, ep: Episode) -> Injected:
        first = _known(ep.nodes[0])
        others = [n for n in range(NODES) if n != first]
        old = {n: workers(self.nodes.pids(n)) for n in others}
        done = self._now(Episode(ep.moment, ep.kinds[:1], (first,), 0), True)
        # the survivors' old workers end as they re-form; the new ones start once it completed
        between = wait_until(lambda: not any(running(old[n]) for n in others), 60,
                             "the survivors' workers did not end after the fault")
        second = self.rng.choice(others)
        done.hit = bool(between) and trained_after(self.records(), done.at) is None
        self.hit(ep.kinds[1], second)
        done.faults.append((ep.kinds[1], second))
        return done

    def _last_step(self, ep: Episode) -> Injected:
        zero = self.rank0_node()
        first = self.rng.choice([n for n in range(NODES) if n != zero])
        at = time.time()
        self.hit(ep.kinds[0], first)
        done = Injected(ep.moment, [(ep.kinds[0], first)], at, False)
        pid = self._temporary_file(lambda p: p in workers(self.nodes.pids(zero)), timeout=60)
        done.hit = pid is not None
        if pid is None:
            done.notes.append(f"rank 0 (node {zero}) wrote no last step within 60 s; its node crashed anyway")
        self.hit(ep.kinds[1], zero)
        done.faults.append((ep.kinds[1], zero))
        return done

    def _now(self, ep: Episode, hit: bool) -> Injected:
        node = _known(ep.nodes[0])
        at = time.time()
        self.hit(ep.kinds[0], node)
        return Injected(ep.moment, [(ep.kinds[0], node)], at, hit)

    def rank0_node(self) -> int:
        """The node of the worker whose start-up rank 0 recorded last."""
        pid = [r["pid"] for r in self.records() if r["kind"] == "startup"][-1]
        for node in range(NODES):
            if pid in self.nodes.pids(node):
                return node
        raise RuntimeError(f"rank 0's worker (pid {pid}) is on no node")

    def _temporary_file(self, wanted: Callable[[int], bool], timeout: float) -> int | None:
        """Polls (every millisecond) for a checkpoint being written by a process `wanted`
        takes; its writer's pid, or None after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in os.listdir(self.ckpt) if self.ckpt.exists() else []:
                if name.startswith(".ckpt-") and ".tmp-" in name:
                    pid = int(name.rsplit("-", 1)[1])
                    if wanted(pid):
                        return pid
            time.sleep(0.001)
        return None


def _known(node: int | None) -> int:
    assert node is not None, "a node drawn at run time"
    return node


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class Outcome:
    exit_code: int
    closing: str
    episodes: list[Injected]
    worlds: list[World]
    steps_trained_twice: int
    corrupt: list[str]
    left_running: list[str]
    error: str = ""  # why the run stopped injecting (a wait that timed out, the job ended first)
    bitwise_equal: bool | None = None
    differs: str = ""
    seconds: float = 0.0
    reference_seconds: float = 0.0


def job_spec(work: Path, args: argparse.Namespace, mark: str, **extra: Any) -> Path:
    spec: dict[str, Any] = {
        "name": "chaos", "nodes": NODES, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 300},
        "elastic": {"min_nodes": MIN_NODES, "max_restarts": 8 * args.episodes + 4,
                    "max_node_failures": 2 * args.episodes + 2, "keep_global_batch": True,
                    "last_call_s": args.last_call_s},
        "watchdog": {"loss_s": args.loss_s},
        "command": {"python": sys.executable, "module": "ddpkit.train",
                    "args": [*train_args(args), "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every",
                             str(args.checkpoint_every), "--metrics", str(work / "m.jsonl")]},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
                "CHAOS_PACE_S": str(args.pace_s), MARK: mark},
        **extra,
    }
    path = work / "chaos.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@contextmanager
def launched(args: argparse.Namespace, work: Path, mark: str) -> Iterator[tuple[subprocess.Popen[Any], Nodes]]:
    out = (work / "launcher.out").open("w")
    if args.target == "local":
        spec = job_spec(work, args, mark)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            [DDPKIT, "launch", "local", "-f", str(spec), "--log-dir", str(work / "logs")],
            stdout=out, stderr=subprocess.STDOUT, cwd=work)
        yield proc, LocalNodes(proc.pid)
        return
    from bench.elastic import ssh_hosts

    with ssh_hosts() as (net, hosts):
        spec = job_spec(work, args, mark, ssh={"workdir": str(work), "log_dir": str(work / "logs"), "grace_s": 3,
                                                "connect_timeout_s": 3, "alive_interval_s": 1, "alive_count": 3})
        hostfile = work / "hostfile"
        hostfile.write_text("".join(f"{net[n].addr}\n" for n in HOSTS))
        proc = net["login"].popen([DDPKIT, "launch", "ssh", "-f", str(spec), "--hostfile", str(hostfile),
                                   *hosts.launcher_flags()], cwd=str(work), stdout=out, stderr=subprocess.STDOUT)
        yield proc, HostNodes(net)


def chaos_run(args: argparse.Namespace, work: Path) -> Outcome:
    mark = f"chaos-run-{os.getpid()}-{int(time.time())}"  # not key-like: the spec check warns of those
    episodes = plan(args.seed, args.episodes, args.kinds)
    t0 = time.time()
    with launched(args, work, mark) as (proc, nodes):
        chaos = Chaos(nodes, work / "m.jsonl", work / "ckpt", random.Random(args.seed + 1), args.pace_s)
        watch = stop_when_late(args.deadline_s, lambda: tail(work / "launcher.out", 80),
                         lambda: proc.send_signal(signal.SIGINT))
        done: list[Injected] = []
        try:
            alive = lambda: proc.poll() is None  # noqa: E731
            error = started(chaos, alive, checkpointed=True)
            if not error:
                done, error = chaos.inject_all(episodes, alive)
            proc.wait(timeout=args.steps * (args.pace_s * 4 + 0.5) + 300)
        finally:
            watch.set()
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(120)
    return outcome_of(work, proc.returncode, _closing(work / "launcher.out"), done, mark, error, t0)


def started(chaos: Chaos, alive: Callable[[], bool], checkpointed: bool) -> str:
    """Waits until the whole job trains (and, where `checkpointed`, has written a checkpoint);
    '' then, else why not."""
    try:
        wait_until(lambda: chaos.full_world_trains(0.0) or not alive(), WAIT_S, "the job never trained")
        if checkpointed:
            wait_until(lambda: any(r["kind"] == "checkpoint" for r in chaos.records()) or not alive(), WAIT_S,
                       "the job wrote no checkpoint")
    except TimeoutError as exc:
        return str(exc)
    return "" if alive() else "the job ended before the first episode"


def stop_when_late(seconds: float, state: Callable[[], str], stop: Callable[[], None]) -> threading.Event:
    """Past `seconds`, prints what the job is doing and stops it, so that a stuck run ends
    naming its state instead of at its caller's timeout. Set the event to call it off."""
    off = threading.Event()

    def watch() -> None:
        if off.wait(seconds):
            return
        try:
            print(f"chaos: past the deadline ({seconds:.0f} s), stopping the job; its state:\n{state()}", flush=True)
        finally:
            stop()
    threading.Thread(target=watch, name="chaos deadline", daemon=True).start()
    return off


def outcome_of(work: Path, exit_code: int | None, closing: str, done: list[Injected], mark: str, error: str,
               t0: float) -> Outcome:
    """What the run left: its worlds, the steps it trained twice, its checkpoints, its processes."""
    seconds = time.time() - t0
    records = metric_records(work / "m.jsonl")
    return Outcome(-1 if exit_code is None else exit_code, closing, done,
                   worlds(records, first_world(work / "ckpt")), steps_trained_twice(records),
                   corrupt_checkpoints(work / "ckpt"), left_running(mark), error=error, seconds=round(seconds, 1))


def said(i: Injected) -> str:
    faults = " then ".join(f"{kind} of node {node}" for kind, node in i.faults)
    return (f"{i.moment}: {faults} ({'moment hit' if i.hit else 'moment missed'}); first step after "
            f"{i.to_first_step_s} s, the full world after {i.to_full_world_s} s" + "".join(f"; {n}" for n in i.notes))


def _closing(out: Path) -> str:
    """What the launcher printed below its summary table (its closing line, which the console wraps)."""
    lines = out.read_text(errors="replace").splitlines()
    bottom = max((i for i, line in enumerate(lines) if line.startswith("└")), default=-1)
    return " ".join(line.strip() for line in lines[bottom + 1:] if line.strip())


def first_world(ckpt: Path) -> int:
    """The first run's world size, from the earliest checkpoint it wrote."""
    first = min(ckpt.glob("ckpt-*.pt"))
    return int(torch.load(first, map_location="cpu", weights_only=False)["world_size"])


def corrupt_checkpoints(ckpt: Path) -> list[str]:
    bad = []
    for path in sorted(ckpt.glob("ckpt-*.pt")):
        try:
            torch.load(path, map_location="cpu", weights_only=False)["model"]
        except Exception as exc:
            bad.append(f"{path.name}: {type(exc).__name__}: {exc}")
    return bad


def left_running(mark: str) -> list[str]:
    """Processes of the job still alive (waited for a few seconds: the launcher's exit comes first)."""
    def found() -> list[int]:
        return [p for p in proctree.with_env(MARK, mark) if p != os.getpid()]
    deadline = time.monotonic() + 15
    while found() and time.monotonic() < deadline:
        time.sleep(0.2)
    return [f"{pid}: {_line(pid)[:120]}" for pid in found()]


def _line(pid: int) -> str:
    return _cmdline(pid).replace(b"\0", b" ").decode(errors="replace")


# ---- the fault-free reference ---------------------------------------------------------------

def segments(chaos_worlds: list[World]) -> list[World]:
    """The runs that trained: a run the next one resumed at its own start trained nothing that stayed."""
    return [w for i, w in enumerate(chaos_worlds) if i + 1 == len(chaos_worlds) or chaos_worlds[i + 1].start > w.start]


def reference(args: argparse.Namespace, work: Path, chaos_worlds: list[World]) -> Path:
    """The job without faults, world size changed at the chaos run's resume steps; its checkpoint folder."""
    previous: Path | None = None
    for i, seg in enumerate(segments(chaos_worlds)):
        folder = work / f"ref{i}"
        folder.mkdir()
        if previous is not None:
            name = f"ckpt-{seg.start:08d}.pt"
            shutil.copy2(previous / name, folder / name)
            (folder / "latest").write_text(name + "\n")
        later = segments(chaos_worlds)[i + 1:]
        until = later[0].start if later else None
        _segment(args, folder, seg.size, until)
        previous = folder
    assert previous is not None
    return previous


def _segment(args: argparse.Namespace, folder: Path, world: int, until: int | None) -> None:
    """Trains with `world` ranks from the folder's checkpoint, until a checkpoint of step
    `until` exists, or to the end. A checkpoint is written where the step is a multiple of
    --checkpoint-every: `until` itself is the one multiple of `until` past the start."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "ddpkit.train", *train_args(args), "--checkpoint-dir", str(folder),
            "--checkpoint-every", str(until or args.steps),
            "--keep-global-batch-of", str(NODES)]  # what the spec's elastic.keep_global_batch adds
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
           "CHAOS_PACE_S": "0"}
    with (folder / "ref.out").open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        if until is None:
            if proc.wait(timeout=WAIT_S * 2) != 0:
                raise RuntimeError(f"the reference's last segment failed: see {folder / 'ref.out'}")
            return
        target = folder / f"ckpt-{until:08d}.pt"
        wait_until(lambda: target.exists() or proc.poll() is not None, WAIT_S, f"no reference step {until}")
        if not target.exists():
            raise RuntimeError(f"the reference ended before step {until}: see {folder / 'ref.out'}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    name = (folder / "latest").read_text().strip()
    model: dict[str, torch.Tensor] = torch.load(folder / name, map_location="cpu", weights_only=False)["model"]
    return model


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """'' where every tensor is equal bit for bit, else the first that is not."""
    if a.keys() != b.keys():
        return f"other keys: {sorted(set(a) ^ set(b))}"
    for key in a:
        if not torch.equal(a[key], b[key]):
            return f"{key}: max |diff| {(a[key].float() - b[key].float()).abs().max().item():.3g}"
    return ""


# ---- report -----------------------------------------------------------------------------------------

def report(outcome: Outcome) -> str:
    survived = sum(1 for e in outcome.episodes if e.to_full_world_s is not None)
    faults = sum(len(e.faults) for e in outcome.episodes)
    lines = [f"{'moment':<13} {'faults':<40} {'hit':<4} {'first step s':>12} {'full world s':>12}"]
    for e in outcome.episodes:
        what = ", ".join(f"{k} n{n}" for k, n in e.faults)
        lines.append(f"{e.moment:<13} {what:<40} {'yes' if e.hit else 'no':<4} {e.to_first_step_s!s:>12} "
                     f"{e.to_full_world_s!s:>12}")
    lines += [
        f"episodes survived: {survived} of {len(outcome.episodes)} ({faults} faults)",
        f"steps trained twice: {outcome.steps_trained_twice}",
        f"world sizes: {' -> '.join(f'{w.size}@{w.start}' for w in outcome.worlds)}",
        f"launcher: exit {outcome.exit_code}; last line: {outcome.closing}",
        f"corrupt checkpoints: {len(outcome.corrupt)}; left running: {len(outcome.left_running)}",
        *([f"stopped injecting: {outcome.error}"] if outcome.error else []),
        "final weights vs the fault-free reference: " + (
            "bitwise equal" if outcome.bitwise_equal else f"DIFFER ({outcome.differs})"),
    ]
    return "\n".join(lines)


def passed(outcome: Outcome, episodes: int) -> bool:
    return (outcome.exit_code == 0 and len(outcome.episodes) == episodes
            and all(e.to_full_world_s is not None for e in outcome.episodes)
            and not outcome.corrupt and not outcome.left_running and bool(outcome.bitwise_equal))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("local", "ssh"), default="local")
    parser.add_argument("--seed", type=int, default=1, help="draws the faults, their nodes and moments")
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--kinds", default=None, help=f"comma-separated, of {', '.join(KINDS)} "
                        "(default: all the target allows)")
    parser.add_argument("--steps", type=int, default=600, help="the job's length (--max-steps)")
    parser.add_argument("--pace-s", type=float, default=0.05, help="each forward pass sleeps this long")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--loss-s", type=int, default=5, help="watchdog.loss_s")
    parser.add_argument("--last-call-s", type=int, default=5, help="elastic.last_call_s")
    parser.add_argument("--deadline-s", type=float, default=3600,
                        help="stop the job, saying its state, if it runs longer than this")
    parser.add_argument("--work", type=Path, default=None, help="keep the run's files here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    allowed = [k for k in KINDS if k != "link" or args.target != "local"]
    args.kinds = args.kinds.split(",") if args.kinds else allowed
    if set(args.kinds) - set(allowed):
        parser.error(f"--kinds: {args.target} takes {', '.join(allowed)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="ddpkit-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    outcome = chaos_run(args, work)
    return finish(args, work, outcome, [asdict(e) for e in plan(args.seed, args.episodes, args.kinds)],
                  f"chaos-{args.target}", keep=args.work is not None)


def finish(args: argparse.Namespace, work: Path, outcome: Outcome, planned: list[dict[str, Any]], name: str,
           keep: bool = False) -> int:
    """The fault-free reference and the comparison, the report, the result file; the exit code.
    The run's files are kept where it did not pass (or where `keep`)."""
    t0 = time.time()
    if outcome.exit_code == 0:
        ref = reference(args, work, outcome.worlds)
        outcome.differs = difference(final_model(work / "ckpt"), final_model(ref))
        outcome.bitwise_equal = not outcome.differs
    outcome.reference_seconds = round(time.time() - t0, 1)
    ok = passed(outcome, args.episodes)
    if not ok and not keep:
        print(f"chaos: kept the run's files in {work}", flush=True)
    elif not keep:
        shutil.rmtree(work, ignore_errors=True)
    print(report(outcome))
    result = {"machine": machine(), "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "plan": planned, "outcome": asdict(outcome), "passed": ok}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
