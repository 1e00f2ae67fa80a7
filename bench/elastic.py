"""A lost node: how long until the survivors train again, per target, per kind
of loss, per recovery path, beside torchft (issue 30's benchmark).

A 3-node elastic job (min_nodes 2, one process per node, CPU/gloo, a
checkpoint every --checkpoint-every steps). Mid-run, at a random step after
the first checkpoint, the last node is lost (--lost-nodes 0,2: node 0 too, a
row of its own; `launch local` and `launch ssh` host the rendezvous store in
the launcher, on the other targets node 0 holds it) (bench/recovery.py):
- crash: its torchrun agent and workers SIGKILLed;
- freeze: its agent and workers SIGSTOPped (nothing closes, nothing answers);
- link: its host's link cut at the switch (ssh, slurm: namespace hosts).

Measured from rank 0's metrics file (one record per step with its wall-clock
time, and a `resume` record for each run that started from a checkpoint):
- loss -> first step: from the loss to the first step the survivors train;
- steps lost: steps trained since the step the survivors resumed from.

Variants (the same job, the same target):
- torchrun-defaults: the spec set to torchrun's own rendezvous
  (TORCHRUN_DEFAULTS: elastic.rendezvous "torchrun", plain c10d with
  keep-alive 5 s x 3 and last call 30 s), what ddpkit rendered before
  issue 30 (a silent node is now noticed at loss_s 15 there, where the
  stall verdict took 60 s before);
- ddpkit-fast: the same spec with --fast-spec merged in (default
  {"watchdog": {"loss_s": 10}}: issue 30's one setting); skipped, with the
  reason, where this checkout's spec does not accept it;
- torchft: bench/torchft_anchor.py on this machine (crash and freeze): the
  anchor every target's row is divided by.

Targets:
- local: `ddpkit launch local` (three agents on this machine);
- ssh: `ddpkit launch ssh` on three network-namespace hosts with sshd
  (tests/infra, root);
- slurm: the rendered sbatch script (torchrun mode) on a real slurmctld and
  three slurmds (tests/infra, root);
- compose: the rendered compose file under `docker compose up -d` on a Docker
  daemon (DOCKER_HOST's, or one started as root), three containers of the CPU
  image; the lost container killed (`docker kill`), paused (`docker pause`)
  or cut off its network (`docker network disconnect`).

    python -m bench.elastic [--targets local,ssh,slurm,compose] [--losses crash,freeze,link]
        [--variants torchrun-defaults,ddpkit-fast,torchft] [--lost-nodes 2] [--repeats 1]
        [--baseline-repeats N] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml
from bench import torchft_anchor
from bench.common import ROOT, machine
from bench.recovery import LOSSES, Measurement, end_frozen, end_launcher, summary, table, take_away, wait_until, work_folder
from pydantic import ValidationError

from ddpkit.spec import JobSpec

NODES, MIN_NODES = 3, 2
TARGETS = ("local", "ssh", "slurm", "compose")
VARIANTS = ("torchrun-defaults", "ddpkit-fast", "torchft")
# elastic.rendezvous "torchrun": torch's plain c10d handler with torchrun's own keep-alive (5 s x 3) and
# last call (30 s), the rendezvous of the path before issue 30; a silent node is noticed at loss_s 15,
# when torchrun's keep-alive expires.
TORCHRUN_DEFAULTS: dict[str, Any] = {"elastic": {"rendezvous": "torchrun"}, "watchdog": {"loss_s": 15}}
DDPKIT = str(Path(sys.executable).with_name("ddpkit"))
HOSTS = ["node1", "node2", "node3"]
LOST = 2  # the node taken away unless --lost-nodes says otherwise


def train_args(ckpt: Path, metrics: Path, args: argparse.Namespace) -> list[str]:
    return ["--model", "tiny", "--image-size", "16", "--workers", "0", "--progress", "plain",
            "--synthetic-size", str(args.samples), "--batch-size", "8", "--epochs", "1", "--no-eval",
            "--device", "cpu", "--backend", "gloo", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
            str(args.checkpoint_every), "--keep", "1000", "--resume", "auto", "--metrics", str(metrics),
            "--log-every", "1", "--dist-timeout", "120"]


@dataclass(frozen=True)
class Record:
    kind: str  # "train" (a step), "checkpoint" (written at `step`) or "resume" (a run started from one)
    step: int
    time: float


def metric_records(metrics: Path) -> list[dict[str, Any]]:
    """Rank 0's metrics records, complete lines only (it may be writing the last one)."""
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().split("\n")[:-1]]


