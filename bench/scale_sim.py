"""The control plane of one elastic job of N nodes x 8 ranks, simulated on
one machine with ddpkit's real code and no torch workers, for N up to 1,024
(docs/SCALE.md has the figures and what they mean).

Per N, one after the other:

  first rendezvous  the real store service (`python -m ddpkit.rdzv_store`, a
                    process of its own) and N real rendezvous handlers
                    (`ddpkit.rendezvous.handler.create`, what `--rdzv-backend=ddpkit`
                    builds in every agent: one TCPStore client each), spread
                    over a few host processes (--nodes-per-host threads each).
                    Each node does what torchrun's agent does with it:
                    next_rendezvous(), then every MONITOR_S num_nodes_waiting()
                    (and a new round when a node waits). Timed from the start
                    signal until every node has its rank in one round of N.
  steady state      the store's requests a second (counted in the handlers:
                    state reads, compare-and-sets, the leaving record, the
                    bootstrap keys), the bytes they move, the store process's
                    CPU and memory, while the nodes keep alive and poll.
  re-formation      one node (not rank 0) crashes: its keep-alives stop; every
                    other node is sent to its next round at once (as its
                    workers' failed collectives send torchrun's agent). Timed
                    until every survivor has its rank in a round of N-1.
  rank report       the real gather over N x 8 rows, both ways ddpkit has:
                    `ddpkit train`'s (every row pickled, as all_gather_object
                    does, unpickled on every rank, check_rows, rank 0's table)
                    and the preamble's (rows through the store service,
                    preamble.ranks._gather on rank 0, check_rows, the table).
  monitor round     the hang watchdog's monitor (train/watchdog/stall.py,
                    rank 0) over N x 8 heartbeats and work windows in the store
                    service: publish, the stall check, the loss rule, the
                    straggler judge.
  launcher          the supervisor's LinePrinter (launch/supervise/), dedup
                    and MetricsSink included, fed N nodes' output at
                    LINES_PER_S lines a second each (rank-tagged lines, lines
                    every rank of a node prints at once, framed records), in a
                    process of its own: CPU seconds per second of job output.

Every part is timed on this machine, which also runs every simulated agent:
on 2 cores the N agents' own work (each one unpickling the whole rendezvous
state on every poll) competes with the store and the timed code, so these are
upper bounds for the store and the monitor, and the first rendezvous and the
re-formation include N agents' CPU that a real job spreads over N machines.

  .venv/bin/python -m bench.scale_sim                    # N = 64 ... 1,024
  .venv/bin/python -m bench.scale_sim --short            # N = 16 ... 128 (CI)
  .venv/bin/python -m bench.scale_sim --nodes 64,256 --name scale_sim-try

Writes bench/results/<name>.json and docs/img/scale/*.png (--no-plots: none).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img" / "scale"
FULL, SHORT = (64, 128, 256, 512, 1024), (16, 32, 64, 128)
RANKS_PER_NODE = 8
LOSS_S = 10  # watchdog.loss_s's default: the rendezvous timeouts are derived from it (rdzv_timing.derive)
MONITOR_S = 0.1  # torchrun's --monitor-interval default: how often an agent asks num_nodes_waiting
LINES_PER_S = 10  # each node's output lines a second, for the launcher
JOIN_LIMIT_S = 600  # a rendezvous slower than this is broken, not slow
RUN_ID = "scale-sim-{n}"  # one rendezvous per N in the run's one store service
EXTRAPOLATE_TO = 4096

# name -> (unit, what, the goal at 1,024 nodes or None, how it should grow: "linear" or "flat")
MEASURES: dict[str, tuple[str, str, float | None, str]] = {
    "first_rendezvous_s": ("s", "first rendezvous, simulated here: start to every node's rank", 5.0, "linear"),
    "first_rendezvous_floor_s": ("s", "first rendezvous's floor on N machines: N commits in a row", 5.0, "linear"),
    "reformation_s": ("s", "re-formation after a crash, simulated here", 5.0, "flat"),
    "reformation_floor_s": ("s", "re-formation's floor: expiry + a poll + N-1 commits", 5.0, "flat"),
    "commit_ms": ("ms", "one commit to the rendezvous state of N nodes", None, "flat"),
    "rank_report_train_s": ("s", "rank report, ddpkit train (rows gathered to rank 0), rank 0", 2.0, "linear"),
    "rank_report_preamble_s": ("s", "rank report, a program's own (rows through the store), rank 0", 2.0,
                               "linear"),
    "check_rows_s": ("s", "rank report: check_rows over N x 8 rows", None, "linear"),
    "table_s": ("s", "rank report: rank 0's table of N x 8 rows (short above 64, the full one to a file)", None,
                "linear"),
    "monitor_round_s": ("s", "one monitor round over N x 8 heartbeats", 1.0, "linear"),
    "launcher_cores": ("cores", f"launcher CPU per s of output, {LINES_PER_S} lines/s a node", 1.0, "linear"),
    "store_requests_per_s": ("req/s", "store requests a second, steady state, simulated", None, "linear"),
    "store_mb_per_s": ("MB/s", "store traffic, steady state, simulated", None, "linear"),
    "store_cpu_cores": ("cores", "store process CPU, steady state, simulated", None, "linear"),
    "store_requests_per_s_schedule": ("req/s", "store requests a second from the schedule", None, "linear"),
    "store_mb_per_s_schedule": ("MB/s", "store traffic from the schedule and the state's size", None, "linear"),
    "store_rss_growth_mb": ("MB", "store memory above its idle RSS", None, "linear"),
    "state_kb": ("KB", "torch's rendezvous state (one pickled blob)", None, "linear"),
}


def rendezvous_handler() -> Any:
    """ddpkit's rendezvous handler module in the code this process imports: the
    rendezvous package's handler, or the one module it was before the package (a
    --baseline arm may run such a commit's src/)."""
    try:
        return importlib.import_module("ddpkit.rendezvous.handler")
    except ModuleNotFoundError:
        return importlib.import_module("ddpkit.rendezvous")


# ---- a host of simulated nodes (a process of its own) -----------------------------------------
class Counts:
    """The store requests this process's handlers make, by kind, and the bytes they move."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.bytes = 0

    def add(self, kind: str, n: int = 1, size: int = 0) -> None:
        with self.lock:
            self.requests[kind] = self.requests.get(kind, 0) + n
            self.bytes += size

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"requests": dict(self.requests), "bytes": self.bytes}


def _count_store_requests(counts: Counts) -> None:
    """Count what the handlers ask the store, where torch and ddpkit ask it
    (the C10d backend's one call site, the leaving record, the bootstrap keys)."""
    from torch.distributed.elastic.rendezvous import api
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    rendezvous = rendezvous_handler()
    call_store = C10dRendezvousBackend._call_store

    def counted_call(self: Any, store_op: str, *args: Any, **kwargs: Any) -> Any:
        out = call_store(self, store_op, *args, **kwargs)
        sent = sum(len(a) for a in args[1:] if isinstance(a, (str, bytes)))
        counts.add(store_op, 1, sent + (len(out) if isinstance(out, (bytes, str)) else 0))
        return out

    C10dRendezvousBackend._call_store = counted_call  # type: ignore[method-assign]
    if hasattr(rendezvous, "_Known"):  # torch's handler wrapped (the code before the membership of its own)
        _count_leaving_record(rendezvous, counts)
    build = api.RendezvousStoreInfo.build

    def counted_build(rank: int, store: Any, local_addr: str | None, server_port: int | None = None) -> Any:
        counts.add("bootstrap keys", 4 if rank == 0 else 2)
        return build(rank, store, local_addr, server_port)

    api.RendezvousStoreInfo.build = staticmethod(counted_build)  # type: ignore[method-assign]


def _count_leaving_record(rendezvous: Any, counts: Counts) -> None:
    leave, left = rendezvous._Known.leave, rendezvous._Known.left

    def counted_leave(self: Any, round_: int, node: object) -> None:
        counts.add("append (left)")
        leave(self, round_, node)

    def counted_left(self: Any, round_: int) -> set[str]:
        out = left(self, round_)
        counts.add("check+get (left)", 2 if out else 1)
        return out

    rendezvous._Known.leave = counted_leave
    rendezvous._Known.left = counted_left


class CountedStore:
    """A handler's store as ddpkit's membership calls it (rdzv_members.Membership.store), each request
    counted by kind with the bytes it sends and gets."""

    def __init__(self, store: Any, counts: Counts) -> None:
        self._store, self._counts = store, counts

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            out = method(*args)
            flat = [x for a in args for x in (a if isinstance(a, list) else [a])]
            got = out if isinstance(out, list) else [out]
            size = sum(len(x) for x in (*flat, *got) if isinstance(x, (str, bytes)))
            self._counts.add(name, 1, size)
            return out
        return call


def count_handler(handler: Any, counts: Counts) -> Any:
    """`handler` with its membership's requests counted (ddpkit's own handler; torch's is counted at its
    backend's call site)."""
    members = getattr(handler, "_members", None)
    if members is not None:
        members.store = CountedStore(members.store, counts)
    return handler


def handler_round(handler: Any) -> tuple[int, float | None]:
    """The round a handler is in and its measured round trip to the store (ddpkit's handler, or torch's
    wrapped one: the code before)."""
    if hasattr(handler, "_members"):
        return handler.round, handler.timing.round_trip_s
    timing = getattr(handler._op_executor, "_timing", None)
    return handler._state_holder.state.round, getattr(timing, "round_trip_s", None)


def stop_keep_alive(handler: Any) -> None:
    (handler.stop_keep_alive if hasattr(handler, "stop_keep_alive") else handler._stop_heartbeats)()


class SimNode:
    """One node's agent, as far as the rendezvous goes: torchrun's loop
    (next_rendezvous, then num_nodes_waiting every MONITOR_S) around one real handler."""

    def __init__(self, index: int, handler: Any, say: Callable[[dict[str, Any]], None]) -> None:
        self.index, self.handler, self.say = index, handler, say
        self.orders: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"sim-node-{index}", daemon=True)

    def _run(self) -> None:
        handler = self.handler
        while True:
            try:
                info = handler.next_rendezvous()
            except Exception as exc:  # say it: the driver counts it as a failure
                self.say({"node": self.index, "error": f"{type(exc).__name__}: {exc}"})
                return
            round_, round_trip_s = handler_round(handler)
            self.say({"node": self.index, "rank": info.rank, "world": info.world_size, "round": round_,
                      "at": time.time(), "round_trip_s": round_trip_s})
            while True:
                try:
                    order = self.orders.get(timeout=MONITOR_S)
                except queue.Empty:
                    order = ""
                if order in ("die", "quit"):  # die: a crash, no more keep-alives, no goodbye
                    stop_keep_alive(handler)
                    return
                if order == "next":
                    break
                try:
                    if handler.num_nodes_waiting() > 0:  # torchrun restarts its workers for a waiting node
                        break
                except Exception as exc:
                    self.say({"node": self.index, "error": f"num_nodes_waiting: {type(exc).__name__}: {exc}"})
                    return


