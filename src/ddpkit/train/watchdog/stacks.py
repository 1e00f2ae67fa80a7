"""A rank's stacks when its job stalled: the main thread's frame (what the
report names), faulthandler's and py-spy's dumps of every thread (stderr and
the log directory), and the NCCL flight recorder's buffer."""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import subprocess
import sys
import traceback
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ...shared import envnames
from .stall_report import STACKS_FOLDER, Ack

PYSPY_TIMEOUT_S = 10.0  # under load a native dump takes seconds; the job must still stop within a minute


def main_frame() -> tuple[str, bool]:
    """The main thread's innermost frame ("file:line in function"), and
    whether it is inside torch; when it is, the innermost frame outside torch
    is added, since that is the line of the training code that called in."""
    import threading as _threading

    frame = sys._current_frames().get(_threading.main_thread().ident or -1)
    if frame is None:
        return "unknown (no main thread)", False
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    torch_dir = torch_folder()
    in_torch = inner.filename.startswith(torch_dir)
    text = f"{inner.filename}:{inner.lineno} in {inner.name}"
    if in_torch:
        outside = [f for f in stack if not f.filename.startswith(torch_dir)]
        if outside:
            text += f" (called from {outside[-1].filename}:{outside[-1].lineno} in {outside[-1].name})"
    return text, in_torch


def torch_folder() -> str:
    """Where torch's Python files are (a file under it is torch's code)."""
    mod = sys.modules.get("torch")
    # Without torch imported no frame can be in it: a prefix no path has.
    return str(Path(mod.__file__).parent) if mod is not None and mod.__file__ else "\0"


def dump_stacks(rank: int, header: str, log_dir: Path | None, nccl: bool) -> Ack:
    """This rank's stacks into its file (the console keeps the verdict and
    where the files are); on stderr only where there is no folder for them
    (`stack_folder`) or the file cannot be written."""
    frame, in_torch = main_frame()
    text = pyspy(os.getpid())
    folder = stack_folder(log_dir)
    if folder is not None:
        path = folder / f"stall-rank{rank}.txt"
        try:
            write_stacks(path, header + "\n", text)
        except OSError as exc:
            print(f"ddpkit watchdog: rank {rank}: cannot write {path} ({exc}); its stacks follow",
                  file=sys.stderr, flush=True)
        else:
            if nccl:
                dump_nccl(folder / f"nccl-trace-rank{rank}.pkl")
            return Ack(frame, in_torch, str(path))
    print(f"ddpkit watchdog: {header}: the job stalled; stacks of all threads follow", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    if text:
        print(text, file=sys.stderr, flush=True)
    return Ack(frame, in_torch, None)


def stack_folder(log_dir: Path | None, env: Mapping[str, str] = os.environ) -> Path | None:
    """Where a stall's stack files go: the log directory the program was
    given, else the folder of this node's logs that the launcher gave
    torchrun (launch local: the run folder's logs/node<N>, beside the ranks'
    stdout and stderr); None where there is none (torchrun's own temporary
    folder is one nobody would look in). Where the launcher keeps no
    folder on the rank's host (launch ssh, Slurm: the node's output reaches
    the launcher or the job's output file as a stream), the job's working
    folder on that host: `ddpkit-stacks/<run id>/node<N>/`; None for a
    process no torchrun started (no run id, no node)."""
    if log_dir is not None:
        return log_dir
    error_file = env.get(envnames.TORCHELASTIC_ERROR_FILE)
    if error_file:
        # torchrun's layout: <its --log-dir>/<run>_<random>/attempt_<K>/<local rank>/error.json
        parents = Path(error_file).parents
        if len(parents) >= 5 and parents[1].name.startswith("attempt_") \
                and not parents[3].name.startswith("torchelastic_"):
            return parents[3]
    run, node = env.get(envnames.TORCHELASTIC_RUN_ID), env.get(envnames.GROUP_RANK)
    if not run or not node:
        return None
    return Path.cwd() / STACKS_FOLDER / re.sub(r"[^A-Za-z0-9_.-]", "_", run) / f"node{node}"


def pyspy_path() -> str | None:
    """py-spy on PATH, or beside this interpreter (a virtual environment not on PATH)."""
    found = shutil.which("py-spy")
    beside = Path(sys.executable).parent / "py-spy"
    return found or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)


def pyspy(pid: int) -> str:
    tool = pyspy_path()
    if tool is None:
        return ""
    try:
        done = subprocess.run([tool, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PYSPY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy dump --native failed: {exc}"
    if done.returncode != 0:
        return f"py-spy dump --native failed (exit {done.returncode}): {done.stderr.strip()[-300:]}"
    return "py-spy dump --native:\n" + done.stdout


def write_stacks(path: Path, header: str, pyspy_text: str) -> None:
    """faulthandler's dump and py-spy's into one file, written whole (a
    temporary file, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(header)
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
        out.write("\n" + pyspy_text)
    os.replace(tmp, path)


def dump_nccl(path: Path) -> None:
    """The NCCL flight recorder's ring buffer (TORCH_NCCL_TRACE_BUFFER_SIZE),
    pickled as torch's fr_trace tool reads it."""
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]  # not in the stubs

        data = _dump_nccl_trace()
    except Exception as exc:  # no NCCL group, or a build without the recorder
        print(f"ddpkit watchdog: no NCCL flight recorder dump: {exc}", file=sys.stderr)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def nccl_recorder_file(log_dir: Path | None, env: MutableMapping[str, str] = os.environ) -> None:
    """Point the flight recorder's on-timeout dump at the job's log directory
    (unless the user chose a place); read when the NCCL group is created."""
    if log_dir is not None:
        env.setdefault(envnames.TORCH_FR_DUMP_TEMP_FILE, str(log_dir / "nccl-trace-rank"))
