"""torchft as the anchor: what a user who picked torchft instead of ddpkit's
elastic jobs gets when a replica is lost (issue 30's benchmark).

torchft's own DDP pattern (its train_ddp.py), on gloo/CPU: a real lighthouse
process (`torchft_lighthouse`), and 3 replica groups of 1 process each, every
one started by `torchrun --standalone` as torchft's README does. Each group
builds a `Manager` (its per-step quorum through the lighthouse) with
torchft's `DistributedDataParallel` and `Optimizer` wrappers around the same
tiny CNN and batch as bench/elastic.py (`--model tiny`, 16 px,
batch 8). Mid-run, once all three take part in the steps, the last group's
torchrun agent and worker are SIGKILLed (crash) or SIGSTOPped (freeze).

Measured from each group's metrics file (one JSON line per step attempt:
committed or not, the step, the wall clock, the participants of its quorum):
- loss -> first step: from the loss to the first step a survivor commits
  in a quorum without the lost group;
- steps lost: committed steps trained again (torchft never rolls back: 0);
- discarded in flight: the survivors' step attempts not committed after the
  loss (their gradients were thrown away: the step in flight).

torchft's settings, as documented (README's lighthouse command line and
train_ddp.py): lighthouse --quorum_tick_ms 100 --join_timeout_ms 10000 and
its default --heartbeat_timeout_ms 5000; --min_replicas 2 (the analog of
bench/elastic.py's min_nodes 2); Manager heartbeat_interval 100 ms (default),
timeout 30 s; ProcessGroupGloo timeout 5 s; each group's torchrun with
--max-restarts 10 (torchft's torchx component), so a group whose worker dies
is started again and heals from a peer.

    python -m bench.torchft_anchor [--losses crash,freeze] [--repeats 1] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine
from bench.recovery import Measurement, end_frozen, kill_tree, take_away, wait_until, work_folder

from ddpkit.launch.local import free_port
from ddpkit.launch.supervise import proctree

GROUPS, MIN_REPLICAS = 3, 2
LIGHTHOUSE = {"quorum_tick_ms": 100, "join_timeout_ms": 10000, "heartbeat_timeout_ms": 5000}
MANAGER_TIMEOUT_S, PG_TIMEOUT_S = 30, 5
LOSSES = ("crash", "freeze")
MAX_RESTARTS = 10  # torchft's torchx component runs each replica group's torchrun with --max_restarts=10


@dataclass(frozen=True)
class Timeouts:
    """How long torchft waits on a replica: its documented values unless
    asked. A crash closes the lost group's connections, so the survivors see
    it whatever these are; a loaded machine (the smoke test beside the rest
    of the suite on 2 cores) can starve a live group past 5 s, and torchft
    then drops or kills it, which measures the machine, not the anchor."""

    pg_s: float = PG_TIMEOUT_S  # the replicas' gloo collectives
    heartbeat_ms: int = LIGHTHOUSE["heartbeat_timeout_ms"]  # the lighthouse's verdict on a silent replica

    def lighthouse_flags(self) -> list[str]:
        return [f"--{k}={v}" for k, v in {**LIGHTHOUSE, "heartbeat_timeout_ms": self.heartbeat_ms}.items()]


def unavailable() -> str | None:
    """Why torchft cannot run here, or None."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"torchft is not importable ({exc}); pip install --no-deps torchft and its opentelemetry deps"
    if not Path(sys.executable).with_name("torchft_lighthouse").exists():
        return "no torchft_lighthouse next to this python (torchft's console script)"
    return None


# ---- one replica group's worker (run by torchrun) ------------------------------------

def tolerant_comm_hook(state: Any, bucket):  # type: ignore[no-untyped-def]
    """torchft 0.2.0's DistributedDataParallel._comm_hook, but a failed
    allreduce gives the bucket back unreduced instead of tripping `assert
    fut._fut` (_ManagedWork.wait swallows the error, so the future chain is
    never set up; cf. meta-pytorch/torchft#294): the manager holds the error
    and should_commit() says no, as torchft intends. Only with --patch-comm-hook.
    `bucket` has no annotation: DDP's register_comm_hook refuses any but
    dist.GradBucket itself (and this module's annotations are strings)."""
    import torch

    work = state.allreduce(bucket.buffer())
    inner = getattr(work.get_future(), "_fut", None) if work.wait() else None
    if inner is None:
        inner = torch.futures.Future()
        inner.set_result(bucket.buffer())
    return inner


