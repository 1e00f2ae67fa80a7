"""`ddpkit launch local`: N torchrun agents on this machine acting as N nodes.

Each agent gets the launch line every per-node target runs
(contract.torchrun_argv with RowKey.LOCAL sources: static rendezvous on
127.0.0.1, node rank from DDPKIT_NODE_RANK), gloo on the CPU. Output is
streamed live with one `[nodeI rankR]` prefix (see supervisor). Fail fast: the first agent that exits
non-zero stops the others (each agent leads its own process group, so its
workers go too), and the run ends with a summary naming it.

An elastic job (spec.elastic) runs its agents with c10d rendezvous on
127.0.0.1 and a fresh id, in a store this launcher hosts
(rdzv_store.py): any failed node, node 0 too, is left out while
min_nodes remain, and started again at once (this machine is always there)
to join at the next rendezvous, until it failed elastic.max_node_failures
times (docs/guides/elastic.md).

With --detach the command returns once the run folder is made, and the
same launcher supervises the run in a session of its own (detach.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import records
from ..contract import Arg, LaunchPlan, RowKey, resolve
from ..rdzv_store import hosted_store
from ..rendezvous import runkey
from ..runs import NodeLog, RunFolder, RunTarget
from ..shared import envnames
from ..shared.agreed import SLURM_PORT_BASE, SLURM_PORT_LAST, SLURM_PORT_SPAN, is_ddpkit_module, quiet_port, threads_per_process
from ..shared.wording import plural
from ..spec import Command, JobSpec
from ..spec.yamlfile import add_spec_arguments, spec_from_args
from ..targets.sshnode import new_rdzv_id
from .detach import absolute, detach
from .forkedagents import AgentServer, ForkedAgent
from .prelude import (
    READY_FLAG,
    Prelude,
    add_detach_arguments,
    hold_stop_signals,
    make_console,
    prelude,
    replay_held_stop,
    say_ready,
    supervised_run,
    supervisor_argv,
)
from .runargs import add_train_args, with_metrics_into, with_train_args
from .supervise import proctree
from .supervise.events import ElasticPolicy
from .supervise.nodeoutput import LinePrinter, NodeHandle, add_dedup_argument, node_log
from .supervise.summary import RunText
from .supervise.supervisor import Supervisor

FREE_PORT_TRIES = 200  # each a random pick among 22762 ports
AGENT_LOG = "agent.log"  # under --log-dir's node<I>/: everything the node's torchrun agent printed
FORK_SERVER_LOG = "forkserver.log"  # under --log-dir: the agents' fork server's own errors, if any


@dataclass
class LocalNode:
    """One torchrun agent acting as one node (a NodeHandle, see supervisor)."""

    index: int
    argv: list[str]
    env: dict[str, str]
    host: str = ""
    log: Path | None = None  # the agent's own output, all of it (torchrun's traceback the console leaves out)
    server: AgentServer | None = None  # the run's agents' fork server, None: the agent starts with Popen
    proc: subprocess.Popen[bytes] | ForkedAgent | None = None
    pump: threading.Thread | None = None

    @property
    def label(self) -> str:
        return f"node{self.index}"

    def start(self, printer: LinePrinter, exited: Callable[[], None]) -> None:
        replay_held_stop()  # a detached run's cancel that came before the supervisor's handlers
        forked = None if self.server is None else self.server.spawn(self.argv, self.env)
        self.proc = forked or subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)
        self.pump = threading.Thread(target=self._pump, args=(printer,), daemon=True)
        self.pump.start()
        threading.Thread(target=self._wait, args=(exited,), daemon=True).start()

    def _pump(self, printer: LinePrinter) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with node_log(self.log) as keep:
            for raw in iter(self.proc.stdout.readline, b""):
                keep(raw)
                printer.line(self, raw.decode("utf-8", "replace").rstrip("\n"))
        self.proc.stdout.close()

    def _wait(self, exited: Callable[[], None]) -> None:
        assert self.proc is not None and self.pump is not None
        self.proc.wait()
        # Its last lines first; a worker the agent left behind may hold the
        # pipe open, so do not wait for the end of the output for good.
        self.pump.join(timeout=2)
        exited()

    def exit_code(self) -> int | None:
        rc = None if self.proc is None else self.proc.poll()
        return None if rc is None else (128 - rc if rc < 0 else rc)

    def no_status_reason(self) -> str:
        return "the agent ended without an exit status"  # Popen always has one: never shown

    def stop(self, grace_s: float) -> str | None:
        """SIGTERM the agent's process group and its workers (which torchrun
        puts in sessions of their own), SIGKILL what is left after `grace_s`."""
        if self.proc is None:
            return None
        workers = proctree.descendants(self.proc.pid)
        self._signal(signal.SIGTERM)
        proctree.signal_all(workers, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        while proctree.alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        proctree.signal_all(proctree.alive(workers), signal.SIGKILL)
        if self.pump is not None:
            self.pump.join(timeout=5)
        return None

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="keep each process's output under DIR/node<I>/ (default: the run folder's logs/, "
                             "see `ddpkit runs`)")
    parser.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="after a node failed: SIGTERM the others, wait this long, then SIGKILL (default 10); "
                             "after Ctrl-C or SIGTERM they get the grace chain's time to checkpoint "
                             "(preemption.checkpoint_s)")
    add_dedup_argument(parser)
    add_detach_arguments(parser)
    add_train_args(parser)


def free_port() -> int:
    """A port free on this host, drawn from the range below the ephemeral one
    (agreed.quiet_port). A kernel-assigned port (bind to 0) is free now, but it
    is one of the ephemeral range's: until torchrun's store binds it, any
    process's outgoing connection may take it, and inside a container
    Docker's embedded DNS listens on one (a pod of the Kubernetes matrix
    failed with EADDRINUSE on the host's pick)."""
    draw = random.SystemRandom()
    for _ in range(FREE_PORT_TRIES):
        port = quiet_port(draw.randrange(SLURM_PORT_SPAN))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))  # every address, as torchrun's store binds
            except OSError:
                continue
            return port
    raise OSError(f"no free port among {FREE_PORT_TRIES} tried in {SLURM_PORT_BASE}-{SLURM_PORT_LAST}")


