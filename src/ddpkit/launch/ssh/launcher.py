"""`ddpkit launch ssh`: start a job on bare-metal hosts over SSH.

hosts (hostfile or spec) -> ssh_config -> preflight on every host at once,
each host then waiting on its open session -> every node told to go with its
node rank (no second connection or login) -> the shared supervisor: output
streamed with a `[nodeN host]` prefix and logged per node, the first failure,
a dropped connection or Ctrl-C stops every node (TERM, then KILL after
ssh.grace_s), and the summary table on stderr. An elastic job (spec.elastic)
goes on without a failed node while min_nodes remain (node 0 too where
this launcher hosts the rendezvous store: storesite.py); its host is probed
until it answers again, and the node's agent restarted to join at the next
rendezvous, until it failed elastic.max_node_failures times; the summary
names it as rejoined or excluded (docs/guides/elastic.md).

With --detach the supervisor runs on the first host instead (detached.py,
docs/guides/detach.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ...contract import RowKey, master_port
from ...rdzv_store import hosted_store
from ...render.quoting import shell_word
from ...runs import NodeLog, RunFolder, RunTarget
from ...shared.exitcodes import ExitCode
from ...spec import JobSpec, doctor_mode
from ...targets.sshnode import NodeCommand, env_prefix, launch_line, new_rdzv_id, node_command, node_env
from ..prelude import (
    Prelude,
    add_detach_arguments,
    hold_stop_signals,
    make_console,
    prelude,
    say_ready,
    supervised_run,
)
from ..runargs import add_train_args, metrics_from_output, with_metrics_into, with_train_args
from ..secrets import stdin_payload, with_run_key
from ..supervise.events import ElasticPolicy
from ..supervise.nodeoutput import NodeHandle, add_dedup_argument
from ..supervise.summary import RunText
from ..supervise.supervisor import Supervisor
from .connect import Endpoint, SshSettings, endpoint_for
from .detached import detach_over_ssh, host_line, take_over
from .hostfile import load_hosts
from .preflight import (
    GO,
    GO_LAUNCHER_STORE,
    HostFacts,
    Start,
    close_all,
    gather,
    judge_host,
    preflight,
    problem_table,
    store_unreached,
    verdict,
)
from .running_node import SshNode, safe_name
from .storesite import Answerer, node0_hosts_line, open_answerer, unreached

PROBE_S = 5.0  # how often a failed node's host is tried again (elastic)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ...spec.yamlfile import add_spec_arguments

    add_spec_arguments(parser)
    parser.add_argument("--hostfile", type=Path, help="lines '[user@]host[:port] [slots=N]'; default: ssh.hosts")
    parser.add_argument("--dry-run", action="store_true", help="print each host's launch line; connect to nothing")
    parser.add_argument("--full", action="store_true", help="with --dry-run: the exact command sent to each host")
    parser.add_argument("--doctor", action="store_true", help="run `ddpkit doctor` instead of the job's command")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="add unknown host keys to known_hosts (changed keys are still refused)")
    parser.add_argument("--known-hosts", type=Path, help="known_hosts file (default: ssh_config or ~/.ssh/known_hosts)")
    parser.add_argument("--ssh-config", type=Path, help="ssh_config file (default ~/.ssh/config)")
    parser.add_argument("-i", "--identity", type=Path, help="private key to try first")
    parser.add_argument("--master-addr", help="address the nodes reach node 0 by (default: first host's HostName)")
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="one log file per node in DIR (default: ssh.log_dir if the spec sets it, else the "
                             "run folder's logs/, see `ddpkit runs`)")
    parser.add_argument("--grace", type=float, metavar="SECONDS",
                        help="after a node failed: SIGTERM the others, wait this long, then SIGKILL (default: "
                             "ssh.grace_s); after Ctrl-C or SIGTERM they get the grace chain's time to checkpoint "
                             "(preemption.checkpoint_s)")
    add_dedup_argument(parser)
    add_detach_arguments(parser, "a session of its own on the job's first host")
    parser.add_argument("--detach-runs-dir", metavar="DIR",
                        help="with --detach: the runs folder on the first host that keeps the run's folder "
                             "(default: DDPKIT_RUNS_DIR there, else ~/.ddpkit/runs there)")
    add_train_args(parser)


@dataclass
class SshPlan:
    """Everything decided before any connection: hosts, addresses, commands."""

    spec: JobSpec
    endpoints: list[Endpoint]
    master_addr: str
    master_port: int
    rdzv_id: str | None = None  # an elastic job's rendezvous id: one per run of `launch ssh`
    # The secrets' values from this environment (launch.secrets), sent to each
    # node on its session's stdin; empty for a dry run, which sends nothing.
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    log_dir: Path | None = None  # the run folder's logs/ when the spec leaves ssh.log_dir unset
    # This launcher's address when it hosts the elastic job's rendezvous store
    # (storesite.py): the nodes' rendezvous endpoint; None: node 0's agent hosts it.
    store_at: str | None = None
    metrics: Path | None = None  # where a program of the user's own has its framed metrics records kept

    def command(self, rank: int) -> NodeCommand:
        return node_command(self.spec, rank, self.store_at or self.master_addr, rdzv_id=self.rdzv_id,
                            metrics=self.metrics is not None)

    @property
    def verdict(self) -> bytes:
        """What tells a node waiting at the gate to start, as decided."""
        return verdict(GO_LAUNCHER_STORE if self.store_at else GO)

    def start(self, rank: int, launcher: str | None = None) -> Start:
        """Node `rank`'s start behind the gate: as decided, or (`launcher`,
        before the preflight decided) either node 0's store or the one at
        this launcher's address."""
        command = self.command(rank)
        prefixes = {GO_LAUNCHER_STORE if self.store_at else GO: command.prefix}
        if launcher is not None:
            prefixes[GO_LAUNCHER_STORE] = env_prefix(rank, launcher, self.rdzv_id, self.metrics is not None)
        return Start(prefixes, command.payload)

    def log_path(self, rank: int) -> Path:
        host = safe_name(self.endpoints[rank].alias)
        folder = self.log_dir if self.log_dir is not None else Path(self.spec.ssh.log_dir)
        return folder / f"{self.spec.name}.node{rank}.{host}.log"