def worker(metrics: Path, steps: int, patch: bool, pg_timeout_s: float) -> None:
    import torch
    import torch.nn.functional as F
    from torch import optim
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from ddpkit.train.model.tiny import cnn

    if patch:
        DistributedDataParallel._comm_hook = staticmethod(tolerant_comm_hook)  # type: ignore[method-assign]
    replica = int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(0)
    model = cnn()
    inner = optim.AdamW(model.parameters())

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout_s)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{replica}",
                      timeout=timedelta(seconds=MANAGER_TIMEOUT_S))
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    data = torch.Generator().manual_seed(replica)
    with metrics.open("a", buffering=1) as out:
        out.write(json.dumps({"kind": "start", "step": manager.current_step(), "time": time.time(),
                              "participants": 0}) + "\n")
        # torchft forms a quorum of min_replicas without a group still starting: on a loaded machine the
        # first two could train every step before the third came. The driver says go once all three are up.
        while not started(metrics).exists():
            time.sleep(0.05)
        while manager.current_step() < steps:
            x, y = torch.randn(8, 3, 16, 16, generator=data), torch.randint(0, 10, (8,), generator=data)
            before = manager.current_step()
            optimizer.zero_grad()  # starts the step's quorum
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()  # steps only if every replica in the quorum agreed to commit
            after = manager.current_step()
            out.write(json.dumps({"kind": "train" if after > before else "discarded", "step": after,
                                  "time": time.time(), "participants": manager.num_participants()}) + "\n")
    manager.shutdown(wait=False)


# ---- the driver -------------------------------------------------------------------

def started(metrics: Path) -> Path:
    """The file that lets the groups train: every group's manager is up (see worker)."""
    return metrics.with_name("go")


def attempts(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().split("\n")[:-1]]


def start(work: Path, steps: int, patch: bool,
          timeouts: Timeouts) -> tuple[subprocess.Popen[bytes], list[subprocess.Popen[bytes]]]:
    port = free_port()
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    flags = timeouts.lighthouse_flags()
    with open(work / "lighthouse.out", "wb") as out:
        lighthouse = subprocess.Popen([str(exe), f"--bind=127.0.0.1:{port}", f"--min_replicas={MIN_REPLICAS}",
                                       *flags], stdout=out, stderr=subprocess.STDOUT)
    groups = []
    for g in range(GROUPS):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
               "REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(GROUPS),
               "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1",
                f"--max-restarts={MAX_RESTARTS}",
                "-m", "bench.torchft_anchor", "--worker", str(work / f"g{g}.jsonl"), "--steps", str(steps),
                "--pg-timeout-s", str(timeouts.pg_s), *(["--patch-comm-hook"] if patch else [])]
        with open(work / f"group{g}.out", "wb") as out:
            groups.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work))
    return lighthouse, groups


class SurvivorsDied(RuntimeError):
    """torchft's survivors exited instead of training on (the run has no figure)."""