def local_spec(args: argparse.Namespace) -> JobSpec:
    """The job as given, made to run here: gloo on the CPU, static
    rendezvous on a free port unless the spec fixes one (a fixed master_port
    wins on every target). The user's --set still wins over these."""
    here = ["backend=gloo", "device=cpu"]
    if spec_from_args(args).elastic is None:  # an elastic job keeps c10d (it refuses a static rendezvous)
        here.append("rendezvous.backend=static")
    args = argparse.Namespace(**{**vars(args), "overrides": here + list(args.overrides)})
    spec = spec_from_args(args)
    if spec.master_port is None:
        spec = spec.model_copy(update={"master_port": free_port()})
    spec = with_train_args(spec, args.train_args)
    command = spec.command
    if spec.command.python == Command.model_fields["python"].default:
        # The agents run on this machine: use the interpreter ddpkit runs in.
        command = command.model_copy(update={"python": sys.executable})
    return spec.model_copy(update={"command": command})


def tee_flags(log_dir: Path) -> list[Arg]:
    """torchrun --tee: each local rank's output goes through its own log
    file, so lines of two ranks never interleave, and carries a
    `[rank<global rank>]:` prefix that the supervisor's printer turns into
    its own `[node<I> rank<R>]`."""
    return [Arg.of("--tee=3"), Arg.of(f"--log-dir={log_dir}"), Arg.of(records.RANK_TAG_FLAG)]


def node_plan(spec: JobSpec, node: int, log_root: Path) -> LaunchPlan:
    """Node `node`'s launch line, its agent's output teed under `log_root`.
    Every agent here sees its own host in the rendezvous endpoint
    (127.0.0.1), so each would try to host an elastic job's c10d store and
    whichever starts first would win: each is told it does not, since the
    launcher hosts it."""
    store_host = "0" if spec.elastic is not None else None
    return resolve(spec, RowKey.LOCAL, store_host=store_host, agent_flags=tee_flags(log_root / f"node{node}"))


def build_nodes(spec: JobSpec, log_root: Path, run_id: str | None = None, metrics: Path | None = None) -> list[LocalNode]:
    """Every node's agent. `metrics`: the file a program of the user's own has
    its metrics records written to by the preamble (ddpkit train is told by
    its --metrics flag)."""
    plans = [node_plan(spec, i, log_root) for i in range(spec.nodes)]
    env = dict(plans[0].env)
    if envnames.OMP_NUM_THREADS in os.environ:  # set in this shell: it wins, as it did with torchrun
        env.pop(envnames.OMP_NUM_THREADS, None)
    elif envnames.OMP_NUM_THREADS not in spec.env and spec.resources.cpus_per_process is None:
        # Every node's processes share this machine's cores (an agent alone would share them among its own).
        env[envnames.OMP_NUM_THREADS] = str(threads_per_process(len(os.sched_getaffinity(0)),
                                                                spec.nodes * spec.nproc_per_node))
    base = {**os.environ, **env, envnames.PYTHONUNBUFFERED: "1"}
    # The run key reaches the agents as the secrets do, in their environment:
    # readable by this user (and root) only, in no command line or file.
    base[envnames.DDPKIT_RUN_KEY] = runkey.new_key()
    rdzv_id = new_rdzv_id(spec)
    if rdzv_id is not None:
        base[envnames.DDPKIT_RDZV_ID] = rdzv_id
    if run_id is not None:
        base[envnames.DDPKIT_RUN_ID] = run_id
    if metrics is not None and not is_ddpkit_module(spec.command.module):
        base[envnames.DDPKIT_METRICS] = str(metrics)
    host = socket.gethostname()
    nodes = []
    for i, plan in enumerate(plans):
        # DDPKIT_HOSTNAME: N nodes share one machine, so each names itself
        # for the rank report's one-host-one-node check.
        env = {**base, **plan.node_vars[i], envnames.DDPKIT_HOSTNAME: f"{host}-node{i}"}
        nodes.append(LocalNode(i, [a.resolve(env) for a in plan.argv], env, f"{host}-node{i}",
                          log=log_root / f"node{i}" / AGENT_LOG))
    return nodes


