"""The chaos run on a real Slurm cluster (slurmctld and three slurmds in
network namespaces, tests/infra, root): the rendered sbatch script of an
elastic job (torchrun mode, 3 nodes, min_nodes 2, `slurm.requeue: true`),
faults at moments a seed draws, checked as bench/chaos.py checks a launcher's
run: the job ends COMPLETED, and its final weights are bit for bit those of a
fault-free run that changed world size at the same steps.

On Slurm nothing brings a lost node back while the job step runs (the batch
script relaunches a step only once it ended), and node 0, the batch host,
holds the rendezvous store: its loss has the other nodes requeue the job,
which resumes from its last checkpoint. So the episodes follow that shape,
three in a row, the seed drawing their nodes and the first one's moment:
1. one worker's crash, during a checkpoint write or a step (the agents
   re-form the job on the same 3 nodes);
2. a node's trainer crashed (its agent and workers SIGKILLed, its slurmd
   answers): the others go on with world size 2;
3. the batch host lost, every process on it (slurmd, the batch shell, the
   store, the trainer) SIGKILLed while rank 0 writes the last step or at a
   step: the others requeue the job, its slurmd is started again, and the
   job resumes on 3 nodes.

    python -m bench.chaos_slurm [--seed 1] [--steps 500] [--out bench/results]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from bench import chaos, recovery
from bench.chaos import NODES, Chaos, Episode, HostNodes, Injected, Outcome
from bench.common import ROOT
from bench.elastic import slurm_cluster

from ddpkit.launch.supervise import proctree


def plan(seed: int) -> list[Episode]:
    rng = random.Random(seed)
    return [Episode(rng.choice(["checkpoint", "step"]), ("worker",), (rng.randrange(NODES),), rng.randint(3, 8)),
            Episode("step", ("crash",), (rng.choice([1, 2]),), rng.randint(3, 8)),
            Episode(rng.choice(["last-step", "step"]), ("host",), (0,), rng.randint(3, 8))]


@dataclass
class SlurmJob:
    """A submitted job, seen as the launchers' process is by bench/chaos.py."""

    cluster: Any
    job: int
    info: Any = None
    asked: float = 0.0

    def poll(self) -> int | None:
        if self.info is None or (not self.info.finished and time.monotonic() - self.asked > 1.0):
            self.asked = time.monotonic()
            try:
                self.info = self.cluster.job(self.job)  # scontrol, once a second
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a loaded slurmctld: ask again later
                print(f"chaos: scontrol show job {self.job}: {exc}", flush=True)
        if self.info is None or not self.info.finished:
            return None
        return 0 if self.info.state == "COMPLETED" else 1

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.poll()

    def send_signal(self, _sig: int) -> None:
        self.cluster.run(["scancel", str(self.job)])


@dataclass
class SlurmChaos(Chaos):
    """bench/chaos.py's injector, with the batch host's loss (`host`) and what follows it."""

    cluster: Any = None
    job: SlurmJob | None = None

    def hit(self, kind: str, node: int) -> None:
        if kind != "host":
            super().hit(kind, node)
            return
        assert self.cluster is not None and self.job is not None
        host = self.cluster.net[chaos.HOSTS[node]]
        proctree.signal_all(host.pids(), signal.SIGKILL)  # slurmd, the batch shell, the store, the trainer
        job, cluster = self.job, self.cluster

        def back() -> None:  # once the others had the job requeued, the host comes back (a reboot)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not requeued(cluster, job.job):
                time.sleep(0.5)
            print(f"chaos: node 0's slurmd started again: {cluster.restart_dead_slurmds()}", flush=True)
        threading.Thread(target=back, name="batch host back", daemon=True).start()

    def _last_step(self, ep: Episode) -> Injected:
        """rank 0's node is the batch host here: a worker's crash elsewhere makes rank 0 write."""
        other = self.rng.choice([n for n in range(1, NODES) if chaos.workers(self.nodes.pids(n))])
        at = time.time()
        super().hit("worker", other)
        done = Injected(ep.moment, [("worker", other)], at, False)
        pid = self._temporary_file(lambda p: p in chaos.workers(self.nodes.pids(0)), timeout=60)
        done.hit = pid is not None
        self.hit(ep.kinds[0], 0)
        done.faults.append((ep.kinds[0], 0))
        return done


