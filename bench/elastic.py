"""Elastic recovery vs resubmitting by hand (issue 15's benchmark), per target.

A 3-node elastic job (min_nodes 2, one process per node, CPU/gloo). Mid-run,
at a random step after the first checkpoint, the last node's torchrun agent
and workers are SIGKILLed. Measured from the metrics file (rank 0's
records, in the order they happened: one per step with its wall-clock
time, and the `resume` record of each run that started from a checkpoint):

- loss -> resumed: from the kill to the first step the two survivors train;
- steps lost: steps trained since the checkpoint the survivors resumed from;
- by hand: a fresh static 2-node job from that same checkpoint on the same
  target, from its launch (Slurm: its sbatch, so the queue is in it) to its
  first step: what resubmitting costs once someone noticed, without the
  noticing.

Targets:
- local: three torchrun elastic agents on this machine, with the rendezvous
  timeouts and job environment ddpkit renders for SSH;
- ssh: `ddpkit launch ssh` on three network-namespace hosts with sshd
  (tests/infra, root);
- slurm: the rendered sbatch script (torchrun mode) on a real slurmctld and
  three slurmds (tests/infra, root).

    python -m bench.elastic [--targets local,ssh,slurm] [--repeats 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from bench.common import ROOT, machine, spread

from ddpkit.contract import Target, elastic_env, rdzv_conf
from ddpkit.launch import proctree
from ddpkit.spec import JobSpec

NODES, MIN_NODES = 3, 2
SPEC = JobSpec.model_validate({"name": "bench", "nodes": NODES, "elastic": {"min_nodes": MIN_NODES}})
CONF = rdzv_conf(SPEC, Target.SSH)  # the SSH launcher's rendezvous timeouts
TARGETS = ("local", "ssh", "slurm")
DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
HOSTS = ["node1", "node2", "node3"]
T = TypeVar("T")


@dataclass(frozen=True)
class Recovery:
    target: str
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


def start_agents(work: Path, args: list[str], last_call_s: int) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    procs = []
    for node in range(NODES):
        conf = ",".join(f"{k}={v}" for k, v in {**CONF, "is_host": int(node == 0), "join_timeout": 300,
                                                   "last_call_timeout": last_call_s}.items())
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={MIN_NODES}:{NODES}",
                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench", f"--rdzv-conf={conf}", "--max-restarts=3", "-m", "ddpkit.train", *args]
        with open(work / f"node{node}.out", "wb") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env(node), cwd=work))
    return procs


@dataclass(frozen=True)
class Record:
    kind: str  # "train" (a step) or "resume" (a run started from the checkpoint at `step`)
    step: int
    time: float


def records(metrics: Path) -> list[Record]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().split("\n")[:-1]  # complete lines only
    return [Record(r["kind"], r["step"], r["time"]) for r in map(json.loads, lines)
            if r.get("kind") in ("train", "resume")]


def steps(metrics: Path) -> list[tuple[int, float]]:
    return [(r.step, r.time) for r in records(metrics) if r.kind == "train"]


def wait_until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Polls until `predicate` returns something truthy, and returns that; raises
    TimeoutError(what) after `timeout` s (kept under the tests' 600 s limit, so a
    bench smoke test fails with the reason rather than a timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


@contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    """One run's temporary folder. A timeout inside carries the last lines of
    every `*.out` in it (the launcher's, the nodes', Slurm's): the folder is
    gone by the time anyone reads the failure, and "no step to kill at" alone
    says nothing of why."""
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        try:
            yield work
        except TimeoutError as exc:
            tails = "".join(f"\n--- {p.name}, last lines:\n"
                            + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                            for p in sorted(work.glob("*.out")))
            raise TimeoutError(f"{exc}{tails}") from None


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
        return wait_until(lambda: steps(metrics), 300, "the job started by hand never trained a step")[0][1] - started
    finally:
        for p in procs:
            kill_tree(p)


@dataclass(frozen=True)
class Loss:
    killed_at: int  # the last step trained before the node was gone
    lost_at: float  # wall clock once the kill was done
    first_after: float  # wall clock of the survivors' first step
    resumed: int  # the step of the checkpoint they resumed from


def lose_a_node(metrics: Path, kill: Callable[[], None], every: int) -> Loss:
    """Kill at a random step after the first checkpoint; wait for the
    survivors' first step."""
    kill_after = random.randint(every + 1, 3 * every)
    wait_until(lambda: any(s >= kill_after for s, _ in steps(metrics)), 300, "no step to kill at")
    kill()
    lost_at = time.time()
    loss = wait_until(lambda: after_loss(records(metrics), lost_at), 300, "the survivors never trained again")
    assert loss is not None  # wait_until returns only a truthy value
    return loss


def after_loss(written: list[Record], lost_at: float) -> Loss | None:
    """The survivors' run is told apart by its `resume` record, the first one
    written after the kill (their workers start only once the loss is seen),
    not by step times: the old world trains on while the kill is being done
    (finding the processes takes longer than a step here), and a step it had
    in flight is written after the kill. None until the survivors trained."""
    for i, rec in enumerate(written):
        if rec.kind == "resume" and rec.time > lost_at:
            first = next((r for r in written[i + 1:] if r.kind == "train"), None)
            if first is None:
                return None
            killed_at = max(r.step for r in written[:i] if r.kind == "train")
            return Loss(killed_at, lost_at, first.time, rec.step)
    return None


def hold(ckpt: Path, step: int, work: Path) -> Path:
    """A checkpoint folder holding only `step`'s checkpoint: what a job started by hand resumes from."""
    held = work / "held"
    held.mkdir()
    shutil.copy2(ckpt / f"ckpt-{step:08d}.pt", held)
    (held / "latest").write_text(f"ckpt-{step:08d}.pt\n")
    return held


def recovery(target: str, loss: Loss, by_hand_s: float) -> Recovery:
    return Recovery(target, round(loss.first_after - loss.lost_at, 2), loss.killed_at - loss.resumed, loss.resumed,
                    loss.killed_at, round(by_hand_s, 2))


def local_run(args: argparse.Namespace) -> Recovery:
    with work_folder("ddpkit-bench-elastic-") as work:
        ckpt, metrics = work / "ckpt", work / "m.jsonl"
        procs = start_agents(work, train_args(ckpt, metrics, args), args.last_call_s)
        try:
            loss = lose_a_node(metrics, lambda: kill_tree(procs[2]), args.checkpoint_every)
            held = hold(ckpt, loss.resumed, work)
        finally:
            for p in procs:
                kill_tree(p)
        return recovery("local", loss, by_hand(work, held, args))


# ---- launch ssh on namespace hosts, and a real Slurm cluster ----------------------

def job_spec(work: Path, ckpt: Path, metrics: Path, args: argparse.Namespace, nodes: int,
             **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "bench", "nodes": nodes, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 300},
        "command": {"python": sys.executable, "module": "ddpkit.train", "args": train_args(ckpt, metrics, args)},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"},
        **extra,
    }
    if nodes == NODES:
        spec["elastic"] = {"min_nodes": MIN_NODES, "max_restarts": 3, "max_node_failures": 1,
                           "last_call_s": args.last_call_s}
    (work / "bench.yaml").write_text(yaml.safe_dump(spec))
    return spec


