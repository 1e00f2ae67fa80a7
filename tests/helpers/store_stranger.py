"""A stranger on the job's network: a client of its own to the job's
master port (torch's TCPStore, which lets any client in) forging ddpkit's
control records as someone who read ddpkit's source would write them.

In-process (tests/test_store_attack_local.py), on another host of a test
network (tests/test_store_attack_slurm.py, _ssh.py) or in a container on the
job's Docker network (in_container: _docker.py, _compose.py):

    python -m tests.helpers.store_stranger HOST PORT --run-id ID --world N   # every guessable prefix
    python -m tests.helpers.store_stranger HOST PORT --key KEY                # the run's own prefix
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit import records
from ddpkit.rendezvous import runkey
from ddpkit.train.watchdog import node_loss as loss_judge
from ddpkit.train.watchdog.stall_model import Beat, Phase
from ddpkit.train.watchdog.straggler import Work

EVIL = "evil-host"  # every forged record names this host: it must never reach the job's output


def connect(host: str, port: int) -> Any:  # torch.distributed.TCPStore
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def stall_verdict(limit_s: float = 6.0) -> str:
    suspect = {"rank": 1, "node": 1, "host": EVIL, "pid": 1, "step": 0, "phase": "forward", "idle_s": 600.0,
               "frozen_s": 600.0}
    return json.dumps({"kind": "stall", "by": 0, "idle_s": 600.0, "limit_s": limit_s,
                       "suspects": [suspect], "frozen": [1], "waiting": [0]})


def loss_verdict() -> str:
    lost = records.LostRank(rank=1, node=1, host=EVIL, pid=1, step=0, phase="forward", silent_s=600.0)
    return records.encode(loss_judge.verdict([lost], 30.0, 0, elastic=False))


class _Concat:
    """Keys under `prefix` by plain concatenation, as the check-in and the rendezvous rule name them."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store, self.prefix = store, prefix

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self.prefix + key, value)

    def compare_set(self, key: str, expected: str, value: str) -> None:
        self.store.compare_set(self.prefix + key, expected, value)


def under(store: Any, prefix: str) -> list[Any]:
    """The store as a stranger would address keys under `prefix`: through
    torch's PrefixStore (which adds a '/'), as the watchdog does, and by
    plain concatenation."""
    import torch.distributed as dist

    return [dist.PrefixStore(prefix, store), _Concat(store, prefix)]


def forge(store: Any, prefix: str, world: int) -> None:
    """Every control record ddpkit's ranks read, under `prefix`."""
    for view in under(store, prefix):
        for rank in range(world):
            # a heartbeat frozen at step 0 since long ago, and a work window 100 times slower than any real one
            view.set(f"hb/{rank}", Beat(rank, 1, 0, 0, Phase.FORWARD, 0.0, True, rank, 1, EVIL).encode())
            view.set(f"work/{rank}", Work(rank, 10_000, 20, 100.0, rank, EVIL).encode())
            view.set(f"ack/{rank}", json.dumps({"frame": EVIL, "in_torch": False, "dump": None}))
        view.set("released", "1")
        view.compare_set("stall", "", stall_verdict())  # the one write


def guessable_prefixes(job_name: str, run_id: str) -> list[str]:
    """The old public prefix, no prefix, and the prefix a key would give that
    a stranger can read or guess: the job's name, its run id, empty, zero."""
    guesses = ["0", job_name, "ddpkit", run_id]
    return ["ddpkit-watchdog/", "", "ddpkit/"] + [runkey.control_prefix({runkey.ENV: g}) for g in guesses if g]


def forge_everywhere(store: Any, prefixes: list[str], world: int, pause_s: float = 3.0) -> str:
    """Every record under every prefix, then (after `pause_s`) a loss verdict
    over whatever the verdict keys hold. What happened, in one line."""
    try:
        for prefix in prefixes:
            forge(store, prefix, world)
        time.sleep(pause_s)
        for prefix in prefixes:
            for view in under(store, prefix):
                view.set("stall", loss_verdict())
    except RuntimeError as exc:  # DistNetworkError: the store went away with a job the forgery stopped
        return f"the store went away during the forgery: {str(exc).splitlines()[0]}"
    return f"forged every record under {len(prefixes)} prefixes"


def in_container(docker_env: dict[str, str], image: str, network: str, label: str, *argv: str) -> str:
    """This client, run in a container of its own on a Docker `network` (the
    job's image; this repository mounted read-only), with `argv`: what it
    printed. `label` (KEY=VALUE) marks the container as the test's, for its
    clean-up."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(["docker", "run", "--rm", "--network", network, "--label", label, "-v", f"{repo}:/repo:ro",
                           "-w", "/repo", "-e", "PYTHONPATH=/repo/src:/repo", image, "python", "-m", __name__, *argv],
                          env=docker_env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--key", help="the run's key: write the stall verdict under its own prefix")
    parser.add_argument("--job-name", default="")
    parser.add_argument("--run-id", default="")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    store = connect(args.host, args.port)
    if args.key:
        [through_prefix_store, _] = under(store, runkey.control_prefix({runkey.ENV: args.key}))
        through_prefix_store.compare_set("stall", "", stall_verdict())
        print("forged the stall verdict under the run's own prefix")
    else:
        print(forge_everywhere(store, guessable_prefixes(args.job_name, args.run_id), args.world))
    return 0


if __name__ == "__main__":
    sys.exit(main())