def run_once(loss: str, steps: int, kill_after: int, patch: bool = False,
             timeouts: Timeouts = Timeouts()) -> Measurement:
    """One run: three groups train together, the last is lost at a random step after `kill_after`."""
    with work_folder("ddpkit-bench-torchft-") as work:
        lighthouse, groups = start(work, steps, patch, timeouts)
        survivor = work / "g0.jsonl"
        lost = [groups[-1].pid, *proctree.descendants(groups[-1].pid)]
        try:
            wait_until(lambda: all(any(a["kind"] == "start" for a in attempts(work / f"g{g}.jsonl"))
                                   for g in range(GROUPS)), 300, "the three groups never started")
            started(survivor).write_text("")
            at = random.randint(kill_after, 2 * kill_after)
            wait_until(lambda: any(a["kind"] == "train" and a["participants"] == GROUPS and a["step"] >= at
                                   for a in attempts(survivor)), 300, "the three groups never trained together")
            lost = [groups[-1].pid, *proctree.descendants(groups[-1].pid)]
            take_away(lost, loss)
            lost_at = time.time()
            first = wait_until(lambda: first_after(survivor, lost_at, groups[0], work), 300,
                               "the survivors never committed a step without the lost group")
        finally:
            end_frozen(lost)
            for proc in [*groups, lighthouse]:
                kill_tree(proc)
        before = [a for a in attempts(survivor) if a["time"] <= first["time"]]
        killed_at = max(a["step"] for a in before if a["kind"] == "train" and a["time"] <= lost_at)
        after = [a for a in before if a["time"] > lost_at]
        return Measurement("local", "torchft-patched" if patch else "torchft", loss, round(first["time"] - lost_at, 2),
                           max(0, killed_at - (first["step"] - 1)), killed_at, first["step"] - 1,
                           sum(a["kind"] == "discarded" for a in after),
                           survivor_restarted=any(a["kind"] == "start" for a in after))


def first_after(survivor: Path, lost_at: float, proc: subprocess.Popen[bytes], work: Path) -> dict[str, Any] | None:
    """The survivor's first step committed without the lost group; raises if the survivor died."""
    first = next((a for a in attempts(survivor) if a["kind"] == "train" and a["time"] > lost_at
                  and a["participants"] < GROUPS), None)
    if first is None and proc.poll() is not None:
        lines = (work / "group0.out").read_text(errors="replace").splitlines()
        cause = next((ln for ln in reversed(lines) if "Error" in ln and "ChildFailedError" not in ln), "?")
        raise SurvivorsDied(f"survivor exited {proc.returncode} after the loss: {cause.strip()}")
    return first


def runs(losses: list[str], repeats: int, steps: int, kill_after: int, patch: bool = False,
         timeouts: Timeouts = Timeouts()) -> list[Measurement]:
    return [run_once(loss, steps, kill_after, patch, timeouts) for loss in losses for _ in range(repeats)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # torchrun's entry: the metrics file
    parser.add_argument("--steps", type=int, default=400, help="steps each group trains at most")
    parser.add_argument("--kill-after", type=int, default=20, help="the loss comes at a random step from N to 2N")
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {', '.join(LOSSES)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--patch-comm-hook", action="store_true",
                        help="run torchft with its DDP comm hook mended (see tolerant_comm_hook): what torchft's "
                             "design gives once that bug is fixed (variant torchft-patched)")
    parser.add_argument("--pg-timeout-s", type=float, default=PG_TIMEOUT_S,
                        help="the replicas' gloo timeout (torchft's example: 5)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=LIGHTHOUSE["heartbeat_timeout_ms"],
                        help="the lighthouse's verdict on a silent replica (torchft's default: 5000)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.patch_comm_hook, args.pg_timeout_s)
        return 0
    losses = args.losses.split(",")
    if set(losses) - set(LOSSES):
        parser.error(f"unknown loss kind(s); choose from {', '.join(LOSSES)}")
    if why := unavailable():
        print(f"torchft anchor skipped: {why}")
        return 3
    timeouts = Timeouts(args.pg_timeout_s, args.heartbeat_timeout_ms)
    measured = runs(losses, args.repeats, args.steps, args.kill_after, args.patch_comm_hook, timeouts)
    for m in measured:
        print(f"{m.variant} {m.loss:<7} loss -> first step {m.loss_to_first_step_s:6.2f} s, steps lost {m.steps_lost}, "
              f"discarded in flight {m.discarded_in_flight}, survivor restarted {m.survivor_restarted}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "torchft_anchor.json"
    path.write_text(json.dumps({"machine": machine(),
                                "lighthouse": {**LIGHTHOUSE, "heartbeat_timeout_ms": timeouts.heartbeat_ms},
                                "min_replicas": MIN_REPLICAS,
                                "manager_timeout_s": MANAGER_TIMEOUT_S, "pg_timeout_s": timeouts.pg_s,
                                "max_restarts": MAX_RESTARTS,
                                "runs": [asdict(m) for m in measured]}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