def settings_from(args: argparse.Namespace, spec: JobSpec) -> SshSettings:
    return SshSettings(
        config_path=args.ssh_config, known_hosts=args.known_hosts, identity=args.identity,
        accept_new_host_keys=args.accept_new_host_keys, timeout_s=spec.ssh.connect_timeout_s,
        default_user=spec.ssh.user, default_port=spec.ssh.port,
        alive_interval_s=spec.ssh.alive_interval_s, alive_count=spec.ssh.alive_count,
    )


def make_plan(spec: JobSpec, args: argparse.Namespace, settings: SshSettings) -> SshPlan:
    entries = load_hosts(spec, args.hostfile)
    endpoints = [endpoint_for(e, settings) for e in entries]
    port = master_port(spec, RowKey.SSH)
    assert port is not None  # SSH always has a fixed port
    return SshPlan(spec, endpoints, args.master_addr or endpoints[0].hostname, port, new_rdzv_id(spec))


def print_dry_run(plan: SshPlan, out: TextIO, *, full: bool = False) -> None:
    """Each host's launch line (the job's environment once, above them);
    `full`: the exact command sent, with its process-group and clean-up shell."""
    spec = plan.spec
    out.write(f"# job {spec.name}: {len(plan.endpoints)} nodes, master {plan.master_addr}:{plan.master_port}\n")
    if not full:
        out.write("# every node's environment:\n")
        out.writelines(f"#   {k}={shell_word(v)}\n" for k, v in node_env(spec).items())
        if spec.elastic is not None:
            out.write("# elastic: the rendezvous endpoint becomes this launcher's address where every node "
                      "reaches it (docs/guides/elastic.md)\n")
        if spec.secrets:
            names = ", ".join(s.name for s in spec.secrets)
            out.write(f"#   and the secrets {names}, from this environment over each session's stdin\n")
    for rank, ep in enumerate(plan.endpoints):
        via = f" via {ep.jump}" if ep.jump else ""
        out.write(f"# node {rank}: {ep}{via}, log {plan.log_path(rank)}\n")
        line = plan.command(rank).start if full else launch_line(
            spec, rank, plan.master_addr, rdzv_id=plan.rdzv_id)
        out.write(line + "\n")
    if not full:
        out.write("# --dry-run --full: the exact command sent to each host\n")


def node_run(plan: SshPlan, f: HostFacts, settings: SshSettings, attempt: int = 0) -> SshNode:
    """The node's run on the session its passed preflight left waiting at GO."""
    assert f.client is not None and f.channel is not None and f.stream is not None  # preflight passed
    return SshNode(f.node, f.endpoint, plan.command(f.node), f.client, f.channel, f.stream,
                   settings, plan.log_path(f.node), attempt=attempt, secrets=stdin_payload(plan.secrets),
                   verdict=plan.verdict)


