"""`ddpkit launch local`: N torchrun agents on this machine acting as N nodes.

Each agent gets the launch line every per-node target runs
(contract.torchrun_argv with Target.LOCAL sources: static rendezvous on
127.0.0.1, node rank from DDPKIT_NODE_RANK), gloo on the CPU. Output is
streamed live with a `[nodeI]` prefix. Fail fast: the first agent that exits
non-zero stops the others (each agent leads its own process group, so its
workers go too), and the run ends with a summary naming it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..contract import Target, job_env, sources, torchrun_argv
from ..spec import Command, JobSpec
from ..specfile import add_spec_arguments, spec_from_args
from . import proctree
from .interrupt import interrupts_raise

if TYPE_CHECKING:
    from rich.console import Console

STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")


@dataclass
class Node:
    index: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    returncode: int | None = None
    stopped_by_us: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--log-dir", type=Path, metavar="DIR",
                        help="keep each process's output under DIR/node<I>/ (default: a temporary folder)")
    parser.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="after a failure or Ctrl-C: SIGTERM, wait this long, then SIGKILL (default 10)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN ARGS",
                        help="arguments appended to the job's command (after --)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_spec(args: argparse.Namespace) -> JobSpec:
    """The job as given, made to run here: gloo on the CPU, static
    rendezvous on a free port. The user's --set still wins over these."""
    here = ["backend=gloo", "device=cpu", "rendezvous.backend=static", f"master_port={free_port()}"]
    args = argparse.Namespace(**{**vars(args), "overrides": here + list(args.overrides)})
    spec = spec_from_args(args)
    extra = [a for a in args.train_args if a != "--"] if args.train_args[:1] == ["--"] else list(args.train_args)
    command = spec.command.model_copy(update={"args": [*spec.command.args, *extra]})
    if spec.command.python == Command.model_fields["python"].default:
        # The agents run on this machine: use the interpreter ddpkit runs in.
        command = command.model_copy(update={"python": sys.executable})
    return spec.model_copy(update={"command": command})


def with_tee(argv: list[str], log_dir: Path) -> list[str]:
    """torchrun --tee: each local rank's output goes through its own log
    file, so lines of two ranks never interleave, and carries a
    `[default<local rank>]:` prefix."""
    at = argv.index("torch.distributed.run") + 1
    return [*argv[:at], "--tee=3", f"--log-dir={log_dir}", *argv[at:]]


def build_nodes(spec: JobSpec, log_root: Path) -> list[Node]:
    argv = torchrun_argv(spec, sources(spec, Target.LOCAL))
    base = {**os.environ, **job_env(spec), "PYTHONUNBUFFERED": "1"}
    host = socket.gethostname()
    nodes = []
    for i in range(spec.nodes):
        # DDPKIT_HOSTNAME: N nodes share one machine, so each names itself
        # for the rank report's one-host-one-node check.
        env = {**base, "DDPKIT_NODE_RANK": str(i), "DDPKIT_HOSTNAME": f"{host}-node{i}"}
        nodes.append(Node(i, with_tee([a.resolve(env) for a in argv], log_root / f"node{i}"), env))
    return nodes


def _pump(node: Node, stream: IO[bytes], console: Console) -> None:
    from rich.text import Text

    style = STYLES[node.index % len(STYLES)]
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        console.print(Text.assemble((f"[node{node.index}] ", style), line), soft_wrap=True)
    stream.close()


def start(node: Node, console: Console) -> None:
    node.proc = subprocess.Popen(node.argv, env=node.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    node.pump = threading.Thread(target=_pump, args=(node, node.proc.stdout, console), daemon=True)
    node.pump.start()


def _signal(node: Node, sig: int) -> None:
    if node.proc is None or node.proc.poll() is not None:
        return
    try:
        os.killpg(node.proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(nodes: list[Node], grace: float) -> None:
    """SIGTERM every running agent's process group and its workers (which
    torchrun puts in sessions of their own), SIGKILL what is left after `grace`."""
    running = [n for n in nodes if n.proc is not None and n.proc.poll() is None]
    workers = [pid for node in running for pid in proctree.descendants(node.proc.pid)]
    for node in running:
        node.stopped_by_us = True
        _signal(node, signal.SIGTERM)
    proctree.signal_all(workers, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for node in running:
        try:
            node.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(node, signal.SIGKILL)
            node.proc.wait()
    while proctree.alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    proctree.signal_all(proctree.alive(workers), signal.SIGKILL)


def supervise(nodes: list[Node], grace: float) -> Node | None:
    """Wait for all agents; on the first non-zero exit stop the rest and
    return that node."""
    while True:
        running = False
        for node in nodes:
            assert node.proc is not None
            rc = node.proc.poll()
            if rc is None:
                running = True
            elif rc != 0:
                stop(nodes, grace)
                return node
        if not running:
            return None
        time.sleep(0.1)


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def summary(console: Console, nodes: list[Node], failed: Node | None, elapsed: float, interrupted: bool) -> None:
    from rich.table import Table

    table = Table(title=f"launch local: {len(nodes)} nodes, {elapsed:.1f}s", title_justify="left")
    for col in ("node", "exit code", "status"):
        table.add_column(col)
    for node in nodes:
        rc = node.proc.returncode if node.proc is not None else None
        if node is failed:
            status = "[red]failed first[/]"
        elif node.stopped_by_us:
            status = "[yellow]stopped[/]"
        else:
            status = "[green]ok[/]" if rc == 0 else "[red]failed[/]"
        table.add_row(f"node{node.index}", str(rc), status)
    console.print(table)
    if interrupted:
        console.print("[yellow]launch local: interrupted; stopped all nodes[/]")
    elif failed is not None:
        assert failed.proc is not None
        console.print(f"[bold red]launch local: node{failed.index} exited with code "
                      f"{exit_code(failed.proc.returncode)}; stopped the other nodes[/]")


def run(args: argparse.Namespace) -> int:
    spec = local_spec(args)
    with tempfile.TemporaryDirectory(prefix="ddpkit-local-") as tmp:
        return launch(spec, args.log_dir or Path(tmp), args.grace)


def launch(spec: JobSpec, log_root: Path, grace: float) -> int:
    from rich.console import Console

    nodes = build_nodes(spec, log_root)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(f"launch local: {spec.nodes} nodes x {spec.nproc_per_node} processes, "
                  f"master 127.0.0.1:{spec.master_port}", markup=False)
    began = time.monotonic()
    failed, interrupted = None, False
    try:
        with interrupts_raise():
            for node in nodes:
                start(node, console)
            failed = supervise(nodes, grace)
    except KeyboardInterrupt:
        interrupted = True
        stop(nodes, grace)
    for node in nodes:
        if node.pump is not None:
            node.pump.join(timeout=5)
    summary(console, nodes, failed, time.monotonic() - began, interrupted)
    if interrupted:
        return 130
    if failed is not None:
        assert failed.proc is not None
        return exit_code(failed.proc.returncode) or 1
    return 0