def records(metrics: Path) -> list[Record]:
    return [Record(r["kind"], r["step"], r["time"]) for r in metric_records(metrics)
            if r.get("kind") in ("train", "resume", "checkpoint")]


def steps(metrics: Path) -> list[tuple[int, float]]:
    return [(r.step, r.time) for r in records(metrics) if r.kind == "train"]


@dataclass(frozen=True)
class Loss:
    killed_at: int  # the last step trained before the node was gone
    lost_at: float  # wall clock once the loss was done
    first_after: float  # wall clock of the survivors' first step
    resumed: int  # the step they resumed from


def after_loss(written: list[Record], lost_at: float) -> Loss | None:
    """The survivors' run is told apart by its `resume` record, the first one
    written after the loss (their workers start only once the loss is seen),
    not by step times: the old world trains on while the loss is being done
    (finding the processes takes longer than a step here), and a step it had
    in flight is written after it. None until the survivors trained."""
    for i, rec in enumerate(written):
        if rec.kind == "resume" and rec.time > lost_at:
            first = next((r for r in written[i + 1:] if r.kind == "train"), None)
            if first is None:
                return None
            # a step's checkpoint (the one written at the loss, too) says it was completed, also when
            # its `train` record was still in the buffer of a rank that left by os._exit
            killed_at = max(r.step for r in written[:i] if r.kind in ("train", "checkpoint"))
            return Loss(killed_at, lost_at, first.time, rec.step)
    return None


class Lost(Protocol):
    """How to take the lost node away on a target, and to end what is left of it."""

    def lose(self, loss: str) -> None: ...

    def restore(self, loss: str) -> None: ...


@dataclass
class Node:
    """A node that is processes on a host: its agent and workers, and the host's link."""

    pids: Callable[[], list[int]]  # its torchrun agent and workers
    set_link: Callable[[bool], None] | None = None  # its host's link (netns targets)
    frozen: list[int] | None = None

    def lose(self, loss: str) -> None:
        if loss == "link":
            assert self.set_link is not None
            self.set_link(False)
        else:
            self.frozen = self.pids()
            take_away(self.frozen, loss)

    def restore(self, loss: str) -> None:
        if loss == "link" and self.set_link is not None:
            self.set_link(True)
        if self.frozen:
            end_frozen(self.frozen)


def lose_a_node(metrics: Path, node: Lost, loss: str, every: int) -> Loss:
    """Take the node away at a random step after the first checkpoint; wait for the survivors' first step."""
    at = random.randint(every + 1, 3 * every)
    wait_until(lambda: any(s >= at for s, _ in steps(metrics)), 300, "no step to take the node away at")
    try:
        node.lose(loss)
        lost_at = time.time()
        found = wait_until(lambda: after_loss(records(metrics), lost_at), 400, "the survivors never trained again")
    finally:
        node.restore(loss)
    assert found is not None  # wait_until returns only a truthy value
    return found


def restart_breakdown(metrics: Path, lost_at: float) -> dict[str, float]:
    """Where the survivors' time went: until their new workers' processes
    started, then the new rank 0's start-up phases (its `startup` record)."""
    # a worker whose first step came after the loss: with workers forked in
    # milliseconds, the job's first workers can have started a second before it
    startups = [r for r in metric_records(metrics) if r.get("kind") == "startup"
                and r["stamps"].get("first_step_done", 0) > lost_at]
    if not startups:
        return {}
    first = startups[0]
    return {"to new workers": round(first["stamps"]["process_start"] - lost_at, 2),
            **{phase: round(seconds, 2) for phase, seconds in first["phases"].items()}}