def requeued(cluster: Any, job: int) -> bool:
    """The job was requeued; False too where scontrol did not answer (a loaded slurmctld)."""
    try:
        return bool(cluster.job(job).restarts >= 1)
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return False


def state(cluster: Any, job: int, work: Path) -> str:
    """What Slurm says of the job and its nodes, and the tail of the job's output."""
    said = []
    for cmd in (["scontrol", "show", "job", str(job)], ["sinfo", "-N", "-o", "%N %T %E"],
                ["squeue", "-a", "-o", "%i %T %r %N"]):
        try:
            done = cluster.run(cmd, timeout=20)
            said.append(f"--- {' '.join(cmd)}:\n{done.stdout.strip()}{done.stderr.strip()}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            said.append(f"--- {' '.join(cmd)}: {exc}")
    logs = [*sorted(work.glob("*.out")), cluster.workdir / "slurmctld.log", *sorted(cluster.workdir.glob("slurmd-*.log"))]
    return "\n".join([*said, *(recovery.tail(p, 30) for p in logs)])


def job_spec(work: Path, args: argparse.Namespace, mark: str) -> Path:
    spec = yaml.safe_load(chaos.job_spec(work, args, mark).read_text())
    spec["elastic"].pop("max_node_failures")  # a launcher's setting; Slurm's batch script relaunches
    spec["slurm"] = {"requeue": True}
    path = work / "chaos.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(args: argparse.Namespace, work: Path, cluster: Any) -> Outcome:
    mark = f"chaos-run-{os.getpid()}-{int(time.time())}"
    spec = job_spec(work, args, mark)
    done = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "-f", str(spec), "-o", str(work)],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"ddpkit render slurm failed: {done.stderr}")
    job = SlurmJob(cluster, cluster.sbatch(work / "chaos.sbatch"))
    injector = SlurmChaos(HostNodes(cluster.net), work / "m.jsonl", work / "ckpt", random.Random(args.seed + 1),
                          args.pace_s, cluster=cluster, job=job)
    t0 = time.time()
    alive = lambda: job.poll() is None  # noqa: E731
    watch = chaos.stop_when_late(args.deadline_s, lambda: state(cluster, job.job, work),
                                 lambda: job.send_signal(signal.SIGINT))
    injected: list[Injected] = []
    try:
        error = chaos.started(injector, alive, checkpointed=False)
        if not error:
            injected, error = injector.inject_all(plan(args.seed), alive, [NODES, NODES - 1, NODES])
        job.wait(timeout=args.steps * (args.pace_s * 4 + 0.5) + 300)
    finally:
        watch.set()
        if job.poll() is None:
            job.send_signal(signal.SIGINT)
            job.wait(120)
    info = job.info
    if info is None:
        return chaos.outcome_of(work, None, f"Slurm: job {job.job}: scontrol never answered", injected, mark,
                                error, t0)
    closing = f"Slurm: job {job.job} {info.state}, exit code {info.exit_code}, restarts {info.restarts}"
    return chaos.outcome_of(work, 0 if info.state == "COMPLETED" else 1, closing, injected, mark, error, t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--pace-s", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--loss-s", type=int, default=5)
    parser.add_argument("--last-call-s", type=int, default=5)
    parser.add_argument("--deadline-s", type=float, default=3600,
                        help="cancel the job, saying its state, if it runs longer than this")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.episodes = 3
    work = Path(tempfile.mkdtemp(prefix="ddpkit-chaos-slurm-job-"))
    with slurm_cluster() as cluster:
        outcome = run(args, work, cluster)
    return chaos.finish(args, work, outcome, [asdict(e) for e in plan(args.seed)], "chaos-slurm")


if __name__ == "__main__":
    sys.exit(main())
