"""`python -m tests.helpers.elastic_gate <ddpkit train flags>`: ddpkit train
that holds every rank right after the first checkpoint a world of a chosen
size writes, so a test can take a node away (or bring one back) at a known
step.

$ELASTIC_TEST_GATE_WORLD lists the world sizes to hold, e.g. "3" or "3,2".
Each held rank writes $ELASTIC_TEST_GATE_DIR/w<world>.<step>.rank<R>
(atomically); the ranks of that world go on once the test calls
`release(gate, world)`. A world is held once (only until it is released): the
workers started after that run freely, and a world not listed is never held.
A held worker may also be ended where it waits (a node lost, or the agents
restarting for a node that joined)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GATE_DIR, GATE_WORLD = "ELASTIC_TEST_GATE_DIR", "ELASTIC_TEST_GATE_WORLD"
# elastic.last_call_s for the tests' jobs: every membership change waits it
# out once (30 s by default). 15 s stays well above the spread of three
# agents' start-up here, also with the suite's other workers busy; a node
# later than the last call would cost a restart the tests do not allow.
LAST_CALL_S = 15


def _go(gate: Path, world: int) -> Path:
    return gate / f"go.w{world}"


def release(gate: Path, world: int) -> None:
    _go(gate, world).write_text("")


def held_step(gate: Path, world: int, failed: Callable[[], str | None], timeout: float = 400) -> int:
    """The step at which every rank of a `world`-rank job is held. `failed()`
    says why waiting is pointless (the job ended), or None."""
    deadline = time.monotonic() + timeout
    prefix = f"w{world}."
    while time.monotonic() < deadline:
        marks = [p.name[len(prefix):] for p in gate.iterdir() if p.name.startswith(prefix) and ".tmp-" not in p.name]
        for step in {int(m.split(".")[0]) for m in marks}:
            if sum(m.startswith(f"{step}.rank") for m in marks) == world:
                return step
        why = failed()
        assert why is None, f"the job ended before its {world} ranks reached the gate\n{why}"
        time.sleep(0.2)
    raise AssertionError(f"no {world}-rank world at the gate within {timeout:g}s: {sorted(os.listdir(gate))}\n"
                         f"{failed() or ''}")


AGENTS = {b"ddpkit.agent", b"torch.distributed.run"}  # the module on an agent's line: ddpkit's, or torch's own


def agents_and_workers(pids: list[int]) -> list[int]:
    """Of `pids` (a host's processes), each torchrun agent and every process
    under it: what a node loses when its trainer dies but the host stays."""
    from ddpkit.launch.supervise import proctree

    found = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if AGENTS & set(cmdline.split(b"\0")):  # the agent itself, not a script naming it
            found += [pid, *proctree.descendants(pid)]  # its zygote and the workers forked from it
    return found


def local_node_agent(launcher: int, node: int) -> list[int]:
    """Node `node`'s torchrun agent under `launch local` (pid `launcher`),
    and its workers. By its line (its output's folder, logs/node<N>), not
    by DDPKIT_NODE_RANK in /proc/PID/environ: an agent forked from launch
    local's fork server shows the server's environment there, what every
    node shares."""
    from ddpkit.launch.supervise import proctree

    for pid in proctree.descendants(launcher):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "ddpkit.agent" in line and any(arg.startswith("--log-dir=") and arg.endswith(f"/node{node}")
                                          for arg in line):
            found = agents_and_workers([pid])
            if found:
                return found
    return []


def _held_save(self: Any, pos: Any) -> Any:
    path = _real_save(self, pos)  # every rank returns after the barrier: the file is complete
    gate, world = Path(os.environ[GATE_DIR]), self.ctx.world_size
    held = {int(w) for w in os.environ[GATE_WORLD].split(",")}
    if world in held and not _go(gate, world).exists():
        mark = gate / f"w{world}.{pos.step}.rank{self.ctx.rank}"
        tmp = mark.with_name(mark.name + f".tmp-{os.getpid()}")
        tmp.write_text(str(world))
        os.replace(tmp, mark)
        while not _go(gate, world).exists():
            time.sleep(0.05)
    return path


if __name__ == "__main__":
    from ddpkit.train.__main__ import main
    from ddpkit.train.checkpoint import checkpointer

    _real_save = checkpointer.Checkpointer.save
    checkpointer.Checkpointer.save = _held_save  # type: ignore[method-assign]
    sys.exit(main())