def kill_trainer(host: Any) -> None:
    """The node's torchrun agent and workers die; the host (sshd, slurmd) stays."""
    from tests.helpers.elastic_gate import agents_and_workers

    proctree.signal_all(agents_and_workers(host.pids()), signal.SIGKILL)


@contextmanager
def ssh_hosts() -> Iterator[tuple[Any, Any]]:
    from tests.infra import netns, sshd

    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-elastic-hosts-"))
    try:
        with netns.Network(["login", *HOSTS], prefix=f"dkb{os.getpid() % 10000}") as net:
            net.wait_reachable()
            with sshd.SshHosts(net.hosts[1:], net.hosts[0], folder) as hosts:
                yield net, hosts
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def launch_ssh(net: Any, hosts: Any, work: Path, nodes: int, tag: str) -> subprocess.Popen[str]:
    hostfile = work / f"hostfile.{tag}"
    hostfile.write_text("".join(f"{net[n].addr}\n" for n in HOSTS[:nodes]))
    argv = [DDPKIT, "launch", "ssh", "-f", str(work / "bench.yaml"), "--hostfile", str(hostfile),
            *hosts.launcher_flags()]
    with (work / f"launcher.{tag}.out").open("w") as out:
        proc: subprocess.Popen[str] = net["login"].popen(argv, cwd=str(work), stdout=out, stderr=subprocess.STDOUT)
    return proc


