"""bench/scale.py's --watch-rendezvous (bench/rdzv_trace.py) on a real
TCPStore: ddpkit's membership as its handler writes it (rendezvous/members.py:
a key per node and per round) and torch's c10d state (`elastic.rendezvous:
torchrun`) read as the same rows, the rounds summed up from them, and the
reader itself run as the bench runs it, a process of its own."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from bench.rdzv_trace import rounds, sample

from ddpkit.rdzv_store import rendezvous_state
from ddpkit.rendezvous.members import Membership

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "job-1-key"
T0 = 1_700_000_000.0


@pytest.fixture
def store() -> Iterator[object]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield server
    del server


def test_ddpkits_membership_is_read_round_by_round(store: object) -> None:
    """Two nodes form round 0; node b is lost and node a alone forms round 1 (min_nodes 1)."""
    members = Membership(store, RUN_ID)
    assert sample(store, RUN_ID, now=T0) is None  # nobody joined yet
    trace = []
    for node in ("a", "b"):
        members.keep_alive(node, T0)
        members.join(0, node)
    trace.append(sample(store, RUN_ID, now=T0 + 1))
    members.close(0, ["a", "b"], T0 + 2)
    trace.append(sample(store, RUN_ID, now=T0 + 2.5))
    members.keep_alive("a", T0 + 10)  # b silent since T0: past the 3 s expiry
    members.join(1, "a")
    trace.append(sample(store, RUN_ID, now=T0 + 10.5))
    members.close(1, ["a"], T0 + 11)
    trace.append(sample(store, RUN_ID, now=T0 + 11.5))
    assert [(r["round"], r["complete"], r["participants"], r["live"]) for r in trace] == [  # type: ignore[index]
        (0, False, 2, 2), (0, True, 2, 2), (1, False, 1, 1), (1, True, 1, 1)]
    assert {r["rendezvous"] for r in trace} == {"ddpkit"}  # type: ignore[index]
    assert rendezvous_state(store, RUN_ID) is None  # torch's state, all the bench read before: nothing to read
    summed = rounds(trace, T0)  # type: ignore[arg-type]
    assert summed["completed"] == [{"round": 0, "at_s": 2.0, "participants": 2},
                                   {"round": 1, "at_s": 11.0, "participants": 1}]
    assert summed["max_participants_while_forming"] == {0: 2, 1: 1} and summed["participant_drops"] == 0


def test_a_round_that_closed_between_two_reads_is_not_missed(store: object) -> None:
    """Round 0 closes and round 1 starts forming within one period: its close stamp is read anyway."""
    members = Membership(store, RUN_ID)
    members.keep_alive("a", T0)
    members.join(0, "a")
    members.close(0, ["a"], T0 + 1)
    members.join(1, "a")
    row = sample(store, RUN_ID, now=T0 + 1.2)
    assert row is not None and (row["round"], row["complete"]) == (1, False)
    assert rounds([row], T0)["completed"] == [{"round": 0, "at_s": 1.0, "participants": 1}]


def test_torchs_state_is_read_as_the_same_row(store: object) -> None:
    """elastic.rendezvous: torchrun: torch's pickled state, under the same run id."""
    import base64

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    state.round, state.complete = 3, True
    a, b = _NodeDesc("a", 1, 1), _NodeDesc("b", 1, 1)
    state.participants = {a: 0, b: 1}
    now = datetime.now(timezone.utc)
    state.last_heartbeats = {a: now, b: now}
    store.set(f"torch.rendezvous.{RUN_ID}", base64.b64encode(pickle.dumps(state)))  # type: ignore[attr-defined]
    row = sample(store, RUN_ID, now=T0 + 5)
    assert row == {"t": T0 + 5, "rendezvous": "torch", "round": 3, "complete": True, "participants": 2,
                   "waiting": 0, "live": 2}
    assert rounds([row], T0)["completed"] == [{"round": 3, "at_s": 5.0, "participants": 2}]


@pytest.mark.slow
def test_the_reader_runs_as_the_bench_starts_it(store: object, tmp_path: Path) -> None:
    members = Membership(store, RUN_ID)
    members.keep_alive("a", time.time())
    members.join(0, "a")
    members.close(0, ["a"], time.time())
    out = tmp_path / "rendezvous.jsonl"
    port = store.port  # type: ignore[attr-defined]
    reader = subprocess.Popen([sys.executable, "-m", "bench.rdzv_trace", "127.0.0.1", str(port), RUN_ID, str(out),
                               "0.05"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
            assert reader.poll() is None, reader.communicate()[1]
            time.sleep(0.1)
    finally:
        reader.kill()
        reader.wait()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 2 and {(r["rendezvous"], r["round"], r["complete"]) for r in rows} == {("ddpkit", 0, True)}
