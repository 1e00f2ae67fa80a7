"""Is this the same error again? A bug in the program, told from a fault of the machine.

A worker that ends on an exception of its own writes what it was (`Failure`:
the exception's type, its message with numbers and addresses taken out, and
the innermost frame of the program's own code, file and line) to the file
the agent named for it (`record`, called by agent/worker.py where the
program's uncaught error ends it). The agent reads it back when torchrun
finds the worker failed (`read`) and keeps, per worker-group start, what
failed (`Memory`). A failure whose `Failure` is one of those of the start
just before, with the same world, is the same error twice: a bug, which no
restart will get past. The agent then stops restarting (agent/handler.py,
agent/__main__.py) and ends with ExitCode.SAME_ERROR.

What is never a bug here: a worker that wrote nothing (killed by a signal,
the kernel's out-of-memory kill, `os._exit`), an exception that says the
machine or the network failed (`is_fault`: a gloo or NCCL connection closed
or reset, a timeout, out of memory, a store gone), and a failure in a start
whose world differs from the last one's (a node was lost or came back
between): those restart as torchrun would. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TextIO

from .. import records
from ..shared import envnames
from ..shared.exitcodes import ExitCode

FILE_NAME = "ddpkit-failure.json"  # beside torchrun's error file for the worker, where it has one
MESSAGE_CHARS = 300  # of the normalised message, compared and shown
NUMBERS = re.compile(r"0[xX][0-9a-fA-F]+|\d+")  # an address, or a run of digits

# Exception classes (any class in its MRO, by name) that say the machine or the network failed.
FAULT_TYPES = frozenset({"DistNetworkError", "DistStoreError", "DistBackendError", "OutOfMemoryError",
                         "MemoryError", "ConnectionError", "TimeoutError", "KeyboardInterrupt", "SystemExit",
                         "RendezvousError", "SignalException"})
# Words in a message that say so, whatever its class (torch raises most as RuntimeError).
FAULT_WORDS = ("connection reset", "connection closed", "connection refused", "connection aborted", "broken pipe",
               "by peer", "timed out", "timeout", "out of memory", "nccl", "gloo", "remote process",
               "no route to host", "network is unreachable", "socket", "ecc error", "uncorrectable",
               "unspecified launch failure", "fell off the bus", "tcpstore", "input/output error",
               "stale file handle")
# The frames of what runs the program, not the program: ddpkit's agent, preamble and runner.
RUNNER_MODULES = ("ddpkit.agent", "ddpkit.preamble", "ddpkit.run", "ddpkit.watchdog", "ddpkit.frameworks", "runpy")
PROGRAM_MODULE = "ddpkit.train"  # `ddpkit train`'s own code is the program's


@dataclass(frozen=True)
class Failure:
    """A worker's uncaught exception, as compared: `kind` (its class's
    qualified name), `message` (normalised), `file` and `line` (the innermost
    frame of the program's own code), and `fault` (it says the machine failed)."""

    kind: str
    message: str
    file: str
    line: int
    fault: bool = False

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.kind, self.message, self.file, self.line)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def text(self) -> str:
        """One line: `ValueError: bad batch at step #`."""
        name = self.kind.rsplit(".", 1)[-1]
        return f"{name}: {self.message}" if self.message else name


def normalise(message: str) -> str:
    """The message without what changes from one start to the next: hex
    addresses, then every run of digits (pids, ports, steps, sizes), as `#`;
    runs of whitespace as one space."""
    text = NUMBERS.sub(lambda m: "0x#" if m.group(0).startswith(("0x", "0X")) else "#", message)
    return " ".join(text.split())[:MESSAGE_CHARS]


def is_fault(class_names: Iterable[str], message: str) -> bool:
    """Whether an exception (the names of its class and its bases, and its
    message) says the machine or the network failed, not the program."""
    if FAULT_TYPES & set(class_names):
        return True
    low = message.lower()
    return any(word in low for word in FAULT_WORDS)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(name, "") for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.join(d, "") for d in dirs if d))


def is_program_frame(filename: str, module: str | None, libraries: tuple[str, ...]) -> bool:
    """A frame of the program's own code: not the standard library, not an
    installed package (torch, ...), not what runs the program (RUNNER_MODULES).
    ddpkit's trainer is `ddpkit train`'s program."""
    if module is not None and any(module == m or module.startswith(m + ".") for m in RUNNER_MODULES):
        return False
    if module is not None and (module == PROGRAM_MODULE or module.startswith(PROGRAM_MODULE + ".")):
        return True  # wherever ddpkit is installed
    if filename.startswith("<"):
        return False  # <frozen ...>, <string>
    return not filename.startswith(libraries)


def shown_path(filename: str, cwd: str) -> str:
    """The file as a person finds it: relative to the working folder when
    under it, else as the traceback says it."""
    try:
        relative = os.path.relpath(filename, cwd)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