def host(argv: Sequence[str]) -> None:
    """`--host PORT MIN MAX FIRST COUNT CONF_JSON [RUN_ID]`: COUNT nodes from
    FIRST, their orders on stdin (go | next I,J,... | die I | stats | quit),
    their news on stdout, one JSON line each."""
    port, min_nodes, max_nodes, first, count = (int(a) for a in argv[:5])
    conf = json.loads(argv[5])
    run_id = argv[6] if len(argv) > 6 else RUN_ID.format(n=max_nodes)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # what ddpkit renders for every elastic job
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    rendezvous = rendezvous_handler()

    counts = Counts()
    _count_store_requests(counts)
    lock = threading.Lock()

    def say(news: dict[str, Any]) -> None:
        line = json.dumps(news)
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    nodes = []
    for index in range(first, first + count):
        params = RendezvousParameters(rendezvous.NAME, f"127.0.0.1:{port}", run_id, min_nodes,
                                      max_nodes,
                                      local_addr="127.0.0.1", is_host=False, **conf)
        nodes.append(SimNode(index, count_handler(rendezvous.create(params), counts), say))
    by_index = {n.index: n for n in nodes}
    say({"ready": count})
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "go":
            for node in nodes:
                node.thread.start()
        elif word in ("next", "die"):
            for index in (int(i) for i in rest.split(",") if i):
                if index in by_index:
                    by_index[index].orders.put(word)
        elif word == "stats":
            say({"stats": counts.snapshot(), "at": time.time()})
        elif word == "quit":
            break
    sys.stdout.flush()
    os._exit(0)  # no shutdown(): closing the rendezvous is not what is measured


