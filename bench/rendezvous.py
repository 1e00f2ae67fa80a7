"""What a membership change costs in the rendezvous alone, side by side in
one run: three real agents' rendezvous handlers (torchrun's registry, a
real TCPStore on the first; bench/rdzv_node.py), no workers, the third
one lost.

Variants, each with the timeouts ddpkit renders for loss_s 10 and 3 nodes
(rdzv_timing.derive: keep-alive 1 s x 3, last call 5 s):
  c10d             torch's own handler (what `elastic.rendezvous: torchrun`
                   and a job's own command get)
  ddpkit           ddpkit's handler (rendezvous.py: a key per node; the
                   round after a loss closes once every node of the last
                   round has joined it or is lost, without the last call)

Losses:
  crash   the third agent SIGKILLed; the two others go to the next round
          at once (their workers' collectives fail when its connections
          close). Timed from the kill to the later of the two joining.
  silent  the third agent SIGSTOPped; the two others go to the next round
          once its entry has expired (as after the heartbeat verdict,
          loss_s, which is longer than the expiry). Timed from their leave.

Each cell is the median of --repeats trials; the variants take turns in
every repeat, so a change of load hits them alike.

  .venv/bin/python -m bench.rendezvous [--repeats 5] [--losses crash,silent]

Writes bench/results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("c10d", "ddpkit")
LOSSES = ("crash", "silent")
NODES, MIN_NODES, LOSS_S = 3, 2, 10
RUN_ID = "bench-rendezvous"
JOIN_LIMIT_S = 120  # a trial whose rendezvous takes longer is broken, not slow


# ---- driver -----------------------------------------------------------------------
@dataclass
class Trial:
    variant: str
    loss: str
    seconds: float  # loss (crash) or leave (silent) -> both survivors joined the next round
    world_size: int


class SplitFirstRound(RuntimeError):
    """The three agents did not meet in one first round (one started too late
    for it on a starved machine): nothing to time yet."""


FIRST_ROUND_TRIES = 3


def trial(variant: str, loss: str, conf: dict[str, int], expiry_s: float) -> Trial:
    """One timed trial; started again (at most FIRST_ROUND_TRIES times, each
    said on stderr) when its first round was not of every node, since what is
    timed is the round after a loss, which needs every node in the one before."""
    for attempt in range(1, FIRST_ROUND_TRIES + 1):
        try:
            return _trial(variant, loss, conf, expiry_s)
        except SplitFirstRound as split:
            print(f"bench.rendezvous: {variant}/{loss} try {attempt}: {split}", file=sys.stderr, flush=True)
    raise RuntimeError(f"{variant}/{loss}: the first round was not of {NODES} in {FIRST_ROUND_TRIES} tries")


def _trial(variant: str, loss: str, conf: dict[str, int], expiry_s: float) -> Trial:
    from bench import rdzv_node

    from ddpkit.launch.local import free_port
    from ddpkit.rendezvous import handler as rendezvous

    port = free_port()
    backend = "c10d" if variant == "c10d" else rendezvous.NAME
    agents = [rdzv_node.start(backend, port, RUN_ID, (MIN_NODES, NODES), i == 0, conf) for i in range(NODES)]
    try:
        first = [rdzv_node.joined(a) for a in agents]
        if {j["world_size"] for j in first} != {NODES}:
            raise SplitFirstRound(f"the first round was not of {NODES}: {first}")
        lost, survivors = agents[-1], agents[:-1]
        lost.send_signal(signal.SIGKILL if loss == "crash" else signal.SIGSTOP)
        start = time.time()
        if loss == "silent":
            time.sleep(expiry_s + 1)  # the heartbeat verdict (loss_s) comes after the expiry
            start = time.time()
        rdzv_node.next_round(survivors)
        second = [rdzv_node.joined(a) for a in survivors]
        return Trial(variant, loss, round(max(j["at"] for j in second) - start, 2),
                     int(second[0]["world_size"]))
    finally:
        for agent in agents:
            agent.kill()
            agent.communicate(timeout=30)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path)
    p.add_argument("--name", default="rendezvous")
    a = p.parse_args(argv)
    a.losses, a.variants = a.losses.split(","), a.variants.split(",")
    for value, known in ((a.losses, LOSSES), (a.variants, VARIANTS)):
        bad = [v for v in value if v not in known]
        if bad:
            p.error(f"unknown {bad}; choose from {', '.join(known)}")
    return a


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from bench import common

    from ddpkit.rendezvous.timing import derive, state_poll_s

    a = parse(argv)
    timing = derive(LOSS_S, NODES)
    conf = {**asdict(timing), "join_timeout": JOIN_LIMIT_S}
    trials = [trial(v, loss, conf, timing.expiry_s) for _ in range(a.repeats) for loss in a.losses
              for v in a.variants]
    medians = {loss: {v: statistics.median(t.seconds for t in trials if t.variant == v and t.loss == loss)
                      for v in a.variants} for loss in a.losses}
    rows, ratios = [], {}
    for loss, by_variant in medians.items():
        for v, s in by_variant.items():
            spread = [t.seconds for t in trials if t.variant == v and t.loss == loss]
            rows.append([loss, v, s, min(spread), max(spread)])
        if {"c10d", "ddpkit"} <= by_variant.keys():
            ratios[f"{loss}: c10d / ddpkit"] = by_variant["c10d"] / by_variant["ddpkit"]
    print(common.table(["loss", "variant", "median s", "min s", "max s"], rows))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    path = common.write_result(a.name, {
        "command": common.command_line(), "machine": common.machine(), "nodes": NODES, "min_nodes": MIN_NODES,
        "rdzv_conf": conf, "state_poll_s": state_poll_s(NODES), "repeats": a.repeats,
        "trials": [asdict(t) for t in trials], "medians": medians, "ratios": ratios}, a.out or common.RESULTS)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
