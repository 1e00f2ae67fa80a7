"""`python -m ddpkit.agent [torchrun's arguments]` (see the package's doc)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from ..host import workdir
from ..rendezvous import runkey
from ..shared import envnames
from ..shared.agreed import RDZV_HANDLER, threads_per_process
from ..shared.exitcodes import WORKER_CODES, ExitCode

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# What a ddpkit worker imports before its first step (train/main.py's
# import_trainer): torch._dynamo through the optimizer and DDP, the trainer's
# modules, and the preamble a program of the user's own gets (ddpkit/preamble).
PRELOAD = ("torch._dynamo", "ddpkit.train.main", "ddpkit.train.loop.training", "ddpkit.train.startup.rank_report",
           "ddpkit.train.data.loaders", "ddpkit.preamble.interface", "ddpkit.preamble.ranks", "ddpkit.preamble.progress",
           "ddpkit.preamble.metrics", "ddpkit.preamble.stragglers", "ddpkit.preamble.store")


def forks(env: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this agent's workers come from a zygote (Linux only; off with DDPKIT_AGENT_FORK=0)."""
    return sys.platform.startswith("linux") and env.get(envnames.DDPKIT_AGENT_FORK, "1") != "0"


def preload(env: dict[str, str] | os._Environ[str]) -> tuple[str, ...]:
    """PRELOAD, then the modules DDPKIT_AGENT_PRELOAD names."""
    extra = [name.strip() for name in env.get(envnames.DDPKIT_AGENT_PRELOAD, "").split(",")]
    return tuple(dict.fromkeys([*PRELOAD, *(name for name in extra if name)]))


def share_cores(nproc_per_node: str, env: os._Environ[str] | dict[str, str]) -> None:
    """OMP_NUM_THREADS, unless set: this node's cores shared among its workers
    (torchrun would set 1 for more than one worker, and leave it unset for one)."""
    if envnames.OMP_NUM_THREADS not in env and str(nproc_per_node).isdigit():
        env[envnames.OMP_NUM_THREADS] = str(threads_per_process(len(os.sched_getaffinity(0)), int(nproc_per_node)))


# torch's own rendezvous handlers, which keep their keys in the store under the id they are given: c10d's
# state (`torch.rendezvous.<id>`), static's rank assignment and exit barrier (a PrefixStore named by the id).
# ddpkit's handler (rendezvous.py) keys the id itself.
TORCH_RDZV = frozenset({"c10d", "static"})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """torchrun's arguments, with torch's own rendezvous keyed: the agents
    meet under the rendered id (torchrun's "none" where none is rendered)
    tagged with the run key (runkey.rdzv_run_id), so that no one who read
    the rendered files or the command line can name their keys in the store,
    join the rendezvous or close it. Every node holds the same key, so every
    node tags alike; without a key the id stays as given."""
    from torch.distributed import run as torchrun  # torch: what the agent imports anyway

    args: argparse.Namespace = torchrun.parse_args(argv)
    if args.rdzv_backend in TORCH_RDZV:
        args.rdzv_id = runkey.rdzv_run_id(args.rdzv_id)
    return args


def name_control_store(args: argparse.Namespace, env: os._Environ[str] | dict[str, str]) -> None:
    """Tell the workers the rendezvous store's address (host:port) where
    one is (c10d, ddpkit's handler): the watchdog keeps its records there
    (train/watchdog/stall.open_store says why)."""
    if args.rdzv_backend not in ("c10d", RDZV_HANDLER) or not args.rdzv_endpoint:
        return
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    env[envnames.DDPKIT_CONTROL_STORE] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def same_error_twice() -> NoReturn:
    """End the agent on the same error twice (agent/sameerror.py; its
    handler announced it): ExitCode.SAME_ERROR, no restart, and no requeue
    of a Slurm job. torchrun has stopped the workers."""
    end_failed(ExitCode.SAME_ERROR)


def end_failed(code: int) -> NoReturn:
    """End the agent after its workers failed, with `code`; a Slurm job's
    batch script is told when the first of them failed (nodefailure.py)."""
    from . import handler, nodefailure

    nodefailure.leave(code, handler.FIRST_FAILURE[0] if handler.FIRST_FAILURE else None)
    sys.exit(code)


def report(text: str, what: str) -> None:
    """torch's report on how the agent's run ended (its traceback, the failed
    workers' box): announced by an `agent_report` record and printed, for a
    launcher to keep in the node's log; in a Slurm job, kept in the node's log
    (nodelog.py) and one line says `what` and where it is."""
    from .. import records
    from . import nodelog, stopping

    kept = nodelog.keep(text, f"torch's report: {what}")
    if kept is None:
        records.emit(records.AgentReport.of(text))
        sys.stderr.write(text)
        return
    node = "" if stopping.LAST.node is None else f" node {stopping.LAST.node}:"
    print(f"ddpkit.agent:{node} {what}; torch's report: {kept}", file=sys.stderr, flush=True)