# ---- the driver's side of the rendezvous -----------------------------------------------------
def proc_stat(pid: int) -> dict[str, float]:
    """CPU seconds, current and peak RSS (MB), threads and open files of a process (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"cpu_s": (int(fields[11]) + int(fields[12])) / ticks,
            "rss_mb": int(status["VmRSS"].split()[0]) / 1024, "peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024,
            "threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Hosts:
    """The host processes of one N, and every node's news as it comes."""

    def __init__(self, port: int, n: int, per_host: int, conf: dict[str, int], min_nodes: int,
                 src: Path = ROOT / "src", run_id: str = "") -> None:
        self.n = n
        self.procs: list[subprocess.Popen[str]] = []
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{src}", "OMP_NUM_THREADS": "1"}
        for first in range(0, n, per_host):
            argv = [sys.executable, "-m", "bench.scale_sim", "--host", str(port), str(min_nodes), str(n),
                    str(first), str(min(per_host, n - first)), json.dumps(conf), run_id or RUN_ID.format(n=n)]
            self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=self.errors, text=True, bufsize=1))
        self.news: queue.Queue[dict[str, Any]] = queue.Queue()
        self._readers = [threading.Thread(target=self._read, args=(p,), daemon=True) for p in self.procs]
        for reader in self._readers:
            reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.news.put(json.loads(line))
        self.news.put({"host_ended": proc.pid, "code": proc.poll()})

    def tell(self, line: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def next_news(self, deadline: float) -> dict[str, Any]:
        try:
            news = self.news.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"not within the limit ({self.stderr()[-500:]!r})") from None
        if "host_ended" in news or "error" in news:
            raise RuntimeError(f"a simulated node failed: {news}; stderr:\n{self.stderr()}")
        return news

    def wait_ready(self, limit_s: float = 300) -> None:
        deadline, ready = time.monotonic() + limit_s, 0
        while ready < self.n:
            ready += int(self.next_news(deadline).get("ready", 0))

    def until_round(self, members: set[int], limit_s: float = JOIN_LIMIT_S) -> tuple[dict[int, dict[str, Any]], int]:
        """Every node's news until each of `members` has a rank in one round
        of len(members) nodes; (the news of that round by node, rounds seen)."""
        deadline = time.monotonic() + limit_s
        latest: dict[int, dict[str, Any]] = {}
        rounds: set[int] = set()
        while True:
            news = self.next_news(deadline)
            if "node" not in news:
                continue
            latest[news["node"]] = news
            rounds.add(news["round"])
            if members <= latest.keys():
                last = {latest[i]["round"] for i in members}
                if len(last) == 1 and all(latest[i]["world"] == len(members) for i in members):
                    return {i: latest[i] for i in members}, len(rounds)

    def stats(self, limit_s: float = 60) -> dict[str, Any]:
        """Every host's request counts, summed."""
        self.tell("stats")
        deadline, got, total = time.monotonic() + limit_s, 0, {"requests": {}, "bytes": 0}
        while got < len(self.procs):
            news = self.next_news(deadline)
            if "stats" in news:
                got += 1
                for kind, n in news["stats"]["requests"].items():
                    total["requests"][kind] = total["requests"].get(kind, 0) + n
                total["bytes"] += news["stats"]["bytes"]
        return total

    def cpu_s(self) -> float:
        """CPU seconds of every host process (the simulated agents) so far."""
        return sum(proc_stat(p.pid)["cpu_s"] for p in self.procs if p.poll() is None)

    def stderr(self) -> str:
        self.errors.seek(0)
        return self.errors.read()[-3000:]

    def close(self) -> None:
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.write("quit\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.errors.close()


@dataclass
class StoreService:
    """`python -m ddpkit.rdzv_store` on 127.0.0.1, as compose and Kubernetes run it."""

    port: int
    proc: subprocess.Popen[str]
    listening: bool = False

    @classmethod
    def launch(cls) -> StoreService:
        """Started, not yet listening (`ready` waits): its clients' connects wait for it meanwhile."""
        from ddpkit.launch.local import free_port

        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        proc = subprocess.Popen([sys.executable, "-m", "ddpkit.rdzv_store", "--port", str(port), "--host",
                                 "127.0.0.1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        return cls(port, proc)

    def ready(self) -> None:
        if self.listening:
            return
        self.listening = True
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listens" not in line:
            self.proc.kill()
            raise RuntimeError(f"the store service did not start: {line}{self.proc.communicate()[0]}")

    def stat(self) -> dict[str, float]:
        return proc_stat(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def client(port: int) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120), wait_for_workers=False)


def state_size(port: int, n: int, run_id: str = "") -> dict[str, float]:
    """torch's rendezvous state as the store holds it (base64 of one pickle),
    and what one reader pays to decode it."""
    import base64
    import pickle

    from ddpkit.rdzv_store import RDZV_STATE_KEY
    from ddpkit.rendezvous import runkey

    store = client(port)
    rdzv_id = runkey.rdzv_run_id(run_id or RUN_ID.format(n=n))
    members = membership(store, rdzv_id)
    if members is not None:  # ddpkit's own: a key per node, and round 0's joiners and members
        closed = members.members(0)
        keys = ["0/list", "0/members"]
        size = sum(len(bytes(store.get(members.p + k))) for k in keys if store.check([members.p + k]))
        return {"state_kb": size / 1024, "participants": len(closed[1]) if closed else 0, "keys_per_node": 1}
    raw = bytes(store.get(RDZV_STATE_KEY + rdzv_id))
    t = time.perf_counter()
    for _ in range(5):
        state = pickle.loads(base64.b64decode(raw))
    decode_s = (time.perf_counter() - t) / 5
    t = time.perf_counter()
    for _ in range(5):
        base64.b64encode(pickle.dumps(state))
    encode_s = (time.perf_counter() - t) / 5
    return {"state_kb": len(raw) / 1024, "decode_ms": decode_s * 1e3, "encode_ms": encode_s * 1e3,
            "participants": len(state.participants), "heartbeats": len(state.last_heartbeats)}


def commit_cost(k: int, store: StoreService, reps: int = 5) -> dict[str, float]:
    """One commit to torch's rendezvous state of `k` nodes, as a node makes it
    (its state holder's sync: pickle the whole state, compare-and-set it in the
    store service, unpickle the answer, sanitize), one node alone: seconds a
    commit, the store process's CPU seconds a commit, the state's size."""
    from datetime import datetime, timedelta, timezone

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    backend = C10dRendezvousBackend(client(store.port), f"chain-{k}-{time.monotonic_ns()}")
    settings = dyn.RendezvousSettings(f"chain-{k}", max(1, k - 1), k, dyn.RendezvousTimeout(),
                                      timedelta(seconds=3), 3)
    holder = dyn._BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    state, now = holder.state, datetime.now(timezone.utc)
    # a cluster's node names (the FQDN torch puts in each node's descriptor), one agent process each
    nodes = [dyn._NodeDesc(f"gpu-{i:05d}.cluster.internal", 4000 + i, 0) for i in range(k)]
    for node in nodes:
        state.participants[node] = 0
        state.last_heartbeats[node] = now
    holder.mark_dirty()
    holder.sync()
    size = len(bytes(backend._store.get(backend._key)))
    times = []
    cpu0 = store.stat()["cpu_s"]
    for i in range(reps):
        holder.state.last_heartbeats[nodes[i % k]] = datetime.now(timezone.utc)  # a keep-alive's change
        holder.mark_dirty()
        t = time.perf_counter()
        if holder.sync() is not True:
            raise RuntimeError("a lone commit to the rendezvous state failed")
        times.append(time.perf_counter() - t)
    server = (store.stat()["cpu_s"] - cpu0) / reps  # /proc's 10 ms ticks: a mean over the commits
    # the fastest: a floor, and this machine's other load only ever adds to it
    return {"nodes": k, "commit_s": min(times), "commit_median_s": statistics.median(times), "state_kb": size / 1024,
            "store_cpu_s": server}


def commit_chain(n: int, store: StoreService) -> dict[str, Any]:
    """The first rendezvous's floor on N machines: N commits to the one state,
    one at a time (a compare-and-set admits one writer per version), the k-th
    with k nodes in it; each commit's cost measured at a few k and summed
    (trapezoid). A floor: no collision costs anything, no poll waits."""
    points = sorted({max(1, n // 8), n // 4, n // 2, (3 * n) // 4, n} - {0})
    costs = [commit_cost(k, store, reps=20 if k <= 256 else 8) for k in points]
    xs, ys = [0, *points], [0.0, *(c["commit_s"] for c in costs)]
    chain = sum((xs[i + 1] - xs[i]) * (ys[i + 1] + ys[i]) / 2 for i in range(len(xs) - 1))
    return {"points": costs, "chain_s": chain, "commit_s_at_n": costs[-1]["commit_s"],
            "state_kb_at_n": costs[-1]["state_kb"], "store_cpu_s_per_commit": costs[-1]["store_cpu_s"]}


def membership(store: Any, rdzv_id: str) -> Any | None:
    """ddpkit's membership of `rdzv_id` where its handlers keep one (None: torch's state, the code before)."""
    from ddpkit.rendezvous import members as rdzv_members

    members = rdzv_members.Membership(store, rdzv_id)
    return members if members.count(0) > 0 else None


def live_participants(store: Any, rdzv_id: str, expiry_s: float = 30.0) -> int | None:
    """How many nodes the round being formed has, for either handler (None: no rendezvous yet): torch's
    participants, or the live joiners of ddpkit's open round (the last closed round's members once it
    closed and nobody joined the next)."""
    from ddpkit.rdzv_store import rendezvous_state

    members = membership(store, rdzv_id)
    if members is None:
        state = rendezvous_state(store, rdzv_id)
        return None if state is None else len(state.participants)
    latest = members.latest()
    if latest > 0 and members.count(latest) == 0:
        closed = members.members(latest - 1)
        return len(closed[1]) if closed else 0
    joined = members.joined(latest)
    seen, left = members.seen(joined)
    now = time.time()
    return sum(1 for node in joined if node not in left and now - seen.get(node, float("-inf")) <= expiry_s)


class StateWatch:
    """The rendezvous state read every second while a round forms: how many
    participants it had, and how often that number fell (nodes expired by
    the others while they waited)."""

    def __init__(self, port: int, n: int, run_id: str = "", every_s: float = 1.0) -> None:
        from ddpkit.rendezvous import runkey

        rdzv_id = runkey.rdzv_run_id(run_id or RUN_ID.format(n=n))
        self._read = lambda store: live_participants(store, rdzv_id)
        self._every_s = every_s
        self._store = client(port)
        self.trace: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._began = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            count = self._read(self._store)
            if count is not None:
                self.trace.append((round(time.monotonic() - self._began, 1), count))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        counts = [c for _, c in self.trace]
        drops = sum(1 for a, b in zip(counts, counts[1:]) if b < a)
        return {"max_participants": max(counts, default=0), "drops": drops, "trace": self.trace[-120:]}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def arm_timing(n: int, src: Path | None = None) -> dict[str, Any]:
    """The rendezvous timeouts and polls of the code in `src` (another checkout's src/, as `--baseline`
    names it; None: this one) at N nodes: its rdzv_timing, imported in a process of its own."""
    code = ("import json, sys; from dataclasses import asdict\n"
            "try:\n    from ddpkit.rendezvous import timing as t\n"
            "except ImportError:  # a commit from before the rendezvous package\n    from ddpkit import rdzv_timing as t\n"
            "n, loss = int(sys.argv[1]), float(sys.argv[2]); timing = t.derive(loss, n);"
            " polls = {k: getattr(t, k)(n) for k in ('state_poll_s', 'join_poll_s', 'training_poll_s')"
            " if hasattr(t, k)}; print(json.dumps({'conf': asdict(timing), 'polls': polls}))")
    env = {**os.environ, "PYTHONPATH": str(src or ROOT / "src")}
    return json.loads(subprocess.run([sys.executable, "-c", code, str(n), str(LOSS_S)], env=env, check=True,
                                     capture_output=True, text=True).stdout)


def rendezvous_phase(n: int, store: StoreService, per_host: int, steady_s: float, first_limit_s: float,
                     keep_alive_s: int | None = None, src: Path | None = None, tag: str = "") -> dict[str, Any]:
    """First rendezvous, steady state, re-formation at N nodes (module docstring),
    on `store` (launched, maybe not listening yet: `ready` is waited for here);
    the handlers and timeouts of the code in `src` (None: this checkout's), the run id tagged with `tag`."""
    arm = arm_timing(n, src)
    conf = {**arm["conf"], "join_timeout": JOIN_LIMIT_S}
    if keep_alive_s:
        conf["keep_alive_interval"] = keep_alive_s
    expiry = conf["keep_alive_interval"] * conf["keep_alive_max_attempt"]
    min_nodes = max(1, n - 1)  # the crash leaves N-1: the smallest job that re-forms
    run_id = RUN_ID.format(n=n) + tag
    hosts = Hosts(store.port, n, per_host, conf, min_nodes, src or ROOT / "src", run_id)  # imports beside the store's
    store.ready()
    began = store.stat()["rss_mb"]
    out: dict[str, Any] = {"nodes": n, "host_processes": len(hosts.procs), "rdzv_conf": conf, "min_nodes": min_nodes,
                           "state_poll_s": arm["polls"]["state_poll_s"], "polls": arm["polls"], "expiry_s": expiry,
                           "src": str(src) if src else None,
                           "first_rendezvous_s": None, "reformation_s": None, "steady": None}
    try:
        hosts.wait_ready()
        out["store_before"] = store.stat()
        agents_cpu0 = hosts.cpu_s()
        watch = StateWatch(store.port, n, run_id, every_s=0.5)
        go = time.time()
        hosts.tell("go")
        try:
            first, rounds = hosts.until_round(set(range(n)), first_limit_s)
        except TimeoutError as exc:
            out["first_watch"] = watch.stop()
            out["first_failed"] = str(exc)
            out["agents_cpu_s_per_node_s"] = (hosts.cpu_s() - agents_cpu0) / n / (time.time() - go)
            return out
        out["first_watch"] = watch.stop()
        out["first_rendezvous_s"] = max(j["at"] for j in first.values()) - go
        out["first_round_trip_s"] = _median([j.get("round_trip_s") for j in first.values()])
        out["first_rounds"] = rounds
        out["first_ranks_distinct"] = sorted(j["rank"] for j in first.values()) == list(range(n))
        out["store_after_first"] = store.stat()
        out["state"] = state_size(store.port, n, run_id)
        # steady state: every node keeps alive and polls, as while the job trains
        before, cpu0, agents0, t0 = hosts.stats(), store.stat()["cpu_s"], hosts.cpu_s(), time.monotonic()
        time.sleep(steady_s)
        after, cpu1, agents1, t1 = hosts.stats(), store.stat()["cpu_s"], hosts.cpu_s(), time.monotonic()
        span = t1 - t0
        per_kind = {k: (after["requests"].get(k, 0) - before["requests"].get(k, 0)) / span
                    for k in after["requests"]}
        out["steady"] = {"seconds": span, "requests_per_s": per_kind,
                         "store_requests_per_s": sum(per_kind.values()),
                         "store_mb_per_s": (after["bytes"] - before["bytes"]) / span / 1e6,
                         "store_cpu_cores": (cpu1 - cpu0) / span,
                         "agent_cpu_cores_per_node": (agents1 - agents0) / span / n}
        # re-formation: one node crashes, every other goes to its next round at once
        lost = n // 2
        survivors = set(range(n)) - {lost}
        crash = time.time()
        hosts.tell(f"die {lost}")
        hosts.tell("next " + ",".join(str(i) for i in sorted(survivors)))
        try:
            second, _ = hosts.until_round(survivors, first_limit_s)
        except TimeoutError as exc:
            out["reformation_failed"] = str(exc)
            return out
        out["reformation_s"] = max(j["at"] for j in second.values()) - crash
        out["reformation_round_trip_s"] = _median([j.get("round_trip_s") for j in second.values()])
        out["reformed_world"] = len(second)
        out["reformed_without_lost"] = lost not in second and sorted(j["rank"] for j in second.values()) == list(
            range(n - 1))
        out["lost_node"] = lost
    finally:
        out["store_end"] = store.stat()
        out["store_rss_mb"] = out["store_end"]["rss_mb"]
        out["store_rss_growth_mb"] = out["store_end"]["rss_mb"] - began
        out["store_fds"] = out["store_end"]["fds"]
        out["host_stat"] = [proc_stat(p.pid) for p in hosts.procs if p.poll() is None]
        hosts.close()
    return out


# ---- the rank report ---------------------------------------------------------------------------
def rows(world: int, seed_host: str = "sim") -> list[Any]:
    from ddpkit.records import RankRow

    return [RankRow(rank=r, local_rank=r % RANKS_PER_NODE, node_rank=r // RANKS_PER_NODE,
                    host=f"{seed_host}-node-{r // RANKS_PER_NODE:04d}", pid=100_000 + r, device=f"cuda:{r % 8}",
                    interface="ib0", address=f"10.{r // 65536}.{r // 256 % 256}.{r % 256}", torch="2.14.1+cu130",
                    cuda="13.0", nccl="2.28.9", launcher="torchrun", world_size=world, master_addr="sim-node-0000",
                    master_port=29500, backend="nccl", nccl_socket_ifname="ib0", gloo_socket_ifname="ib0")
            for r in range(world)]


def _quiet_table(found: list[Any], problems: list[str]) -> None:
    """rank 0's table (rank_table.print_table) as into a log (not a terminal), with a
    log folder: above 64 rows the short table, and the full one written there."""
    import contextlib
    import io

    from ddpkit.train.startup.rank_table import print_table

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        print_table(found, problems, folder=Path(folder), records="ranks.json")


def rank_report_train(world: int) -> dict[str, float]:
    """`ddpkit train`'s report on rank 0: every row pickled (as gather_object
    pickles each rank's object), the W rows unpickled, checked, tabled. The
    other ranks wait for rank 0's verdict (gloo), or unpickle every row too
    (NCCL's all-gather): other_ranks_s."""
    import pickle

    from ddpkit.records import RankRow
    from ddpkit.train.startup.rank_report import check_rows

    _quiet_table(rows(2), [])  # rich's imports and first table: not the report's
    sent = [pickle.dumps(asdict(r)) for r in rows(world)]  # each rank's own, on its own host
    size = max(len(s) for s in sent)
    t = time.perf_counter()
    gathered = [pickle.loads(s) for s in sent]
    found = sorted((RankRow(**g) for g in gathered), key=lambda r: (r.rank, r.pid))
    t_rows = time.perf_counter()
    problems = check_rows(found, world)
    t_check = time.perf_counter()
    _quiet_table(found, problems)
    t_table = time.perf_counter()
    assert not problems and len(found) == world, problems
    return {"rank_report_train_s": t_table - t, "unpickle_s": t_rows - t, "check_rows_s": t_check - t_rows,
            "table_s": t_table - t_check, "rows": len(found), "bytes_per_rank": size * world,
            "other_ranks_s": t_rows - t}


def rank_report_preamble(world: int, port: int) -> dict[str, float]:
    """The preamble's report on rank 0: rows set in the store (each rank's one
    set, here in batches), then preamble.ranks._gather (multi_gets), check_rows, the table."""
    import datetime

    import torch.distributed as dist

    from ddpkit.preamble.ranks import MULTI_GET_KEYS, _gather

    store = dist.PrefixStore(f"scale-sim-{world}/", client(port))
    store.set_timeout(datetime.timedelta(seconds=120))
    all_rows = rows(world)
    for at in range(0, world, 512):
        batch = all_rows[at:at + 512]
        store.multi_set([f"row/{r.rank}" for r in batch], [json.dumps(asdict(r)) for r in batch])
    _quiet_table(rows(2), [])
    t = time.perf_counter()
    found, problems = _gather(store, world)
    t_gather = time.perf_counter()
    _quiet_table(found, problems)
    t_table = time.perf_counter()
    assert not problems and len(found) == world, problems
    return {"rank_report_preamble_s": t_table - t, "gather_s": t_gather - t, "table_s": t_table - t_gather,
            "rows": len(found), "store_requests": 1 + math.ceil(world / MULTI_GET_KEYS)}


def rank_reports(world: int, port: int) -> tuple[dict[str, float], dict[str, float]]:
    """Both reports: the fastest of a few tries (CPU-bound code on a shared machine: load only adds), one at
    8,192 rows."""
    tries = 3 if world <= 2048 else 1
    train = min((rank_report_train(world) for _ in range(tries)), key=lambda r: r["rank_report_train_s"])
    pre = min((rank_report_preamble(world, port) for _ in range(tries)), key=lambda r: r["rank_report_preamble_s"])
    return train, pre


def rank_report_figures(train: dict[str, float], pre: dict[str, float]) -> dict[str, float]:
    return {"rank_report_train_s": train["rank_report_train_s"], "rank_report_preamble_s": pre["rank_report_preamble_s"],
            "check_rows_s": train["check_rows_s"], "table_s": train["table_s"]}


def rank_report_again(a: argparse.Namespace, say: Callable[[str], None]) -> int:
    """--only rank-report: the rank reports alone at each N, into earlier runs' JSON (--into). Their
    figures replace the run's, whose first figures stay under each result's "before"; the tables, the
    goals and the rank report's plot are made again."""
    from bench import common

    store = StoreService.launch()
    importlib.import_module("torch.distributed")
    measured = {}
    try:
        for n in sorted(a.nodes):
            say(f"N={n}: rank report ({n * RANKS_PER_NODE} ranks)")
            measured[n] = rank_reports(n * RANKS_PER_NODE, store.port)
            say(f"N={n}: ddpkit train {measured[n][0]['rank_report_train_s']:.3f} s, "
                f"a program's own {measured[n][1]['rank_report_preamble_s']:.3f} s")
    finally:
        store.stop()
    for i, path in enumerate(a.into):
        payload = json.loads(path.read_text())
        for r in payload["results"]:
            if r["nodes"] not in measured:
                continue
            train, pre = measured[r["nodes"]]
            before = r.setdefault("before", {})
            before.setdefault("rank_report_train", r["rank_report_train"])
            before.setdefault("rank_report_preamble", r["rank_report_preamble"])
            before.setdefault("figures", {k: r["figures"][k] for k in rank_report_figures(train, pre)})
            r["rank_report_train"], r["rank_report_preamble"] = train, pre
            r["figures"].update(rank_report_figures(train, pre))
        payload["rank_report_again"] = {"command": common.command_line(), "machine": common.machine(),
                                        "nodes": sorted(n for n in measured
                                                        if n in {r["nodes"] for r in payload["results"]})}
        payload["analysis"], payload["goals"] = analyse(payload["results"]), goals(payload["results"])
        if i == 0:
            report(payload["results"], say)
            if not a.no_plots:
                payload["plots"] = sorted({*payload.get("plots", []), *(
                    str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
                    for p in plots(payload["results"], a.img or IMG, groups=("rank_report",)))})
        path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        path.with_suffix(".md").write_text(markdown(payload["results"]))
        say(f"wrote {path}")
    return 0


# ---- the rendezvous before and after a change ------------------------------------------------------
ARMS = ("before", "after")
RDZV_ROWS = {  # name -> (unit, what): one row each in the side-by-side table
    "first_rendezvous_s": ("s", "first rendezvous: start to every node's rank"),
    "max_participants": ("nodes", "most participants the first round had (read every 0.5 s)"),
    "drops": ("", "times the first round's participants fell (live nodes dropped)"),
    "reformation_s": ("s", "re-formation after a crash: to every survivor's rank"),
    "steady_requests_per_s": ("req/s", "store requests a second while the job trains"),
    "steady_mb_per_s": ("MB/s", "store traffic while the job trains"),
    "agent_cpu_ms_per_s": ("ms/s", "one agent's CPU a second while the job trains"),
}


def rdzv_figures(r: dict[str, Any]) -> dict[str, Any]:
    watch, steady = r.get("first_watch") or {}, r.get("steady") or {}
    return {"first_rendezvous_s": r["first_rendezvous_s"], "max_participants": watch.get("max_participants"),
            "drops": watch.get("drops"), "reformation_s": r["reformation_s"],
            "steady_requests_per_s": steady.get("store_requests_per_s"),
            "steady_mb_per_s": steady.get("store_mb_per_s"),
            "agent_cpu_ms_per_s": None if steady.get("agent_cpu_cores_per_node") is None
            else steady["agent_cpu_cores_per_node"] * 1e3}


def rdzv_markdown(results: list[dict[str, Any]]) -> str:
    ns = sorted({r["nodes"] for r in results})
    by = {(r["nodes"], r["arm"]): rdzv_figures(r) for r in results}

    def cell(v: Any, unit: str) -> str:
        if v is None:
            return "not formed" if unit == "s" else "-"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    head = "| measure | unit | " + " | ".join(f"N={n:,} {arm}" for n in ns for arm in ARMS) + " |"
    lines = [head, "|---|---|" + "---:|" * (2 * len(ns))]
    for key, (unit, what) in RDZV_ROWS.items():
        lines.append(f"| {what} | {unit} | " + " | ".join(cell(by.get((n, arm), {}).get(key), unit)
                                                          for n in ns for arm in ARMS) + " |")
    return "\n".join(lines) + "\n"


def rdzv_plot(results: list[dict[str, Any]], path: Path, limit_s: float) -> Path:
    """Before and after at each N: the first rendezvous's time (a cross where it never formed, at the limit)
    and the live nodes dropped while it formed."""
    from bench import common

    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, colour in zip(ARMS, ("tab:grey", "tab:blue")):
        mine = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["nodes"])
        ns = [r["nodes"] for r in mine]
        formed = [(r["nodes"], r["first_rendezvous_s"]) for r in mine if r["first_rendezvous_s"] is not None]
        never = [(r["nodes"], r.get("rdzv_limit_s") or limit_s) for r in mine if r["first_rendezvous_s"] is None]
        left.plot(*zip(*formed), "o-", color=colour, label=f"{arm}: formed") if formed else None
        left.plot(*zip(*never), "x", color=colour, markersize=9, label=f"{arm}: not formed within") if never else None
        right.plot(ns, [rdzv_figures(r)["drops"] or 0 for r in mine], "o-", color=colour, label=arm)
    left.set(xscale="log", yscale="log", xlabel="simulated nodes", ylabel="s", title="first rendezvous")
    right.set(xscale="log", xlabel="simulated nodes", ylabel="times", title="live nodes dropped while it formed")
    for ax in (left, right):
        ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    common.save_figure(fig, path)
    return path


def rendezvous_before_after(a: argparse.Namespace, say: Callable[[str], None]) -> int:
    """--only rendezvous: the first rendezvous, steady state and re-formation at each N, the code in
    --baseline (before) and this checkout's (after) one after the other at each N, on one store service."""
    from bench import common

    began, results = time.monotonic(), []
    store = StoreService.launch()
    try:
        for n in sorted(a.nodes):
            for arm, src in zip(ARMS, (a.baseline / "src", None)):
                say(f"N={n} {arm}: rendezvous ({math.ceil(n / a.nodes_per_host)} host processes)")
                steady = a.steady_s or 4.0
                r = rendezvous_phase(n, store, a.nodes_per_host, steady, a.first_limit_s, a.keep_alive_s, src,
                                     tag=f"-{arm}") | {"arm": arm, "load_avg_1m": os.getloadavg()[0],
                                                       "rdzv_limit_s": a.first_limit_s}
                results.append(r)
                say(f"N={n} {arm}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in rdzv_figures(r).items()))
                name = a.name if a.name != "scale_sim" else "scale_sim-rdzv"
                payload = {"command": common.command_line(), "machine": common.machine(),
                           "seconds": time.monotonic() - began, "baseline": str(a.baseline_named),
                           "loss_s": LOSS_S,
                           "results": results, "figures": [{"nodes": x["nodes"], "arm": x["arm"], **rdzv_figures(x)}
                                                           for x in results]}
                path = common.write_result(name, payload, a.out or common.RESULTS)
                path.with_suffix(".md").write_text(rdzv_markdown(results))
    finally:
        store.stop()
        if str(a.baseline_named).startswith("git:"):
            shutil.rmtree(a.baseline, ignore_errors=True)
    say(rdzv_markdown(results))
    if not a.no_plots:
        say(f"wrote {rdzv_plot(results, (a.img or IMG) / 'rdzv_before_after.png', a.first_limit_s)}")
    say(f"wrote {path}")
    return 0


# ---- the monitor ---------------------------------------------------------------------------------
def monitor_round(world: int, port: int, rounds: int = 5) -> dict[str, Any]:
    """Rank 0's watchdog monitor over `world` ranks' heartbeats and work windows
    in the store service; the median round. Every rank's writes are batched
    here (the store sees world sets a second from world clients in a job)."""
    from ddpkit.train.watchdog import stall, straggler
    from ddpkit.train.watchdog.stall_model import Beat, Phase, Settings

    store = stall.open_store("127.0.0.1", port)
    settings = Settings(stall_s=60.0)
    for _ in range(straggler.MIN_STEPS):  # rank 0 timed its steps: the straggler judge reads everyone's
        straggler.WORK.add(0.1)
    dog = stall.Watchdog(store, stall.Identity(0, world, RANKS_PER_NODE, 0, "sim-node-0000", 1), settings,
                         stall.Outputs(), exit=lambda code: None)
    hb = [f"hb/{r}" for r in range(world)]
    work = [f"work/{r}" for r in range(world)]
    times, parts = [], []
    for second in range(1, rounds + 1):
        beats = [Beat(r, second, second * 10, second * 10, Phase.BACKWARD, 0.1, True, r // RANKS_PER_NODE,
                      100_000 + r, f"sim-node-{r // RANKS_PER_NODE:04d}").encode().decode() for r in range(world)]
        works = [straggler.Work(r, second * 10, straggler.MIN_STEPS, 0.1, r // RANKS_PER_NODE,
                                f"sim-node-{r // RANKS_PER_NODE:04d}").encode() for r in range(world)]
        for at in range(0, world, 1024):
            store.multi_set(hb[at:at + 1024], beats[at:at + 1024])
            store.multi_set(work[at:at + 1024], works[at:at + 1024])
        now = time.monotonic()
        t = time.perf_counter()
        dog.publish(now)
        verdict = dog._check(now)
        t_check = time.perf_counter()
        if verdict is None:
            dog._judge_loss(now)
        dog.stragglers.check()
        t_straggler = time.perf_counter()
        store.check([stall.STALL_KEY])
        t_end = time.perf_counter()
        assert verdict is None, verdict
        times.append(t_end - t)
        parts.append({"check_s": t_check - t, "stragglers_s": t_straggler - t_check})
    return {"monitor_round_s": statistics.median(times), "monitor_round_max_s": max(times),
            "check_s": statistics.median(p["check_s"] for p in parts),
            "stragglers_s": statistics.median(p["stragglers_s"] for p in parts),
            "check_every_s": dog.check_every * settings.interval_s, "ranks": world}


# ---- the launcher (a process of its own) -------------------------------------------------------
@dataclass(frozen=True)
class FakeNode:
    """A node as the supervisor's printer sees it (NodeHandle's reading side)."""

    index: int
    host: str
    label: str


def node_lines(node: int, second: int) -> list[str]:
    """One node's LINES_PER_S lines of a second: each rank's progress line
    (distinct), one line all 8 ranks print at once (dedup's case), and the
    agent's framed record (its first rank's `train` metrics)."""
    from ddpkit import records

    first = node * RANKS_PER_NODE
    lines = [f"[rank{first + r}]:step {second * 10 + r} loss {1.0 / (1 + second + r):.4f} lr 0.1 "
             f"{900 + r} img/s" for r in range(RANKS_PER_NODE)]
    lines.append(f"[rank{first + second % RANKS_PER_NODE}]:UserWarning: this DataLoader will create 8 workers")
    lines.append(records.frame(records.Train(step=second * 10, loss=0.5, images_per_s=900.0), time=time.time()))
    return lines[:LINES_PER_S]


def launcher(n: int, seconds: float) -> dict[str, Any]:
    """The supervisor's printer fed `n` nodes' lines at LINES_PER_S a node,
    paced over `seconds`; then the same feed into a no-op sink, so the
    feeding's own cost is known. CPU s per s of output, and lines handled."""
    import io
    import resource

    from rich.console import Console

    from ddpkit.launch.supervise.supervisor import Supervisor

    def cpu() -> float:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    nodes = [FakeNode(i, f"sim-node-{i:04d}", f"node{i}") for i in range(n)]
    per_second = {i: [node_lines(i, s) for s in range(4)] for i in range(n)}  # made before the clock runs

    def feed(sink: Callable[[Any, str], None]) -> dict[str, float]:
        feeders = min(8, n)
        done = [0] * feeders
        start = time.monotonic()

        def run(k: int) -> None:
            mine = nodes[k::feeders]
            tick = 0
            while True:
                at = start + tick / LINES_PER_S
                now = time.monotonic()
                if at - start >= seconds or now - start >= 2 * seconds:  # behind: stop at twice the span
                    return
                if at > now:
                    time.sleep(at - now)
                second, line = divmod(tick, LINES_PER_S)
                for node in mine:
                    sink(node, per_second[node.index][second % 4][line])
                    done[k] += 1
                tick += 1

        c0, t0 = cpu(), time.monotonic()
        threads = [threading.Thread(target=run, args=(k,)) for k in range(feeders)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall, used = time.monotonic() - t0, cpu() - c0
        return {"cpu_s": used, "wall_s": wall, "lines": sum(done)}

    with tempfile.TemporaryDirectory() as tmp:
        console = Console(file=io.StringIO(), highlight=False, width=160)
        sup = Supervisor(nodes, console, grace_s=5.0, ranks=n * RANKS_PER_NODE,  # type: ignore[arg-type]
                         metrics=Path(tmp) / "metrics.jsonl")
        real = feed(sup.printer.line)
        t = time.perf_counter()
        sup.printer.close()
        close_s = time.perf_counter() - t
        idle = feed(lambda node, text: None)
        out_bytes = len(console.file.getvalue())  # type: ignore[attr-defined]
    target = n * LINES_PER_S
    net = max(0.0, real["cpu_s"] - idle["cpu_s"])
    return {"nodes": n, "target_lines_per_s": target, "lines_per_s": real["lines"] / real["wall_s"],
            "cpu_s_per_s": real["cpu_s"] / real["wall_s"], "feed_cpu_s_per_s": idle["cpu_s"] / idle["wall_s"],
            "cpu_s_per_line": net / max(1, real["lines"]),
            # the printer's CPU for the whole feed, per second of the job's output at the target rate
            "launcher_cores": net / max(1, real["lines"]) * target,
            "kept_up": real["lines"] >= 0.95 * target * seconds and real["wall_s"] <= seconds * 1.2,
            "close_s": close_s, "console_bytes": out_bytes}


def launcher_in_process(n: int, seconds: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    done = subprocess.run([sys.executable, "-m", "bench.scale_sim", "--launcher", str(n), str(seconds)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the launcher simulation failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ---- one N, all of it ------------------------------------------------------------------------------
def schedule_load(n: int, state_kb: float) -> dict[str, float]:
    """The rendezvous's steady load on the store from its schedule (rdzv_timing)
    and the state's size: every agent reads the state once per state_poll_s
    (num_nodes_waiting, cached that long) and rewrites it once per keep-alive
    interval (a compare-and-set: the state sent, the state returned)."""
    from ddpkit.rendezvous.timing import derive, state_poll_s

    poll, interval = state_poll_s(n), derive(LOSS_S, n).keep_alive_interval
    return {"requests_per_s": n * (1 / poll + 1 / interval),
            "mb_per_s": n * state_kb * 1024 * (1 / poll + 2 / interval) / 1e6}


def one_n(n: int, store: StoreService, per_host: int, steady_s: float, launcher_s: float, first_limit_s: float,
          say: Callable[[str], None], keep_alive_s: int | None = None) -> dict[str, Any]:
    """Every measure at N nodes, on the run's store service (launched: the first N waits for it)."""
    from ddpkit.rendezvous.timing import state_poll_s

    say(f"N={n}: rendezvous ({math.ceil(n / per_host)} host processes of simulated agents)")
    rdzv = rendezvous_phase(n, store, per_host, steady_s, first_limit_s, keep_alive_s)

    def shown(v: float | None) -> str:
        return "not formed" if v is None else f"{v:.2f} s"

    say(f"N={n}: first rendezvous {shown(rdzv['first_rendezvous_s'])}, re-formation {shown(rdzv['reformation_s'])}")
    world = n * RANKS_PER_NODE
    say(f"N={n}: commit chain, rank report, monitor ({world} ranks)")
    idle = store.stat()
    chain = commit_chain(n, store)
    train, pre = rank_reports(world, store.port)
    mon = monitor_round(world, store.port)
    keys_stat = store.stat()
    say(f"N={n}: launcher")
    lau = launcher_in_process(n, launcher_s)
    # the floors on N machines: a chain of N commits; after a crash, the dead node's expiry, one poll, N-1 commits
    reform_floor = rdzv["expiry_s"] + state_poll_s(n) + chain["chain_s"] * ((n - 1) / n) ** 2
    load = schedule_load(n, chain["state_kb_at_n"])
    steady = rdzv.get("steady") or {}
    result = {"nodes": n, "ranks": world, "rendezvous": rdzv, "commit_chain": chain, "rank_report_train": train,
              "rank_report_preamble": pre, "monitor": mon, "launcher": lau, "store_idle": idle,
              "store_with_keys": keys_stat, "schedule_load": load}
    result["figures"] = {
        "first_rendezvous_s": rdzv["first_rendezvous_s"], "first_rendezvous_floor_s": chain["chain_s"],
        "reformation_s": rdzv["reformation_s"], "reformation_floor_s": reform_floor,
        "commit_ms": chain["commit_s_at_n"] * 1e3,
        **rank_report_figures(train, pre),
        "monitor_round_s": mon["monitor_round_s"], "launcher_cores": lau["launcher_cores"],
        "store_requests_per_s": steady.get("store_requests_per_s"), "store_mb_per_s": steady.get("store_mb_per_s"),
        "store_cpu_cores": steady.get("store_cpu_cores"),
        "store_requests_per_s_schedule": load["requests_per_s"], "store_mb_per_s_schedule": load["mb_per_s"],
        "store_rss_growth_mb": max(rdzv["store_rss_growth_mb"], keys_stat["rss_mb"] - idle["rss_mb"]),
        "state_kb": chain["state_kb_at_n"],
    }
    return result


# ---- analysis --------------------------------------------------------------------------------------
def fit(ns: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares a + b*N."""
    if len(ns) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.fmean(ns), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in ns)
    b = sum((x - mx) * (y - my) for x, y in zip(ns, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def growth(ns: Sequence[int], ys: Sequence[float | None]) -> dict[str, Any]:
    """Over the N where the measure has a value: the ratio per doubling of N,
    the exponent k of y ~ c N^k (a least-squares line in log-log), the
    a + b*N fit, and both extrapolated to EXTRAPOLATE_TO."""
    pts = [(n, y) for n, y in zip(ns, ys) if y is not None]
    xs, vs = [n for n, _ in pts], [y for _, y in pts]
    ratios = [vs[i + 1] / vs[i] if vs[i] > 0 else None for i in range(len(vs) - 1)]
    a, b = fit(xs, vs)
    positive = [(n, y) for n, y in pts if y > 0]
    if len(positive) >= 2:
        la, k = fit([math.log(n) for n, _ in positive], [math.log(y) for _, y in positive])
        power = math.exp(la) * EXTRAPOLATE_TO ** k
    else:
        k, power = 0.0, (vs[-1] if vs else 0.0)
    return {"n": xs, "values": vs, "ratios": ratios, "exponent": k, "a": a, "b": b,
            "linear_at_4096": a + b * EXTRAPOLATE_TO, "power_at_4096": power,
            "last_doubling": ratios[-1] if ratios else None, "missing": [n for n, y in zip(ns, ys) if y is None]}


def verdict(name: str, g: dict[str, Any]) -> str:
    """How the measure grows against how it should (MEASURES)."""
    if len(g["values"]) < 2:
        return "too few points"
    expected, k = MEASURES[name][3], g["exponent"]
    if expected == "flat":
        return "grows (should be flat)" if k > 0.3 else "flat"
    return "superlinear" if k > 1.25 else "linear or better"


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    ns = [r["nodes"] for r in results]
    out: dict[str, Any] = {}
    for name in MEASURES:
        g = growth(ns, [r["figures"][name] for r in results])
        g["verdict"] = verdict(name, g)
        out[name] = g
    return out


def goals(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The goals at 1,024 nodes x 8: the figure at 1,024 where it was
    measured, else the power-law fit's value there (None: no figure)."""
    analysis = analyse(results)
    out = {}
    for name, (_unit, what, goal, _growth) in MEASURES.items():
        if goal is None:
            continue
        g = analysis[name]
        measured = dict(zip(g["n"], g["values"])).get(1024)
        if measured is not None:
            value, how = measured, "measured"
        elif 1024 in g["missing"]:
            value, how = None, "not formed here"
        elif len(g["values"]) >= 2:
            positive = [(n, y) for n, y in zip(g["n"], g["values"]) if y > 0]
            la, k = fit([math.log(n) for n, _ in positive], [math.log(y) for _, y in positive])
            value, how = math.exp(la) * 1024 ** k, "from the fit"
        else:
            value, how = None, "not measured"
        out[name] = {"what": what, "goal": goal, "at_1024": value, "how": how,
                     "met": value is not None and value <= goal}
    return out


def report(results: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    from bench.common import table

    analysis = analyse(results)
    for name, (unit, what, _goal, should) in MEASURES.items():
        g = analysis[name]
        by_n = dict(zip(g["n"], g["values"]))
        ratio_of = dict(zip(g["n"][1:], g["ratios"]))
        rows_ = []
        for r in results:
            v = by_n.get(r["nodes"])
            ratio = ratio_of.get(r["nodes"])
            rows_.append([r["nodes"], "-" if v is None else (round(v, 4) if v < 100 else round(v)),
                          "" if ratio is None else f"x{ratio:.2f}"])
        say(f"\n{what} ({unit}; should be {should}):")
        say(table(["N", unit, "per doubling"], rows_))
        if g["values"]:
            say(f"  fit {g['a']:.4g} + {g['b']:.4g} x N; at N={EXTRAPOLATE_TO}: {g['linear_at_4096']:.4g} {unit} "
                f"(power law N^{g['exponent']:.2f}: {g['power_at_4096']:.4g}); {g['verdict']}")
    say("\ngoals at 1,024 nodes x 8 ranks:")
    for goal in goals(results).values():
        value = "-" if goal["at_1024"] is None else f"{goal['at_1024']:.3f}"
        say(f"  {goal['what']}: {value} ({goal['how']}) vs <= {goal['goal']:g}: "
            f"{'met' if goal['met'] else 'NOT MET'}")
    flagged = [n for n, g in analysis.items() if g["verdict"] in ("superlinear", "grows (should be flat)")]
    if flagged:
        say("\ngrowing faster than it should:")
        for n in flagged:
            last = analysis[n]["last_doubling"]
            say(f"  {n}: N^{analysis[n]['exponent']:.2f}" + ("" if last is None else f", last doubling x{last:.2f}"))
    unformed = [r["nodes"] for r in results if r["figures"]["first_rendezvous_s"] is None]
    if unformed:
        say(f"\nthe simulated first rendezvous did not form here at N = {', '.join(map(str, unformed))} "
            "(see rendezvous.first_watch in the JSON: participants expired while they waited)")


def markdown(results: list[dict[str, Any]]) -> str:
    """The figures as docs/SCALE.md shows them: a row per measure, a column per N,
    the last doubling's ratio, the growth exponent, the fit and both extrapolations."""
    ns = [r["nodes"] for r in results]
    analysis = analyse(results)

    def cell(v: float | None) -> str:
        if v is None:
            return "-"
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"

    head = ["measure", "unit", *(f"N={n:,}" for n in ns), "last x2", "~N^k", "a + b·N", f"at {EXTRAPOLATE_TO:,}: linear",
            "power"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for name, (unit, what, _goal, _should) in MEASURES.items():
        g = analysis[name]
        by_n = dict(zip(g["n"], g["values"]))
        fitted = f"{g['a']:.3g} + {g['b']:.3g}·N" if len(g["values"]) >= 2 else "-"
        lines.append("| " + " | ".join([
            what, unit, *(cell(by_n.get(n)) for n in ns),
            "-" if g["last_doubling"] is None else f"x{g['last_doubling']:.2f}",
            f"{g['exponent']:.2f}" if len(g["values"]) >= 2 else "-", fitted,
            cell(g["linear_at_4096"]) if len(g["values"]) >= 2 else "-",
            cell(g["power_at_4096"]) if len(g["values"]) >= 2 else "-"]) + " |")
    return "\n".join(lines) + "\n"


PLOTS = {
    "rendezvous": ["first_rendezvous_s", "first_rendezvous_floor_s", "reformation_s", "reformation_floor_s"],
    "commit": ["commit_ms", "state_kb"],
    "rank_report": ["rank_report_train_s", "rank_report_preamble_s", "check_rows_s", "table_s"],
    "monitor_launcher": ["monitor_round_s", "launcher_cores"],
    "store": ["store_requests_per_s_schedule", "store_mb_per_s_schedule", "store_rss_growth_mb"],
}


def plots(results: list[dict[str, Any]], out_dir: Path, groups: Sequence[str] = tuple(PLOTS)) -> list[Path]:
    """One PNG per group of PLOTS: each measure against N (log-log), its a + b·N
    fit and, where it grows faster than N, the power law, both to EXTRAPOLATE_TO;
    and the figures a result had before it was measured again (--only), if any."""
    import textwrap

    from bench.common import pyplot, save_figure

    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    ns = [r["nodes"] for r in results]
    analysis = analyse(results)
    paths = []
    for group in groups:
        names = PLOTS[group]
        cols = min(2, len(names))
        rows_ = math.ceil(len(names) / cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(5.2 * cols, 3.7 * rows_), squeeze=False)
        for ax in axes.flat[len(names):]:
            ax.set_visible(False)
        for ax, name in zip(axes.flat, names):
            unit, what, goal, _ = MEASURES[name]
            g = analysis[name]
            ax.set_title("\n".join(textwrap.wrap(what, 48)), fontsize=8)
            if not any(v > 0 for v in g["values"]):
                ax.text(0.5, 0.5, "no figure: " + ("not formed here" if g["missing"] else "none"),
                        ha="center", va="center", transform=ax.transAxes, fontsize=8)
                continue
            ax.plot(g["n"], g["values"], "o-", label="measured")
            before = [(r["nodes"], r["before"]["figures"][name]) for r in results
                      if (r.get("before") or {}).get("figures", {}).get(name)]
            if before:
                ax.plot([n for n, _ in before], [v for _, v in before], "x:", color="grey", label="before")
            grid = [g["n"][0] * 2 ** (i / 4) for i in range(int(4 * math.log2(EXTRAPOLATE_TO / g["n"][0])) + 1)]
            if len(g["values"]) >= 2:
                line = [(x, g["a"] + g["b"] * x) for x in grid]
                ax.plot([x for x, y in line if y > 0], [y for x, y in line if y > 0], "--", color="grey",
                        label="fit a + b·N")
                if g["exponent"] > 1.1:
                    c = g["power_at_4096"] / EXTRAPOLATE_TO ** g["exponent"]
                    ax.plot(grid, [c * x ** g["exponent"] for x in grid], ":", color="tab:orange",
                            label=f"fit c·N^{g['exponent']:.2f}")
            if goal is not None:
                ax.axhline(goal, color="red", linestyle="-.", linewidth=0.8, label=f"goal at 1,024 ({goal:g})")
            if g["missing"]:
                ax.text(0.02, 0.02, "not formed here at N = " + ", ".join(map(str, g["missing"])),
                        transform=ax.transAxes, fontsize=7)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({*ns, EXTRAPOLATE_TO})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(n) for n in ticks], fontsize=7)
            ax.set_xlabel("nodes (x 8 ranks)")
            ax.set_ylabel(unit)
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3, which="both")
        path = out_dir / f"{group}.png"
        save_figure(fig, path)
        paths.append(path)
    return paths


# ---- the command ------------------------------------------------------------------------------------
def git_export(rev: str) -> Path:
    """`rev`'s src/ from this checkout's git history in a folder of its own (the before arm's code, whatever
    the working tree holds now); removed when the run ends."""
    out = Path(tempfile.mkdtemp(prefix="ddpkit-baseline-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", help=f"node counts, comma-separated (default {','.join(map(str, FULL))})")
    p.add_argument("--short", action="store_true", help=f"N = {','.join(map(str, SHORT))}, shorter windows (CI)")
    p.add_argument("--nodes-per-host", type=int, default=128, help="simulated nodes per host process")
    p.add_argument("--steady-s", type=float, help="the steady-state window (default: 2 keep-alive intervals, >= 4)")
    p.add_argument("--launcher-s", type=float, help="seconds of output fed to the launcher (default 5; short 2)")
    p.add_argument("--first-limit-s", type=float,
                   help="give up on a simulated rendezvous after this long (default 120; short 60)")
    p.add_argument("--keep-alive-s", type=int,
                   help="the simulated agents' keep-alive interval (expiry: 3 of them) instead of ddpkit's derived one")
    p.add_argument("--name", help="the results file's name (default scale_sim, short scale_sim-short)")
    p.add_argument("--out", type=Path, help="the results folder (default bench/results)")
    p.add_argument("--img", type=Path, help="the plots' folder (default docs/img/scale; short: none)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--from", dest="from_", type=Path,
                   help="no run: analyse a run's JSON again (tables, goals, plots), rewriting it and its .md")
    p.add_argument("--with", dest="with_", type=Path, action="append", default=[],
                   help="another run's JSON: its N not run here join the tables, fits and plots")
    p.add_argument("--only", choices=["rank-report", "rendezvous"],
                   help="rank-report: measure it alone and put its figures into the runs named by --into; "
                        "rendezvous: the rendezvous alone, --baseline's code and this one's side by side "
                        "(-> bench/results/scale_sim-rdzv.json, .md)")
    p.add_argument("--baseline",
                   help="with --only rendezvous: the code before, a checkout (its src/ runs the 'before' agents) "
                        "or git:REV (that commit's src/ from this checkout's history, exported for the run)")
    p.add_argument("--into", type=Path, action="append", default=[],
                   help="with --only: a run's JSON whose results at the N measured take the new figures "
                        "(its first figures are kept under \"before\"); the first one's tables and plot are made again")
    a = p.parse_args(argv)
    a.nodes = [int(n) for n in a.nodes.split(",")] if a.nodes else list(SHORT if a.short else FULL)
    if any(n < 2 for n in a.nodes):
        p.error("--nodes: 2 at least")
    a.launcher_s = a.launcher_s or (2.0 if a.short else 5.0)
    a.first_limit_s = a.first_limit_s or (60.0 if a.short else 120.0)
    a.name = a.name or ("scale_sim-short" if a.short else "scale_sim")
    if a.only == "rank-report" and not a.into:
        p.error("--only rank-report: name the runs to update with --into")
    a.baseline_named = a.baseline
    if a.baseline and a.baseline.startswith("git:") and a.only == "rendezvous" and not a.from_:
        try:
            a.baseline = git_export(a.baseline.removeprefix("git:"))
        except subprocess.CalledProcessError as exc:
            p.error(f"--baseline {a.baseline}: git archive failed: {exc.stderr.decode().strip()}")
    elif a.baseline:
        a.baseline = Path(a.baseline)
    if a.only == "rendezvous" and not a.from_ and not (a.baseline and (a.baseline / "src" / "ddpkit").is_dir()):
        p.error("--only rendezvous: --baseline names a checkout with src/ddpkit, or git:REV")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--host"]:
        host(argv[1:])
        return 0
    if argv[:1] == ["--launcher"]:
        print(json.dumps(launcher(int(argv[1]), float(argv[2]))), flush=True)
        return 0
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "src"))
    from bench import common

    from ddpkit.rendezvous.timing import derive

    a = parse(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    if a.from_ is not None and a.only == "rendezvous":  # its plot and table again
        payload = json.loads(a.from_.read_text())
        a.from_.with_suffix(".md").write_text(rdzv_markdown(payload["results"]))
        say(f"wrote {rdzv_plot(payload['results'], (a.img or IMG) / 'rdzv_before_after.png', a.first_limit_s)}")
        return 0
    if a.from_ is not None:
        payload = json.loads(a.from_.read_text())
        report(payload["results"], say)
        payload["analysis"], payload["goals"] = analyse(payload["results"]), goals(payload["results"])
        if not a.no_plots:
            plots(payload["results"], a.img or IMG)
        a.from_.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        a.from_.with_suffix(".md").write_text(markdown(payload["results"]))
        return 0
    if a.only == "rank-report":
        return rank_report_again(a, say)
    if a.only == "rendezvous":
        return rendezvous_before_after(a, say)
    results = []
    began = time.monotonic()
    store = StoreService.launch()
    # this process's own torch import beside the store's and the first hosts' (the clients need it)
    preload = threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True)
    preload.start()
    try:
        for n in sorted(a.nodes):
            steady = a.steady_s or max(2.0 if a.short else 4.0, 2 * derive(LOSS_S, n).keep_alive_interval)
            results.append(one_n(n, store, a.nodes_per_host, steady, a.launcher_s, a.first_limit_s, say,
                                 a.keep_alive_s))
    finally:
        store.stop()
    merged = []
    for other in a.with_:
        ours = {r["nodes"] for r in results}
        merged += [r | {"from": str(other)} for r in json.loads(other.read_text())["results"] if r["nodes"] not in ours]
    results = sorted(results + merged, key=lambda r: r["nodes"])
    report(results, say)
    img = a.img or (None if a.short else IMG)
    pngs = [] if a.no_plots or img is None else plots(results, img)
    payload = {"command": common.command_line(), "machine": common.machine(), "seconds": time.monotonic() - began,
               "keep_alive_s": a.keep_alive_s,
               "ranks_per_node": RANKS_PER_NODE, "loss_s": LOSS_S, "lines_per_s_per_node": LINES_PER_S,
               "results": results, "analysis": analyse(results), "goals": goals(results),
               "plots": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in pngs]}
    path = common.write_result(a.name, payload, a.out or common.RESULTS)
    path.with_suffix(".md").write_text(markdown(results))
    say(f"wrote {path}" + (f" and {len(pngs)} plots in {img}" if pngs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