def measured(target: str, variant: str, loss: str, found: Loss, metrics: Path, node: int) -> Measurement:
    return Measurement(target, variant, loss, round(found.first_after - found.lost_at, 2),
                       found.killed_at - found.resumed, found.killed_at, found.resumed,
                       restart_s=restart_breakdown(metrics, found.lost_at), node=None if node == LOST else node)


# ---- the job spec, per variant -----------------------------------------------------

def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def fast_unavailable(fast: dict[str, Any]) -> str | None:
    """Why the ddpkit-fast column cannot run in this checkout (its spec refuses the setting), or None."""
    try:
        JobSpec.model_validate(merged({"name": "bench", "nodes": NODES, "elastic": {"min_nodes": MIN_NODES}}, fast))
    except ValidationError as exc:
        first = exc.errors()[0]
        return (f"this checkout's spec refuses {json.dumps(fast)} ({'.'.join(map(str, first['loc']))}: "
                f"{first['msg']}): issue 30's fast path is not in it")
    return None


def job_spec(work: Path, ckpt: Path, metrics: Path, args: argparse.Namespace, variant: str,
             **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "bench", "nodes": NODES, "nproc_per_node": 1, "device": "cpu", "backend": "gloo",
        "rendezvous": {"timeout_s": 300},
        "elastic": {"min_nodes": MIN_NODES, "max_restarts": 3, "max_node_failures": 1},
        "command": {"python": sys.executable, "module": "ddpkit.train", "args": train_args(ckpt, metrics, args)},
        "env": {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"},
        **extra,
    }
    if variant == "ddpkit-fast":
        spec = merged(spec, args.fast_spec)
    elif variant == "torchrun-defaults":
        spec = merged(spec, TORCHRUN_DEFAULTS)
    if args.last_call_s is not None:  # asked for: it wins over the variant's own
        spec["elastic"]["last_call_s"] = args.last_call_s
    (work / "bench.yaml").write_text(yaml.safe_dump(spec))
    return spec


# ---- launch local ------------------------------------------------------------------

def local_run(args: argparse.Namespace, variant: str, loss: str, node: int) -> Measurement:
    from tests.helpers.elastic_gate import local_node_agent

    with work_folder("ddpkit-bench-elastic-") as work:
        metrics = work / "m.jsonl"
        job_spec(work, work / "ckpt", metrics, args, variant)
        with (work / "launcher.out").open("w") as out:
            proc = subprocess.Popen([DDPKIT, "launch", "local", "-f", str(work / "bench.yaml"), "--log-dir",
                                     str(work / "logs")], stdout=out, stderr=subprocess.STDOUT, cwd=work)
        try:
            found = lose_a_node(metrics, Node(lambda: local_node_agent(proc.pid, node)), loss, args.checkpoint_every)
        finally:
            end_launcher(proc)
        return measured("local", variant, loss, found, metrics, node)


# ---- launch ssh on namespace hosts, and a real Slurm cluster ----------------------

def host_node(net: Any, name: str) -> Node:
    """The trainer on a namespace host (sshd, slurmd stay), and the host's link."""
    from tests.helpers.elastic_gate import agents_and_workers

    host = net[name]
    return Node(lambda: agents_and_workers(host.pids()), lambda up: net.set_link(host, up))


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


def ssh_run(args: argparse.Namespace, net: Any, hosts: Any, variant: str, loss: str, node: int) -> Measurement:
    with work_folder("ddpkit-bench-elastic-ssh-") as work:
        metrics = work / "m.jsonl"
        ssh = {"ssh": {"workdir": str(work), "log_dir": str(work / "logs"), "grace_s": 3, "connect_timeout_s": 3,
                       "alive_interval_s": 1, "alive_count": 3}}
        job_spec(work, work / "ckpt", metrics, args, variant, **ssh)
        hostfile = work / "hostfile"
        hostfile.write_text("".join(f"{net[n].addr}\n" for n in HOSTS))
        argv = [DDPKIT, "launch", "ssh", "-f", str(work / "bench.yaml"), "--hostfile", str(hostfile),
                *hosts.launcher_flags()]
        with (work / "launcher.out").open("w") as out:
            proc = net["login"].popen(argv, cwd=str(work), stdout=out, stderr=subprocess.STDOUT)
        try:
            found = lose_a_node(metrics, host_node(net, HOSTS[node]), loss, args.checkpoint_every)
        finally:
            end_launcher(proc)
        return measured("ssh", variant, loss, found, metrics, node)


@contextmanager
def slurm_cluster() -> Iterator[Any]:
    from tests.infra.slurm_cluster import SlurmCluster

    folder = Path(tempfile.mkdtemp(prefix="ddpkit-bench-elastic-slurm-"))
    try:
        with SlurmCluster(folder, nodes=NODES) as cluster:
            yield cluster
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def slurm_run(args: argparse.Namespace, cluster: Any, variant: str, loss: str, node: int) -> Measurement:
    with work_folder("ddpkit-bench-elastic-slurm-job-") as work:
        metrics = work / "m.jsonl"
        job_spec(work, work / "ckpt", metrics, args, variant, slurm={"requeue": False})
        done = subprocess.run([DDPKIT, "render", "slurm", "-f", str(work / "bench.yaml"), "-o", str(work)],
                              capture_output=True, text=True, check=False, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"ddpkit render slurm failed: {done.stderr}")
        job = int(cluster.sbatch(work / "bench.sbatch"))
        try:
            found = lose_a_node(metrics, host_node(cluster.net, HOSTS[node]), loss, args.checkpoint_every)
        finally:
            cluster.run(["scancel", str(job)])
            cluster.wait(job, timeout=120)
        return measured("slurm", variant, loss, found, metrics, node)


# ---- docker compose: the rendered file on a Docker daemon ----------------------------

@dataclass
class Container:
    """A node that is a container: killed (SIGKILL to all in it: not restarted, as `docker kill`
    is a stop by hand), paused (the cgroup freezer), or cut off its network."""

    docker_env: dict[str, str]
    container: str

    def lose(self, loss: str) -> None:
        if loss != "link":
            self.docker("kill" if loss == "crash" else "pause", self.container)
            return
        networks = self.docker("inspect", "--format", "{{range $name, $_ := .NetworkSettings.Networks}}{{$name}} "
                               "{{end}}", self.container)
        for network in networks.split():
            self.docker("network", "disconnect", network, self.container)

    def restore(self, loss: str) -> None:
        pass  # `down` stops and removes it, paused or cut off

    def docker(self, *words: str) -> str:
        return subprocess.run(["docker", *words], env=self.docker_env, check=True, capture_output=True,
                              text=True).stdout


@contextmanager
def docker_host(image: str | None) -> Iterator[tuple[dict[str, str], str]]:
    """A Docker daemon (DOCKER_HOST's, or one started here as root) and the CPU image of this
    checkout (docker/build.sh, as `make image-cpu`) unless `image` names one."""
    from tests.infra import docker_daemon

    daemon = docker_daemon.start_daemon()
    try:
        yield daemon.env, image or docker_daemon.build_image(daemon)
    finally:
        docker_daemon.stop_daemon(daemon)  # only one started here


def compose_run(args: argparse.Namespace, docker_env: dict[str, str], image: str, variant: str,
                loss: str, node: int) -> Measurement:
    from ddpkit.launch.control.applied import compose_cli

    with work_folder("ddpkit-bench-elastic-compose-") as work:
        metrics = work / "m.jsonl"
        inside = Path("/job")  # the work folder, bind-mounted into every container
        command = {"python": "python3", "module": "ddpkit.train",
                   "args": train_args(inside / "ckpt", inside / metrics.name, args)}
        job_spec(work, work / "ckpt", metrics, args, variant, command=command, image=image,
                 env={"OMP_NUM_THREADS": "1"}, mounts=[f"{work}:{inside}"])
        done = subprocess.run([DDPKIT, "render", "compose", "-f", str(work / "bench.yaml"), "-o", str(work)],
                              capture_output=True, text=True, check=False, cwd=ROOT, env=docker_env)
        if done.returncode != 0:
            raise RuntimeError(f"ddpkit render compose failed: {done.stderr}")
        compose = [*compose_cli(), "-f", str(work / "compose.yaml")]
        try:
            subprocess.run([*compose, "up", "-d"], env=docker_env, check=True, capture_output=True, cwd=work)
            lost = subprocess.run([*compose, "ps", "-q", f"node{node}"], env=docker_env, check=True,
                                  capture_output=True, text=True, cwd=work).stdout.split()[0]
            found = lose_a_node(metrics, Container(docker_env, lost), loss, args.checkpoint_every)
        finally:
            with (work / "compose.out").open("w") as out:  # the nodes' last lines, should a wait time out
                subprocess.run([*compose, "logs", "--no-color"], env=docker_env, stdout=out,
                               stderr=subprocess.STDOUT, check=False, cwd=work)
            subprocess.run([*compose, "down", "--timeout", "5"], env=docker_env, capture_output=True,
                           check=False, cwd=work)
        return measured("compose", variant, loss, found, metrics, node)


# ---- the plan: targets x losses x variants -----------------------------------------

Run = Callable[[str, str, int], Measurement]  # (variant, loss, lost node) -> one measurement


@contextmanager
def target_runner(target: str, args: argparse.Namespace) -> Iterator[Run]:
    """One target's hosts (built once for every run on it) and how to run there."""
    if target == "local":
        yield lambda variant, loss, node: local_run(args, variant, loss, node)
    elif target == "ssh":
        with ssh_hosts() as (net, hosts):
            yield lambda variant, loss, node: ssh_run(args, net, hosts, variant, loss, node)
    elif target == "compose":
        with docker_host(args.image) as (docker_env, image):
            yield lambda variant, loss, node: compose_run(args, docker_env, image, variant, loss, node)
    else:
        with slurm_cluster() as cluster:
            yield lambda variant, loss, node: slurm_run(args, cluster, variant, loss, node)


def skipped_cell(target: str, variant: str, loss: str, args: argparse.Namespace) -> str | None:
    if loss == "link" and target == "local":
        return "local: one machine, no link to cut"
    if variant == "ddpkit-fast":
        return fast_unavailable(args.fast_spec)
    return None


def run_plan(args: argparse.Namespace) -> tuple[list[Measurement], dict[str, str]]:
    runs: list[Measurement] = []
    skipped: dict[str, str] = {}
    ddpkit_variants = [v for v in args.variants if v != "torchft"]
    for target in args.targets:
        cells = [(v, loss, n) for n in args.lost_nodes for loss in args.losses for v in ddpkit_variants]
        todo = [(v, loss, n) for v, loss, n in cells if not note_skip(skipped, f"{target}/{loss}/{v}",
                                                                      skipped_cell(target, v, loss, args))]
        if not todo:
            continue
        with target_runner(target, args) as run:
            runs += [run(v, loss, n) for v, loss, n in rounds(todo, args)]
    if "torchft" in args.variants:
        runs += torchft_runs(args, skipped)
    return runs, skipped


def rounds(todo: list[tuple[str, str, int]], args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """The cells in turn, once per repeat, so that a change of load hits every variant alike.
    torchrun-defaults takes part in the first --baseline-repeats rounds only: its recovery is
    torchrun's fixed timeouts (15 s expiry, 30 s last call), which repeats do not move."""
    baseline = args.repeats if args.baseline_repeats is None else args.baseline_repeats
    return [(v, loss, n) for i in range(args.repeats) for v, loss, n in todo
            if v != "torchrun-defaults" or i < baseline]


def torchft_runs(args: argparse.Namespace, skipped: dict[str, str]) -> list[Measurement]:
    losses = [loss for loss in args.losses if loss in torchft_anchor.LOSSES]
    if note_skip(skipped, "local/*/torchft", torchft_anchor.unavailable()):
        return []
    out: list[Measurement] = []
    for loss in losses:
        try:
            out += torchft_anchor.runs([loss], args.repeats, args.torchft_steps, args.checkpoint_every,
                                       args.torchft_patch_comm_hook)
        except torchft_anchor.SurvivorsDied as exc:
            skipped[f"local/{loss}/torchft"] = str(exc)
    return out


def note_skip(skipped: dict[str, str], key: str, reason: str | None) -> bool:
    if reason:
        skipped[key] = reason
    return reason is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="local", help=f"comma-separated, of {', '.join(TARGETS)} "
                        "(ssh and slurm build hosts in network namespaces: root; compose needs a Docker daemon)")
    parser.add_argument("--losses", default="crash", help=f"comma-separated, of {', '.join(LOSSES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--lost-nodes", default=str(LOST),
                        help=f"comma-separated ranks of the node lost, one row each (default {LOST}, the last)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline-repeats", type=int, default=None,
                        help="runs per cell of torchrun-defaults (default: --repeats)")
    parser.add_argument("--samples", type=int, default=6000, help="synthetic samples (sets the run's length)")
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--last-call-s", type=int, default=None,
                        help="elastic.last_call_s for both ddpkit variants (default: the target's own)")
    parser.add_argument("--fast-spec", type=json.loads, default={"watchdog": {"loss_s": 10}},
                        help="JSON merged into the spec for the ddpkit-fast variant")
    parser.add_argument("--torchft-steps", type=int, default=400, help="steps each torchft group trains at most")
    parser.add_argument("--torchft-patch-comm-hook", action="store_true",
                        help="the anchor with torchft's DDP comm hook mended (bench/torchft_anchor.py --patch-comm-hook)")
    parser.add_argument("--image", help="compose: the CPU image to run (default: build this checkout's, as "
                        "`make image-cpu` does)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    for name, allowed in (("targets", TARGETS), ("losses", LOSSES), ("variants", VARIANTS)):
        chosen = getattr(args, name).split(",")
        if set(chosen) - set(allowed):
            parser.error(f"unknown {name}: {', '.join(sorted(set(chosen) - set(allowed)))}; "
                         f"choose from {', '.join(allowed)}")
        setattr(args, name, chosen)
    args.lost_nodes = [int(n) for n in args.lost_nodes.split(",")]
    if not set(args.lost_nodes) <= set(range(NODES)):
        parser.error(f"--lost-nodes: ranks of 0 to {NODES - 1}")
    runs, skipped = run_plan(args)
    result = {
        "machine": machine(),
        "setup": {"nodes": NODES, "min_nodes": MIN_NODES, "nproc_per_node": 1, "last_call_s": args.last_call_s,
                  "checkpoint_every": args.checkpoint_every,
                  "repeats": args.repeats, "baseline_repeats": args.baseline_repeats, "fast_spec": args.fast_spec,
                  "torchft": {"lighthouse": torchft_anchor.LIGHTHOUSE, "min_replicas": torchft_anchor.MIN_REPLICAS,
                              "pg_timeout_s": torchft_anchor.PG_TIMEOUT_S,
                              "max_restarts": torchft_anchor.MAX_RESTARTS,
                              "patch_comm_hook": args.torchft_patch_comm_hook},
                  "targets": args.targets, "losses": args.losses, "variants": args.variants,
                  "lost_nodes": args.lost_nodes},
        "runs": [asdict(r) for r in runs],
        "medians": summary(runs),
        "skipped": skipped,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(runs, [v for v in args.variants if v != "torchft"]))
    print("median s from the loss to the survivors' first step (steps lost: trained again); "
          "x/torchft: that over torchft's median on this machine for the same loss kind")
    for r in runs:
        if r.restart_s:
            print(f"{r.target} {r.variant} {r.row}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.restart_s.items()))
    for key, reason in skipped.items():
        print(f"skipped {key}: {reason}")
    print(f"wrote {args.out / 'elastic.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