def node_runs(plan: SshPlan, facts: list[HostFacts], settings: SshSettings) -> list[SshNode]:
    return [node_run(plan, f, settings) for f in facts]


@dataclass
class Revive:
    """The supervisor's Reviver for launch ssh: stop what a failed node left
    on its host (reconnecting, as teardown does), then run the preflight
    again until the host passes it. The new session waits at GO, as every
    node did at the start; the supervisor sends it."""

    plan: SshPlan
    settings: SshSettings
    runs: list[SshNode] = field(default_factory=list)  # every run it made: the launcher closes them
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def revive(self, node: NodeHandle, cancelled: threading.Event) -> NodeHandle | None:
        old = node
        assert isinstance(old, SshNode)
        cleared = False
        while not cancelled.is_set():
            cleared = cleared or old.stop(self.plan.spec.ssh.grace_s) is None
            run = self._try_start(old) if cleared else None
            if run is not None:
                if not cancelled.is_set():
                    return run
                run.close()
            cancelled.wait(PROBE_S)
        return None

    def made(self) -> list[SshNode]:
        with self._lock:
            return list(self.runs)

    def _try_start(self, old: SshNode) -> SshNode | None:
        spec = self.plan.spec
        facts = gather(HostFacts(old.rank, old.endpoint), spec, self.settings, self.plan.start(old.rank))
        judge_host(facts, spec, None if self.plan.store_at else self.plan.master_port)
        if facts.problems:
            close_all([facts])
            return None
        run = node_run(self.plan, facts, self.settings, attempt=old.attempt + 1)
        with self._lock:
            self.runs.append(run)
        return run


def place_store(plan: SshPlan, answerer: Answerer | None, facts: list[HostFacts],
                stack: contextlib.ExitStack) -> str | None:
    """Host the elastic job's store here when every node reached the
    answerer (plan.store_at set); else why node 0's agent hosts it."""
    if answerer is None:
        return None
    missed = store_unreached(facts, answerer.probe)
    if missed is not None:
        return unreached(answerer.host, answerer.port, missed)
    try:
        stack.enter_context(hosted_store(answerer.host, answerer.port, answerer.handover()))
    except OSError as exc:
        return str(exc)
    plan.store_at = answerer.host
    return None


def launch(ready: Prelude, plan: SshPlan, settings: SshSettings, dedup: bool = True,
           folder: RunFolder | None = None, on_ready: Callable[[], None] | None = None) -> int:
    """`on_ready`: called once every host passed the preflight, before any node starts."""
    with contextlib.ExitStack() as stack:  # the elastic job's store, when hosted here, outlives every node
        answerer, why = open_answerer(plan.endpoints[0], plan.master_port) if plan.spec.elastic is not None else (None, "")
        if answerer is not None:
            stack.callback(answerer.close)
        return _launch(ready, plan, settings, answerer, why, stack, dedup, folder, on_ready)


def _launch(ready: Prelude, plan: SshPlan, settings: SshSettings, answerer: Answerer | None, why: str,
            stack: contextlib.ExitStack, dedup: bool, folder: RunFolder | None,
            on_ready: Callable[[], None] | None = None) -> int:
    t0 = time.monotonic()
    starts = [plan.start(rank, answerer.host if answerer else None) for rank in range(len(plan.endpoints))]
    facts, problems = preflight(plan.endpoints, plan.spec, settings, plan.master_port, starts,
                                answerer.probe if answerer else None)
    stderr = make_console(stderr=True)
    if problems:
        stderr.print(problem_table(problems))
        if folder is not None:
            folder.event("preflight", f"{len(problems)} problem(s); nothing was started")
            folder.finish(ExitCode.PREFLIGHT)
        return ExitCode.PREFLIGHT
    why = place_store(plan, answerer, facts, stack) or why
    store = (f"rendezvous store on this launcher, {plan.store_at}:{plan.master_port} (node 0 may fail as any other)"
             if plan.store_at else f"master {plan.master_addr}:{plan.master_port}")
    print(f"ddpkit: preflight ok on {len(facts)} hosts in {time.monotonic() - t0:.1f}s; {store}",
          file=sys.stderr, flush=True)
    if why:
        print(node0_hosts_line(why), file=sys.stderr, flush=True)
    if ready.note_line:
        print(ready.note_line, file=sys.stderr, flush=True)
    if on_ready is not None:
        on_ready()
    runs = node_runs(plan, facts, settings)
    # Node output on stdout, the summary on stderr (as the preflight's table).
    stdout = make_console()
    revive = Revive(plan, settings, list(runs))  # for an elastic job; its runs are closed below either way
    elastic = ElasticPolicy.of(plan.spec.elastic, revive, any_node=plan.store_at is not None)
    supervisor = Supervisor(runs, stdout, plan.spec.ssh.grace_s, summary_console=stderr,
                            interrupt_grace_s=plan.spec.grace.launcher_grace_s, elastic=elastic,
                            ranks=plan.spec.nodes * plan.spec.nproc_per_node, dedup=dedup, run=folder,
                            metrics=plan.metrics)
    try:
        outcome = supervisor.run()  # every host is already waiting: GO is one write each
        supervisor.summary(outcome, RunText("launch ssh", "interrupted: every node was stopped"))
        return outcome.code
    finally:
        for run in revive.made():  # stops its keepalive, then closes its session and connection
            run.close()
        close_all(facts)  # hosts interrupted before they got a run: still waiting for the verdict


