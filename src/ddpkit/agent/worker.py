"""A worker forked from the zygote (zygote.py) becoming what torchrun's
Popen would have started: its session, directory, stdio files and
environment, unbuffered stdio, its argv shown in ps, the preamble, then the
program run as `python -u ARGV` would run it, ending with the exit code an
interpreter would have ended with. `run_program` and `print_exception` also
serve `python -m ddpkit.run` and the agent's own error. A program's uncaught
error is noted for the agent first (sameerror.record: the same error after a
restart is a bug)."""

from __future__ import annotations

import atexit
import ctypes
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from .. import preamble
from ..host import processes
from ..records import tracebacks
from ..records.lines import RANK_TAG_CLOSE, RANK_TAG_OPEN
from ..shared import envnames
from . import nodelog, sameerror


@dataclass(frozen=True)
class WorkerRequest:
    """One worker to fork: `argv` after the interpreter and its -u, so
    ("-m", module, *args) or (script, *args)."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    stdout: str | None
    stderr: str | None


def become(request: WorkerRequest, zygote: int, blocked: tuple[signal.Signals, ...] = ()) -> None:
    """Turn this fresh fork of process `zygote`, with the signals `blocked`
    that the zygote blocks, into the worker `request` asks for; never returns."""
    code = 1
    try:
        os.setsid()
        processes.die_with(zygote)
        _signals_as_after_exec(request.env)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)  # one sent since the fork is taken now
        os.chdir(request.cwd)
        _redirect(1, request.stdout)
        _redirect(2, request.stderr)
        os.environ.clear()
        os.environ.update(request.env)
        _threads_from_env()
        _unbuffered_stdio()
        show_argv([sys.executable, "-u", *request.argv])
        preamble.install(request.argv)
        code = run_program(request.argv)
    except BaseException as exc:  # the program's own error: said as an interpreter would, exit 1
        sameerror.record(exc)
        print_exception()
    finish(code)


def _signals_as_after_exec(env: dict[str, str]) -> None:
    """The signal handlers torchrun's Popen worker starts with: the signals
    torchrun's agent handles (TORCHELASTIC_SIGNALS_TO_HANDLE) are back to
    their defaults after its exec, whatever the agent inherited (a shell's
    `&` or nohup ignores SIGINT, SIGQUIT, SIGHUP), and the interpreter then
    turns SIGINT into KeyboardInterrupt. The fork kept the agent's own."""
    names = env.get(envnames.TORCHELASTIC_SIGNALS_TO_HANDLE, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def show_argv(argv: list[str]) -> None:
    """Write `argv` over this process's argument area (/proc/PID/cmdline, what
    ps shows), cut to the area's size and padded with NULs; nothing where
    /proc cannot tell where the area is. The area is the agent's: no exec
    gave this process one of its own."""
    # /proc by hand, not psutil: psutil reads a process's command line but not
    # where its argument area lies (proc(5)'s arg_start and arg_end), and
    # writing over that area is what changes the line ps shows.
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: proc(5) fields 48 and 49
    except (OSError, ValueError, IndexError):
        return
    size = end - start
    if size <= 0:
        return
    text = b"\0".join(os.fsencode(arg) for arg in argv)[: size - 1]
    ctypes.memmove(start, text.ljust(size, b"\0"), size)


def print_exception(skipping: tuple[str, ...] = (__name__, "runpy")) -> None:
    """The exception being handled, as an interpreter prints it uncaught, from
    the first frame outside the modules `skipping` on (by default this module's
    and runpy's: the program's own frames). In a Slurm job, whose output people
    read with no launcher to fold it, the traceback goes to the node's log
    (nodelog.py) and the output gets one line: the exception, where it was
    raised and where its traceback is (`one_line`)."""
    kind, exc, tb = _trimmed(skipping)
    if exc is not None and nodelog.path() is not None:
        text = "".join(traceback.format_exception(kind, exc, tb))
        kept = nodelog.keep(text, f"{_who()}: its traceback")
        if kept is not None:
            print(one_line(text, exc, kept), file=sys.stderr, flush=True)
            return
    sys.excepthook(kind, exc, tb)  # type: ignore[arg-type]


def _who() -> str:
    rank = os.environ.get(envnames.RANK)
    return "the agent" if rank is None else f"rank {rank}"


def one_line(text: str, exc: BaseException, kept: Path) -> str:
    """A traceback said in one line, as a launcher's console says it: the
    exception, where it was raised (the innermost frame of the program's own
    code) and the file that holds the whole traceback; behind torch's rank
    tag (`[rank3]:`) in a worker."""
    lines = text.splitlines()
    exception = tracebacks.exception_line(lines) or \
        (traceback.format_exception_only(type(exc), exc) or [type(exc).__name__])[0].strip()
    if len(exception) > tracebacks.SHOWN_CHARS:
        exception = exception[:tracebacks.SHOWN_CHARS] + "..."
    at = tracebacks.raised_at(lines[:-1])
    rank = os.environ.get(envnames.RANK)
    tag = "" if rank is None else f"{RANK_TAG_OPEN}{rank}{RANK_TAG_CLOSE}"
    return f"{tag}{exception}{'' if at is None else f', raised at {at}'}  (its traceback: {kept})"


def exception_text(skipping: tuple[str, ...]) -> str:
    """What print_exception would print with the interpreter's own hook, as text."""
    kind, exc, tb = _trimmed(skipping)
    return "".join(traceback.format_exception(kind, exc, tb))


def _trimmed(skipping: tuple[str, ...]) -> tuple[Any, BaseException | None, TracebackType | None]:
    kind, exc, tb = sys.exc_info()
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in skipping:
        tb = tb.tb_next
    if exc is not None:
        exc.__traceback__ = tb  # the hook prints the exception's own traceback, not its argument
    return kind, exc, tb


def _threads_from_env() -> None:
    """torch's intra-op thread count was fixed in the zygote, from the agent's
    environment before torchrun set OMP_NUM_THREADS=1 for several workers; a
    new interpreter would take it from the worker's own, so this one does."""
    torch = sys.modules.get("torch")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(name, "")
        if torch is not None and value.isdigit() and int(value) > 0:
            torch.set_num_threads(int(value))
            return


def _redirect(fd: int, path: str | None) -> None:
    if path is not None:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _unbuffered_stdio() -> None:
    """What `python -u` gives: no buffer between print and the file."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                  write_through=True)
        setattr(sys, name, stream)


def run_as_main(argv: Sequence[str]) -> int:
    """run_program, with the program's uncaught error said as an interpreter
    says it (its traceback from its own frames on) and exit code 1."""
    try:
        return run_program(argv)
    except BaseException as exc:
        sameerror.record(exc)
        print_exception()
        return 1


def run_program(argv: Sequence[str]) -> int:
    """Run the program as `python -u ARGV` would; its exit code."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # __file__ absolute, as `python SCRIPT` makes it
    except SystemExit as exc:
        return exit_status(exc)
    except KeyboardInterrupt:
        print_exception()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # ended by the signal, as an interpreter is
    return 0


def exit_status(exc: SystemExit) -> int:
    """The status `python` exits with on `exc`: None is 0, a number its low
    byte, anything else printed and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def finish(code: int) -> NoReturn:
    """An interpreter's exit: wait for non-daemon threads, run atexit, flush."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