def innermost(tb: TracebackType | None, libraries: tuple[str, ...] | None = None) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of the program's own code in `tb`,
    else of its innermost frame; None without one."""
    libraries = _library_dirs() if libraries is None else libraries
    found: tuple[str, int] | None = None
    last: tuple[str, int] | None = None
    while tb is not None:
        code = tb.tb_frame.f_code
        last = (code.co_filename, tb.tb_lineno)
        if is_program_frame(code.co_filename, tb.tb_frame.f_globals.get("__name__"), libraries):
            found = last
        tb = tb.tb_next
    return found or last


def of_exception(exc: BaseException, cwd: str | None = None) -> Failure | None:
    """The Failure an uncaught exception stands for; None without a frame."""
    frame = innermost(exc.__traceback__)
    if frame is None:
        return None
    kind = type(exc)
    names = [cls.__name__ for cls in kind.__mro__]
    message = str(exc)
    cause = exc.__cause__ or exc.__context__
    fault = is_fault(names, message) or (cause is not None and is_fault(
        [cls.__name__ for cls in type(cause).__mro__], str(cause)))
    qualified = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else \
        f"{kind.__module__}.{kind.__qualname__}"
    return Failure(kind=qualified, message=normalise(message), file=shown_path(frame[0], cwd or os.getcwd()),
                   line=frame[1], fault=fault)


def file_for(worker_env: Mapping[str, str]) -> str | None:
    """Where a worker writes its Failure: beside torchrun's error file for it
    (a folder per start and local rank), None where torchrun names none."""
    error_file = worker_env.get(envnames.TORCHELASTIC_ERROR_FILE)
    return os.path.join(os.path.dirname(error_file), FILE_NAME) if error_file else None


def record(exc: BaseException) -> None:
    """Write the Failure `exc` stands for where the agent asked
    (DDPKIT_FAILURE_FILE); nothing where it did not, nor when writing fails:
    the program's own error must still be said and its exit code kept."""
    path = os.environ.get(envnames.DDPKIT_FAILURE_FILE)
    if not path:
        return
    try:
        failure = of_exception(exc)
        if failure is not None:
            Path(path).write_text(json.dumps(asdict(failure)))
    except Exception as error:
        print(f"ddpkit: could not note the error for the agent: {error}", file=sys.stderr)


def read(path: str | None) -> Failure | None:
    """The Failure a worker wrote at `path`; None where it wrote none (or not one this reads)."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
        return Failure(kind=str(data["kind"]), message=str(data["message"]), file=str(data["file"]),
                       line=int(data["line"]), fault=bool(data.get("fault", False)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Repeated:
    """The same error twice: `failure` in rank `rank`, in the start after one
    where it failed so too (`restart`: torchrun's restart count of the second)."""

    failure: Failure
    rank: int | None
    restart: int

    @property
    def record(self) -> records.SameError:
        """What the agent tells its launcher (the record's `verdict` is the closing words)."""
        return records.SameError(rank=self.rank, file=self.failure.file, line=self.failure.line,
                                 exception=self.failure.text, restart=self.restart)


class Memory:
    """What failed in this agent's workers, per worker-group start (see the
    module's doc). `started` is called at each start with its world size;
    `failed` with each failed worker's Failure (None: it wrote none) and
    returns a Repeated when it is the same error as in the start just before
    (the first time only; `repeated` keeps it)."""

    def __init__(self) -> None:
        self._start = 0  # this start's number
        self._world: dict[int, str] = {}  # start -> its world ("WORLD_SIZE/GROUP_WORLD_SIZE")
        self._bugs: dict[int, set[tuple[str, str, str, int]]] = {}  # start -> the bug-like failures seen in it
        self.repeated: Repeated | None = None

    def started(self, world: str) -> None:
        """A new worker group starts (its local rank 0), with `world`."""
        self._start += 1
        self._world[self._start] = world
        for old in [n for n in self._bugs if n < self._start - 1]:
            del self._bugs[old]

    def failed(self, failure: Failure | None, rank: int | None, restart: int) -> Repeated | None:
        if failure is None or failure.fault or self._start == 0:
            return None
        before = self._start - 1
        if failure.key in self._bugs.get(before, set()) and self._world.get(before) == self._world[self._start]:
            if self.repeated is not None:
                return None  # said once
            self.repeated = Repeated(failure, rank, restart)
            return self.repeated
        self._bugs.setdefault(self._start, set()).add(failure.key)
        return None


def announce(repeated: Repeated, stream: TextIO | None = None) -> None:
    """Tell the launcher (the record) and people (one line) at once, as the
    worker's failure is found: before torchrun closes the rendezvous, which
    ends the other nodes' agents too."""
    out = sys.stderr if stream is None else stream
    record = repeated.record
    records.emit(record, out)
    print(f"ddpkit.agent: {record.verdict} ({record.exception}, again in restart {record.restart}); not restarting "
          f"(exit {int(ExitCode.SAME_ERROR)})", file=out, flush=True)


class SameErrorTwice(Exception):
    """Raised where torchrun would restart the workers after the same error twice."""

    def __init__(self, repeated: Repeated) -> None:
        super().__init__(repeated.record.verdict)
        self.repeated = repeated