def failed_first(failed: ChildFailedError) -> str:
    """The worker that failed first and how, in a few words (the others were stopped, or failed after it)."""
    from .stopping import name

    rank, first = failed.get_first_failure()
    code = first.exitcode
    return f"worker rank {rank} failed ({f'killed by {name(-code)}' if code < 0 else f'exit code {code}'})"


def own_code(failed: ChildFailedError) -> int:
    """The agent's exit status after its workers failed: the first failed
    worker's own code where it is one of ddpkit's (exitcodes.WORKER_CODES: a
    stall's 13, a lost node's 14, ...), else torchrun's 1. Where no launcher
    reads the agent's `worker_exit` records (Slurm's batch script, a pod),
    the scheduler records this status as the job's."""
    _, first = failed.get_first_failure()
    return first.exitcode if first.exitcode in WORKER_CODES else 1


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from . import exitbarrier, handler, nodelog, nodestderr, orphaned, sameerror, stopping, tailing, worker, zygote

    workdir.enter(os.environ, "ddpkit.agent")
    args = parse_args(argv)
    if args.rdzv_backend == RDZV_HANDLER:
        from ..rendezvous import handler as rendezvous

        rendezvous.register()
    name_control_store(args, os.environ)
    tailing.install()
    stopping.install(handler.a_worker_ended)
    exitbarrier.install(exitbarrier.hosts_store(args))
    share_cores(args.nproc_per_node, os.environ)
    # before the zygote's fork: it and its workers write their stderr through the copier too
    node_stderr = None if nodelog.path() is None else \
        nodestderr.redirect(lambda line: nodelog.keep(line, "c10d, on a connection to the store"))
    started: zygote.Zygote | None = None
    why = handler.unsupported()
    if why is None and not args.no_python and not args.run_path:
        started = zygote.start(preload(os.environ)) if forks(os.environ) else None
        handler.install(started)
    elif why is not None and forks(os.environ):
        print(f"ddpkit.agent: workers start as new interpreters: {why}", file=sys.stderr, flush=True)
    if node_stderr is not None:
        node_stderr.copy()  # a thread: after the zygote's fork
    try:
        try:
            record(torchrun.run)(args)
        finally:
            stopping.ending()
    except sameerror.SameErrorTwice:
        same_error_twice()
    except ChildFailedError as failure:
        if handler.repeated() is not None:  # the same error twice, with no restart left anyway
            same_error_twice()
        # torchrun's report on a failed worker (its traceback and summary box)
        # says nothing the worker's own lines and its exit record do not: the
        # `agent_report` record ahead of it lets a launcher keep it to the node's log,
        # and a Slurm job keeps it there itself (one line says where).
        report(worker.exception_text(skipping=(__name__,)), failed_first(failure))
        end_failed(own_code(failure))
    except SignalException as exc:
        # Stopped by a signal (Ctrl-C, a launcher's or scheduler's stop), a normal end: torch's traceback
        # says only where its loop was when the signal came, so one line says what happened instead.
        print(stopping.stopped_line(exc.sigval), file=sys.stderr, flush=True)
        sys.exit(stopping.stopped_code())
    except RendezvousClosedError:
        # Another node's agent closed the job's rendezvous as it ended (it failed for good, or saw the same
        # error twice): that node's lines say why; here torch's traceback is the node log's, and one line.
        report(worker.exception_text(skipping=(__name__,)), "the rendezvous was closed")
        print("ddpkit.agent: the job's rendezvous was closed by another node's agent as it ended; this node ends too",
              file=sys.stderr, flush=True)
        orphaned.end_orphaned_job(args, handler.workers_started() > 0, os.environ)
        sys.exit(1)
    except Exception:
        # What torchrun's own uncaught failure prints (a rendezvous that timed
        # out, a store that went away), from torch's frames on: this module's
        # two add nothing. Exit 1, as the interpreter would.
        try:
            worker.print_exception(skipping=(__name__,))
        except OSError:  # stderr's reader gone (in Slurm, the lost batch host's srun): the job must still end
            pass
        orphaned.end_orphaned_job(args, handler.workers_started() > 0, os.environ)
        sys.exit(1)
    finally:
        if started is not None:
            started.close()
        if node_stderr is not None:
            node_stderr.close()
        stopping.settled()


if __name__ == "__main__":
    main()