def run(args: argparse.Namespace) -> int:
    from ...spec.yamlfile import spec_from_args

    supervising = supervised_run(args)
    payload: dict[str, Any] = {}
    if supervising is not None:  # a detached run's supervisor, on the first host (detached.py)
        hold_stop_signals()
        supervising, payload = take_over(args)

    # --log-dir and --grace are the spec's ssh.log_dir and ssh.grace_s, as --set would give them.
    own = list(args.overrides)
    if args.log_dir:
        own.append(f"ssh.log_dir={args.log_dir}")
    if args.grace is not None:
        own.append(f"ssh.grace_s={args.grace}")
    spec = spec_from_args(argparse.Namespace(**{**vars(args), "overrides": own}))
    spec = with_train_args(spec, args.train_args)
    if args.doctor:
        spec = doctor_mode(spec)
    if supervising is not None:  # rank 0 runs on this host, beside the run folder: ddpkit train's metrics go there
        spec = with_metrics_into(spec, supervising.metrics_file)
    # a dry run shows commands, which hold the secrets' names only
    ready = prelude(spec, "launch ssh", RowKey.SSH, read_secrets=not args.dry_run)
    settings = settings_from(args, spec)
    plan = make_plan(spec, args, settings)
    if args.dry_run:
        print_dry_run(plan, sys.stdout, full=args.full)
        return ExitCode.OK
    if args.detach:
        return _detach(args, ready, plan, settings)
    plan.secrets = with_run_key(ready.secrets)  # the node script reads the run key after the secrets
    run = supervising or ready.run_folder(RunTarget.SSH, nodes=len(plan.endpoints))
    log_dir_set = payload["log_dir_set"] if supervising else "log_dir" in spec.ssh.model_fields_set
    if not log_dir_set:  # the spec's own folder wins; else the run's
        plan.log_dir = run.logs_dir
    # ssh.docker's containers get the job's environment only, not the node's env prefix.
    plan.metrics = None if spec.ssh.docker else metrics_from_output(spec, run.metrics_file)
    run.set_logs([NodeLog(node=r, host=ep.alias, path=str(plan.log_path(r))) for r, ep in enumerate(plan.endpoints)])
    print(ready.run_line(run), file=sys.stderr, flush=True)
    return launch(ready, plan, settings, dedup=args.dedup, folder=run,
                  on_ready=None if supervising is None else lambda: say_ready(args.ready_fd))


def _detach(args: argparse.Namespace, ready: Prelude, plan: SshPlan, settings: SshSettings) -> int:
    """The run's handle here, and its supervisor started on the first host (detached.py)."""
    from ...spec.yamlfile import dump_yaml

    spec = plan.spec
    run = ready.run_folder(RunTarget.SSH, nodes=len(plan.endpoints))
    print(ready.run_line(run), file=sys.stderr, flush=True)
    payload = {"nodes": len(plan.endpoints), "nproc_per_node": spec.nproc_per_node,
               "stop_grace_s": spec.grace.launcher_grace_s, "spec": dump_yaml(spec),
               "hosts": [host_line(ep) for ep in plan.endpoints], "secrets": ready.secrets,
               "log_dir_set": "log_dir" in spec.ssh.model_fields_set}
    options = ["--master-addr", plan.master_addr, *([] if args.dedup else ["--no-dedup"])]
    for flag, path in (("--ssh-config", args.ssh_config), ("--known-hosts", args.known_hosts),
                       ("-i", args.identity)):
        if path is not None:
            options += [flag, os.path.abspath(path)]
    if args.accept_new_host_keys:
        options.append("--accept-new-host-keys")
    return detach_over_ssh(ready.who, run, plan.endpoints[0], settings, spec.command.python,
                           args.detach_runs_dir, payload, options)
