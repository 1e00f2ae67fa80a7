"""A detached `launch ssh` run, reached from the machine that started it.

The run lives on its first host (detached.py): its supervisor, its run
folder, the nodes' logs. The machine that started it keeps a handle, a run
folder whose run.json names where the run lives (runs.RemoteRun). Why a
handle and SSH rather than a copy kept up to date: nothing runs here once
the launch returned (this machine may be a laptop that sleeps, or gone), so
nothing could keep a copy current; and the host the job runs on is one
this machine reached with these very settings a moment before. So `ddpkit
status`, `logs` and `cancel` of a handle run the same command on the first
host, in its runs folder there, over one SSH connection made as the launch
made it, and print what it prints, with its exit code: the run folder
there is the one truth. Afterwards the run folder's records are copied back
into the handle (run.json's state, end and summary; events, metrics, the
console), so that `ddpkit runs` here shows the last state seen and
`ddpkit report` draws the page here (`report` only copies, then runs here:
matplotlib is needed where the page is wanted, not on the nodes). Where
the first host cannot be reached, `status` and `report` say so and answer
from what was last copied; `logs` and `cancel` exit 3.
"""

from __future__ import annotations

import argparse
import io
import shlex
import sys
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import paramiko

from ...runs import RemoteRun, RunFolder, RunRecord, StoredRun
from ...shared.exitcodes import ExitCode
from .connect import SSH_ERRORS, ConnectError, Endpoint, SshSettings, close, connect

# The run commands that reach a handle's run there; `report` copies the files back and runs here.
FORWARDED = ("status", "logs", "cancel")
COPIED = ("events.jsonl", "metrics.jsonl", "console.log")


def remote_words(args: argparse.Namespace, run_id: str) -> list[str]:
    """The command as it runs there, for the run's id (a job name could name another run there)."""
    words = [args.command, run_id]
    if args.command == "logs":
        for flag, value in (("--node", args.node), ("--rank", args.rank), ("--tail", args.tail)):
            if value is not None:
                words += [flag, str(value)]
        if args.follow:
            words.append("--follow")
    return words


def forwarded(args: argparse.Namespace, run: StoredRun) -> int | None:
    """`status`, `logs`, `cancel` of a handle (`run`, whose record names
    where it lives): run there, its exit code; `report`: the files copied
    back, then None (it runs here)."""
    remote = run.record.remote
    assert remote is not None
    who = f"ddpkit {args.command}"
    try:
        client = connect(_endpoint(remote), _settings(remote))
    except ConnectError as exc:
        local = args.command in ("status", "report")  # what was last copied here still answers these
        print(f"{who}: run {run.record.id} lives on {remote.alias} (its folder there: {remote.folder}), which "
              f"cannot be reached: {exc}" + ("; as last seen from here:" if local else ""), file=sys.stderr,
              flush=True)
        return None if local else ExitCode.PREFLIGHT
    try:
        code = None
        if args.command in FORWARDED:
            code = _run_there(client, remote, remote_words(args, run.record.id))
        copy_back(client, remote, run.folder)
        return code
    except SSH_ERRORS as exc:
        print(f"{who}: the connection to {remote.alias} broke: {str(exc) or type(exc).__name__}",
              file=sys.stderr, flush=True)
        return ExitCode.FAILED if args.command != "report" else None
    finally:
        close(client)


def _endpoint(remote: RemoteRun) -> Endpoint:
    return Endpoint(remote.alias, remote.hostname, remote.port, remote.user, tuple(remote.identity_files))


def _settings(remote: RemoteRun) -> SshSettings:
    return SshSettings(config_path=None if remote.ssh_config is None else Path(remote.ssh_config),
                       known_hosts=None if remote.known_hosts is None else Path(remote.known_hosts))


def _command(remote: RemoteRun, words: list[str]) -> str:
    ddpkit = shlex.join([remote.python, "-m", "ddpkit.cli", *words])
    return f"cd / && DDPKIT_RUNS_DIR={shlex.quote(remote.runs_dir)} exec {ddpkit}"


def _run_there(client: paramiko.SSHClient, remote: RemoteRun, words: list[str]) -> int:
    """The command there, its stdout and stderr copied here as they come."""
    transport = client.get_transport()
    if transport is None:
        raise paramiko.SSHException("not connected")
    channel = transport.open_session()
    channel.exec_command(_command(remote, words))
    channel.shutdown_write()

    def copy(read: Callable[[int], bytes], out: BinaryIO) -> None:
        for chunk in iter(lambda: read(65536), b""):
            out.write(chunk)
            out.flush()

    errors = threading.Thread(target=copy, args=(channel.recv_stderr, sys.stderr.buffer), daemon=True)
    errors.start()
    try:
        copy(channel.recv, sys.stdout.buffer)
    except KeyboardInterrupt:  # Ctrl-C here stops the command here, not the run there
        channel.close()
        return ExitCode.INTERRUPTED
    errors.join(timeout=5)
    return channel.recv_exit_status()


def _files(client: paramiko.SSHClient, folder: str, names: tuple[str, ...]) -> dict[str, bytes]:
    """The files of `names` that exist in `folder` there, in one exec (tar keeps each file whole as it
    read it, one that grows meanwhile too)."""
    transport = client.get_transport()
    if transport is None:
        raise paramiko.SSHException("not connected")
    channel = transport.open_session()
    channel.exec_command(f"cd -- {shlex.quote(folder)} && tar cf - --ignore-failed-read {shlex.join(names)} "
                         "2>/dev/null")
    channel.shutdown_write()
    data = b"".join(iter(lambda: channel.recv(1 << 20), b""))
    channel.recv_exit_status()
    found = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                read = tar.extractfile(member) if member.isfile() and member.name in names else None
                if read is not None:
                    found[member.name] = read.read()
    except tarfile.TarError:
        pass  # nothing there (yet)
    return found


def copy_back(client: paramiko.SSHClient, remote: RemoteRun, handle: RunFolder) -> None:
    """The run folder's records there into the handle here: the record's
    state, end, summary and logs (its own remote kept), and the files
    `report` and `runs` read."""
    found = _files(client, remote.folder, ("run.json", *COPIED))
    if "run.json" not in found:
        return
    there = RunRecord.model_validate_json(found.pop("run.json"))
    for name, data in found.items():
        tmp = handle.path / f".{name}.copy"
        tmp.write_bytes(data)
        tmp.replace(handle.path / name)
    handle.update(state=there.state, exit_code=there.exit_code, ended=there.ended, summary=there.summary,
                  logs=there.logs, launcher=there.launcher)
