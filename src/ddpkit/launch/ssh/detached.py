"""`ddpkit launch ssh --detach`: the job's supervision on its own first host.

The launching machine (a laptop, a login node) may go away for good; the
job must not go with it. So the run's supervisor, the same `launch ssh`
that an attached launch runs here, runs on node 0's host instead, in a
session of its own there (setsid; inside `systemd-run --user --scope` where
the host's user manager answers, so that a logind which kills a user's
processes at logout spares it), and supervises every node over SSH from
there, as it would from here: fail fast, a lost node, elastic rejoins, the
summary, the run's end in its run folder.

Here (`detach_over_ssh`): one connection to the first host checks what a
detached run needs there (`detach_checks`: the interpreter, ddpkit and
paramiko importable by it, a runs folder it can write, setsid), each
problem one line, exit 3 (ExitCode.PREFLIGHT), nothing started. Then the
supervisor is started there; the job's spec, its hosts (as this machine
resolved them), the secrets' values and the run's id go on its stdin, never
on a command line or into a file. It makes the run's folder there (the same
id and name as the handle kept here), its console the folder's console.log,
runs its preflight against every host from there, and says it is ready on
the session's stdout only once every host passed it and its stop signals
are held (prelude.hold_stop_signals): this command returns then, with the
run's name. A supervisor whose preflight refused the job ends instead: its
console (the problem table) is shown here, with its exit code.

There (`take_over`): the supervisor's first steps, before launch ssh's own.

The run folder here is a handle (runs.RemoteRun): `ddpkit status`, `logs`,
`cancel` and `report` reach the run folder there over SSH (remote.py).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko

from ...runs import Launcher, RemoteRun, RunFolder, RunTarget
from ...shared.exitcodes import ExitCode
from ..prelude import READY, READY_FLAG, SUPERVISE_FLAG, supervised_run
from .connect import SSH_ERRORS, ConnectError, Endpoint, SshSettings, close, connect
from .hostfile import HostEntry

HOSTFILE = "hostfile"  # in the run folder there: the hosts as this machine resolved them
SETSID = ["setsid", "--fork"]  # a session of its own, in a process the command's shell does not wait for
START_WAIT_S = 600.0  # the supervisor's preflight there has this long to say it is ready
PAYLOAD_KEYS = ("id", "name", "nodes", "nproc_per_node", "stop_grace_s", "spec", "hosts", "secrets", "log_dir_set")


@dataclass(frozen=True)
class FirstHost:
    """What the checks found on the first host."""

    runs_dir: str  # the runs root there, absolute
    hostname: str
    keeper: list[str]  # what starts the supervisor in a session of its own: setsid, maybe inside systemd-run
    problems: list[str]


def detach_checks(python: str, runs_dir: str | None) -> str:
    """The first host's checks, one `word value` line each. `runs_dir` None:
    DDPKIT_RUNS_DIR there, else ~/.ddpkit/runs there."""
    root = shlex.quote(runs_dir) if runs_dir else '"${DDPKIT_RUNS_DIR:-$HOME/.ddpkit/runs}"'
    py = shlex.quote(python)
    return "\n".join([
        f"root={root}",
        '{ read -r h < /proc/sys/kernel/hostname && echo "hostname $h"; } 2>/dev/null || echo "hostname $(hostname)"',
        'if mkdir -p -- "$root" 2>/dev/null && cd -- "$root" && [ -w . ]; then echo "folder $(pwd -P)"; '
        'else echo "folder unwritable $root"; fi',
        f"if command -v {py} >/dev/null 2>&1; then echo 'python ok'; else echo 'python missing'; fi",
        f"{py} -c 'import ddpkit, paramiko' >/dev/null 2>&1 && echo 'ddpkit ok' || echo 'ddpkit missing'",
        "setsid --fork true >/dev/null 2>&1 && echo 'setsid ok' || echo 'setsid missing'",
        "systemd-run --user --scope --quiet true >/dev/null 2>&1 && echo 'systemd ok' || echo 'systemd no'",
    ]) + "\n"


def judge_first_host(said: str, python: str, runs_dir: str | None) -> FirstHost:
    facts = dict(line.split(" ", 1) for line in said.splitlines() if " " in line)
    problems = []
    folder = facts.get("folder", "unwritable")
    if folder.startswith("unwritable"):
        where = folder.removeprefix("unwritable").strip() or runs_dir or "~/.ddpkit/runs"
        problems.append(f"runs folder {where} cannot be made or written there; give one it can with "
                        "--detach-runs-dir DIR")
    if facts.get("python") != "ok":
        problems.append(f"{python!r} not found there; install it or set command.python")
    elif facts.get("ddpkit") != "ok":
        problems.append(f"{python} cannot import ddpkit and paramiko there; the detached supervisor runs ddpkit "
                        "on the first host: pip install ddpkit there")
    if facts.get("setsid") != "ok":
        problems.append("no setsid --fork there (util-linux 2.31 or newer): nothing would keep the supervisor "
                        "running once this session closes; install util-linux, or launch without --detach")
    keeper = list(SETSID)
    if facts.get("systemd") == "ok":
        keeper = ["systemd-run", "--user", "--scope", "--quiet", "--", *SETSID]
    return FirstHost(folder if not problems else "", facts.get("hostname", ""), keeper, problems)


def supervisor_command(python: str, keeper: list[str], folder: str, options: list[str]) -> str:
    """The supervisor's start there: a session of its own, its ready word on
    the session's stdout (fd 1, which it keeps until then). Its payload comes
    through `cat`: setsid's first process exits at once (--fork), and sshd
    passes no more of the session's stdin on once the command's shell has
    exited; the shell waits for `cat`, which reads stdin to its end, so the
    session lasts until the whole payload is in the pipe the supervisor
    reads, and no longer: the supervisor's run is not the session's."""
    argv = [*keeper, python, "-m", "ddpkit.cli", "launch", "ssh", "-f", f"{folder}/spec.yaml",
            "--hostfile", f"{folder}/{HOSTFILE}", SUPERVISE_FLAG, folder, READY_FLAG, "1", *options]
    return f"cd / && cat | {shlex.join(argv)}"


def host_line(ep: Endpoint) -> str:
    """The host as this machine reached it, for the supervisor there."""
    return str(HostEntry(host=ep.hostname, user=ep.user, port=ep.port))


def _exec(client: paramiko.SSHClient, command: str, stdin: bytes = b"", timeout: float = 60.0) -> tuple[int, str]:
    """Run `command` there; its exit status and output (stderr with it)."""
    transport = client.get_transport()
    if transport is None:
        raise paramiko.SSHException("not connected")
    channel = transport.open_session(timeout=timeout)
    channel.set_combine_stderr(True)
    channel.settimeout(timeout)
    channel.exec_command(f"sh -c {shlex.quote(command)}")
    if stdin:
        channel.sendall(stdin)
    channel.shutdown_write()
    out = b"".join(iter(lambda: channel.recv(65536), b""))
    return channel.recv_exit_status(), out.decode("utf-8", "replace")


def _refuse(who: str, run: RunFolder, host: str, problems: list[str]) -> int:
    for problem in problems:
        print(f"{who}: --detach: node 0 ({host}): {problem}", file=sys.stderr, flush=True)
    run.event("preflight", f"--detach: {len(problems)} problem(s) on the first host; nothing was started")
    run.finish(ExitCode.PREFLIGHT)
    return ExitCode.PREFLIGHT


def detach_over_ssh(who: str, run: RunFolder, ep: Endpoint, settings: SshSettings, python: str,
                    runs_dir: str | None, payload: dict[str, Any], options: list[str]) -> int:
    """Check the first host, start the run's supervisor there and wait until
    it is ready; `run` is the handle kept here. `payload`: PAYLOAD_KEYS but
    id, name, hosts (take_over reads it)."""
    try:
        client = connect(ep, settings)
    except ConnectError as exc:
        return _refuse(who, run, str(ep), [str(exc)])
    try:
        _, said = _exec(client, detach_checks(python, runs_dir), timeout=settings.timeout_s + 60)
        first = judge_first_host(said, python, runs_dir)
        if first.problems:
            return _refuse(who, run, str(ep), first.problems)
        rec = run.record()
        folder = f"{first.runs_dir}/{rec.folder_name}"
        data = json.dumps({**payload, "id": rec.id, "name": rec.name}).encode()
        began = time.monotonic()
        _, out = _exec(client, supervisor_command(python, first.keeper, folder, options), data, START_WAIT_S)
        words = out.split()
        if READY not in words:  # it ended before it was ready: show why
            return _ended(who, run, client, folder, out)
        pid = int(words[words.index(READY) + 1])
        remote = RemoteRun(alias=ep.alias, hostname=ep.hostname, port=ep.port, user=ep.user,
                           identity_files=[*([str(settings.identity)] if settings.identity else []),
                                           *ep.identity_files],
                           ssh_config=_path(settings.config_path), known_hosts=_path(settings.known_hosts),
                           python=python, runs_dir=first.runs_dir, folder=folder)
        run.update(remote=remote, detached=True, launcher=Launcher(pid=pid, host=first.hostname))
    except SSH_ERRORS as exc:
        return _refuse(who, run, str(ep), [f"connection failed while starting the supervisor there: "
                                           f"{str(exc) or type(exc).__name__}"])
    finally:
        close(client)
    run.event("detached", f"supervised by pid {pid} on {ep.alias} ({first.hostname}), in a session of its own "
                          f"there; its folder there: {folder}")
    print(f"{who}: run {rec.folder_name} detached: supervised by pid {pid} on {ep.alias}, the job's first host, "
          f"which outlives this terminal and this machine; every host passed its preflight from there in "
          f"{time.monotonic() - began:.1f}s; its console: {ep.alias}:{folder}/console.log", flush=True)
    print(f"{who}: follow it from here with `ddpkit logs {rec.id} --follow`; `ddpkit status {rec.id}`, "
          f"`ddpkit cancel {rec.id}`, `ddpkit report {rec.id}` (over ssh to {ep.alias})", flush=True)
    return ExitCode.OK


def _path(path: Path | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def _ended(who: str, run: RunFolder, client: paramiko.SSHClient, folder: str, said: str) -> int:
    """The supervisor ended before it was ready: its console and exit code,
    as the run folder there recorded them."""
    _, console = _exec(client, f"cat -- {shlex.quote(folder)}/console.log 2>/dev/null")
    _, record = _exec(client, f"cat -- {shlex.quote(folder)}/run.json 2>/dev/null")
    sys.stderr.write(said + console)
    try:
        code = json.loads(record).get("exit_code")
    except ValueError:
        code = None
    code = ExitCode.FAILED if code is None else int(code)
    print(f"{who}: --detach: the run's supervisor on node 0 ended before it started the job (exit code {code}); "
          f"its folder there: {folder}", file=sys.stderr, flush=True)
    run.event("preflight", f"--detach: the supervisor on the first host ended before the job started (exit {code})")
    run.finish(code)
    return code


# ---- there: the supervisor's first steps ---------------------------------------------------


def take_over(args: Any) -> tuple[RunFolder, dict[str, Any]]:
    """On the first host, before launch ssh's own steps: the payload from
    stdin (the secrets' values go into this process's environment, where
    the prelude reads them), the run folder made with the handle's id, the
    hosts' file, the console (stdout and stderr into console.log; the ready
    descriptor kept apart), stdin from /dev/null."""
    payload = json.loads(sys.stdin.buffer.read() or b"{}")
    missing = [key for key in PAYLOAD_KEYS if key not in payload]
    if missing:
        raise SystemExit(f"launch ssh: {SUPERVISE_FLAG} is started by `launch ssh --detach` only (no {missing})")
    os.environ.update(payload["secrets"])
    wanted = supervised_run(args)
    assert wanted is not None
    run = RunFolder.create(name=payload["name"], target=RunTarget.SSH, nodes=payload["nodes"],
                           nproc_per_node=payload["nproc_per_node"], spec_yaml=payload["spec"],
                           stop_grace_s=payload["stop_grace_s"], root=wanted.path.parent, run_id=payload["id"])
    (run.path / HOSTFILE).write_text("".join(f"{line}\n" for line in payload["hosts"]))
    if args.ready_fd is not None:
        args.ready_fd = os.dup(args.ready_fd)  # the session's stdout, until the supervisor is ready
    console = os.open(run.console_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, to in ((null, 0), (console, 1), (console, 2)):
        os.dup2(fd, to)
    os.close(console)
    os.close(null)
    run.hand_over(os.getpid(), detached=True)
    return run, payload
