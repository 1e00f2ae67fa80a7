"""`python -m ddpkit.agent.forkserver FD ARGV...`: the agents of one
`launch local` run forked from one process that imported torch, torchrun,
the agent and its workers' preload once, instead of every node's agent
importing them again (about 4 of the 5 CPU-seconds a node costs to start;
a run of N nodes pays them once, not N times).

An agent forked here is what `python -m ddpkit.agent ARGV` started by the
launcher would be: a session of its own (the launcher stops it with killpg),
stdin from /dev/null, stdout and stderr on the pipe the launcher reads, the
launcher's working directory and the node's environment in os.environ, its
line in ps (worker.show_argv: ARGV, the longest node's line, sized the
argument area), the module run as `-m` runs it, and the exit code an
interpreter would end with. What differs: /proc/PID/environ shows what
every node's environment shares (this process was started with it), not the
node's own variables; the agent's parent is this process. An agent does not
die with this process: a launcher that is SIGKILLed leaves its agents
running, as it did with Popen, and `ddpkit cancel` finds them by the run id
all of them share.

The protocol, over the socket on FD: the launcher sends the node's output
descriptor (multiprocessing.reduction.send_handle), then (argv, env, cwd);
the answer is ("pid", pid) or ("fail", why); whenever an agent ends,
("exit", pid, returncode) (a signal as a negative number, as Popen says it).
This process ends when the launcher's end closes, and with the launcher
(processes.die_with). It never starts a thread: each agent forks its own
zygote (zygote.py), which is safe only from a single-threaded process.
"""

from __future__ import annotations

import gc
import os
import sys
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle
from typing import NoReturn, cast

from ..host import processes
from . import worker, zygote

AGENT_MODULE = "ddpkit.agent"
# What every agent imports before it forks its zygote: torchrun and the agent's own modules.
AGENT_IMPORTS = ("torch.distributed.run", "torch.distributed.elastic.agent.server.local_elastic_agent",
                 "ddpkit.agent.handler", "ddpkit.agent.orphaned", "ddpkit.agent.tailing", "ddpkit.agent.stopping",
                 "ddpkit.agent.exitbarrier",
                 "ddpkit.agent.sameerror", "ddpkit.rendezvous.handler", "ddpkit.records")
MAIN = f"{AGENT_MODULE}.__main__"


def main(argv: list[str]) -> None:
    from .__main__ import preload

    conn = Connection(int(argv[0]))
    processes.die_with(os.getppid())
    zygote.preload_modules((*AGENT_IMPORTS, *preload(os.environ)))
    worker.show_argv(["ddpkit.agent:", "fork", "server", "of", "launch", "local", str(os.getppid())])
    gc.collect()
    gc.freeze()  # the imports' objects stay out of the agents' collections: fewer pages copied
    serve(conn)


def serve(conn: Connection) -> None:
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for ready in wait([conn, *children]):
            if ready is conn:
                try:
                    output = recv_handle(conn)
                    argv, env, cwd = conn.recv()
                except (OSError, EOFError):
                    return  # the launcher ended
                _fork_agent(conn, output, (argv, env, cwd), children)
            else:
                zygote.reap(conn, cast(int, ready), children)


def _fork_agent(conn: Connection, output: int, request: tuple[list[str], dict[str, str], str],
                children: dict[int, int]) -> None:
    argv = request[0]
    if argv[1:3] != ["-m", AGENT_MODULE]:
        os.close(output)
        conn.send(("fail", f"not an agent's line: {argv[:3]}"))
        return
    pid = os.fork()
    if pid == 0:
        for fd in children:
            os.close(fd)
        conn.close()
        become_agent(output, *request)
    os.close(output)
    children[os.pidfd_open(pid)] = pid
    conn.send(("pid", pid))


def become_agent(output: int, argv: list[str], env: dict[str, str], cwd: str) -> NoReturn:
    """Turn this fresh fork into node's agent; never returns."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        worker.show_argv(argv)
        sys.modules.pop(MAIN, None)  # run afresh as `-m` runs it (this process imported it for its preload list)
        code = worker.run_program(argv[1:])
    except BaseException:  # what an interpreter prints for an error outside the agent's own handling
        worker.print_exception()
    worker.finish(code)


if __name__ == "__main__":
    main(sys.argv[1:])