def end_launcher(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C's path: the launcher stops every node (within the grace chain) and exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ssh_run(args: argparse.Namespace, net: Any, hosts: Any) -> Recovery:
    with work_folder("ddpkit-bench-elastic-ssh-") as work:
        ckpt, metrics = work / "ckpt", work / "m.jsonl"
        ssh = {"ssh": {"workdir": str(work), "log_dir": str(work / "logs"), "grace_s": 3, "connect_timeout_s": 3,
                       "alive_interval_s": 1, "alive_count": 3}}
        job_spec(work, ckpt, metrics, args, NODES, **ssh)
        proc = launch_ssh(net, hosts, work, NODES, "elastic")
        try:
            loss = lose_a_node(metrics, lambda: kill_trainer(net[HOSTS[-1]]), args.checkpoint_every)
            held = hold(ckpt, loss.resumed, work)
        finally:
            end_launcher(proc)
        by_hand_metrics = work / "by-hand.jsonl"
        job_spec(work, held, by_hand_metrics, args, MIN_NODES, **ssh)
        started = time.time()
        proc = launch_ssh(net, hosts, work, MIN_NODES, "by-hand")
        try:
            trained = wait_until(lambda: steps(by_hand_metrics), 300, "the job launched by hand never trained a step")
        finally:
            end_launcher(proc)
        return recovery("ssh", loss, trained[0][1] - started)


@contextmanager
def slurm_cluster() -> Iterator[Any]:
    from tests.infra.slurm_cluster import SlurmCluster

    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-elastic-slurm-"))
    try:
        with SlurmCluster(folder, nodes=NODES) as cluster:
            yield cluster
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def sbatch(cluster: Any, work: Path) -> int:
    done = subprocess.run([DDPKIT, "render", "slurm", "-f", str(work / "bench.yaml"), "-o", str(work)],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"ddpkit render slurm failed: {done.stderr}")
    return int(cluster.sbatch(work / "bench.sbatch"))


def cancel(cluster: Any, job: int) -> None:
    cluster.run(["scancel", str(job)])
    cluster.wait(job, timeout=120)


def slurm_run(args: argparse.Namespace, cluster: Any) -> Recovery:
    with work_folder("ddpkit-bench-elastic-slurm-job-") as work:
        ckpt, metrics = work / "ckpt", work / "m.jsonl"
        job_spec(work, ckpt, metrics, args, NODES, slurm={"requeue": False})
        job = sbatch(cluster, work)
        try:
            loss = lose_a_node(metrics, lambda: kill_trainer(cluster.net[HOSTS[-1]]), args.checkpoint_every)
            held = hold(ckpt, loss.resumed, work)
        finally:
            cancel(cluster, job)
        by_hand_metrics = work / "by-hand.jsonl"
        job_spec(work, held, by_hand_metrics, args, MIN_NODES, slurm={"requeue": False})
        started = time.time()
        job = sbatch(cluster, work)
        try:
            trained = wait_until(lambda: steps(by_hand_metrics), 300, "the job submitted by hand never trained a step")
        finally:
            cancel(cluster, job)
        return recovery("slurm", loss, trained[0][1] - started)


def runs_on(target: str, args: argparse.Namespace) -> list[Recovery]:
    if target == "local":
        return [local_run(args) for _ in range(args.repeats)]
    if target == "ssh":
        with ssh_hosts() as (net, hosts):
            return [ssh_run(args, net, hosts) for _ in range(args.repeats)]
    with slurm_cluster() as cluster:
        return [slurm_run(args, cluster) for _ in range(args.repeats)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="local", help=f"comma-separated, of {', '.join(TARGETS)} "
                        "(ssh and slurm build hosts in network namespaces: root)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=6000, help="synthetic samples (sets the run's length)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--last-call-s", type=int, default=CONF["last_call_timeout"],
                        help="elastic.last_call_s: how long a rendezvous with min_nodes waits for more "
                             f"(default {CONF['last_call_timeout']}, the SSH target's own)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    targets = args.targets.split(",")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    runs = [r for target in targets for r in runs_on(target, args)]
    result = {
        "machine": machine(),
        "setup": {"nodes": NODES, "min_nodes": MIN_NODES, "nproc_per_node": 1, "last_call_timeout_s": args.last_call_s,
                  "heartbeat_expiry_s": 15, "checkpoint_every": args.checkpoint_every, "targets": targets},
        "runs": [asdict(r) for r in runs],
        "by_target": {t: by_target([r for r in runs if r.target == t]) for t in targets},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'target':<7} {'run':>3} {'loss->resumed s':>16} {'steps lost':>11} {'by hand: launch->first step s':>30} "
          f"{'ratio':>6}")
    for i, r in enumerate(runs):
        ratio = r.loss_to_resumed_s / r.by_hand_launch_to_first_step_s
        print(f"{r.target:<7} {i:>3} {r.loss_to_resumed_s:>16.1f} {r.steps_lost:>11} "
              f"{r.by_hand_launch_to_first_step_s:>30.1f} {ratio:>6.2f}")
    print("ratio: elastic recovery time / a fresh job's launch-to-first-step on the same target (the by-hand path "
          "also needs someone to notice and resubmit)")
    print(f"wrote {args.out / 'elastic.json'}")
    return 0


def by_target(runs: list[Recovery]) -> dict[str, Any]:
    return {
        "loss_to_resumed_s": spread(r.loss_to_resumed_s for r in runs),
        "steps_lost": spread(r.steps_lost for r in runs),
        "by_hand_launch_to_first_step_s": spread(r.by_hand_launch_to_first_step_s for r in runs),
        "ratio": spread(r.loss_to_resumed_s / r.by_hand_launch_to_first_step_s for r in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