def fork_server(nodes: list[LocalNode], log_root: Path) -> AgentServer | None:
    """Start the agents' fork server for `nodes` and hand it to each (None
    where it cannot start: each agent then starts with Popen). It is started
    with what every node's environment shares, and the longest node line."""
    shared = {key: value for key, value in nodes[0].env.items() if all(n.env.get(key) == value for n in nodes)}
    longest = max((node.argv for node in nodes), key=lambda argv: len("\0".join(argv)))
    server = AgentServer.start(longest, shared, log_root / FORK_SERVER_LOG)
    for node in nodes:
        node.server = server
    return server


@dataclass
class Restart:
    """launch local's Reviver: a failed node's agent, stopped with what it
    left behind, is started again at once with the same command."""

    grace: float

    def revive(self, node: NodeHandle, cancelled: threading.Event) -> NodeHandle | None:
        assert isinstance(node, LocalNode)
        node.stop(self.grace)
        return None if cancelled.is_set() else LocalNode(node.index, node.argv, node.env, node.host, log=node.log,
                                                    server=node.server)


def stop(nodes: list[LocalNode], grace: float) -> None:
    """Stop these agents and their workers, outside a supervised run."""
    for node in nodes:
        node.stop(grace)


def run(args: argparse.Namespace) -> int:
    supervising = supervised_run(args)
    if supervising is not None:  # a detached run's supervisor: a stop signal is held until the nodes start
        hold_stop_signals()
        supervising.hand_over(os.getpid(), detached=True)  # status and cancel reach this process
        say_ready(args.ready_fd)  # the launching command returns now: its checks were these
    # The secrets are read to refuse an unset one: the agents inherit them with the rest of this environment.
    ready = prelude(local_spec(args), "launch local", RowKey.LOCAL)
    run = supervising or ready.run_folder(RunTarget.LOCAL)
    if args.detach:
        options = ["--grace", f"{args.grace!r}", *([] if args.dedup else ["--no-dedup"])]
        if args.log_dir is not None:
            options += ["--log-dir", absolute(args.log_dir) or ""]
        argv = supervisor_argv(["launch", "local"], run, options)
        return detach(ready.who, run, lambda fd: [*argv, READY_FLAG, str(fd)])
    # On this machine the run folder is where rank 0 runs: its metrics go there for `ddpkit report`.
    spec = with_metrics_into(ready.spec, run.metrics_file)
    return launch(ready, spec, args.log_dir or run.logs_dir, args.grace, run, dedup=args.dedup)


def launch(ready: Prelude, spec: JobSpec, log_root: Path, grace: float, run: RunFolder, dedup: bool = True) -> int:
    """`spec`: the prelude's, with the run folder's metrics file."""
    nodes = build_nodes(spec, log_root, run.record().id, run.metrics_file)
    # torchrun's --tee puts `[rank<R>]:` before every worker line of the agent's log
    run.set_logs([NodeLog(node=n.index, host=n.host, path=str(n.log), rank_tagged=True) for n in nodes])
    console = make_console()
    console.print(f"launch local: {plural(spec.nodes, 'node')} x {plural(spec.nproc_per_node, 'process')}, "
                  f"master 127.0.0.1:{spec.master_port}", markup=False)
    if ready.note_line:
        console.print(ready.note_line, markup=False)
    supervisor = Supervisor(nodes, console, grace, interrupt_grace_s=spec.grace.launcher_grace_s,
                            elastic=ElasticPolicy.of(spec.elastic, Restart(grace), any_node=True),
                            ranks=spec.nodes * spec.nproc_per_node, dedup=dedup, run=run)
    console.print(ready.run_line(run), markup=False)
    with contextlib.ExitStack() as stack:
        if spec.elastic is not None:
            assert spec.master_port is not None  # local_spec draws one
            stack.enter_context(hosted_store("127.0.0.1", spec.master_port))
        server = fork_server(nodes, log_root)
        if server is not None:
            stack.callback(server.close)
        outcome = supervisor.run()
    supervisor.summary(outcome, RunText("launch local", "interrupted; stopped all nodes"))
    return outcome.code
