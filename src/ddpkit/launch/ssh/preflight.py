"""Preflight: every host checked in parallel before anything starts.

One remote command per host both checks and starts it: it prints the facts
(workdir, interpreter, torch version, interfaces, listening ports, hostname),
then waits on stdin for the launcher's verdict and `exec`s the node command
on "go", or exits on anything else, EOF included. The facts are judged here,
so the remote side needs nothing but a POSIX shell; all problems are shown in
one table and nothing starts unless there are none. Starting is then a write
on an open channel: no second session, no second login shell per host (a
login shell sources the user's rc files, which on real clusters often costs
more than the job's own start).

An elastic job's nodes also try the launcher's own address (StoreProbe):
whether every node reaches it decides where the rendezvous store lives, so
the verdict names the start each host runs (`go`: the env prefix as for
node 0 hosting the store; GO_LAUNCHER_STORE: the launcher's address).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko

from ...spec import JobSpec
from .connect import SSH_ERRORS, ConnectError, Endpoint, SshSettings, close, connect

MARK = "@@ddpkit:"
READY = f"{MARK}ready"
GO = "go"  # the verdict that starts a host; anything else, EOF too, ends it
GO_LAUNCHER_STORE = "go-launcher-store"  # start it with the launcher's store in the rendezvous endpoint
STORE_CHECK_S = 3  # how long a node tries the launcher's address (a NAT drops the packets: silence)
# Reads the torch version without importing torch (an import takes seconds).
TORCH_VERSION = "import importlib.metadata as m; print(m.version('torch'))"


@dataclass(frozen=True)
class Start:
    """A node's command behind the gate: its env prefix for each verdict
    word, and the payload every word runs (sent once)."""

    prefixes: Mapping[str, str]
    payload: str


@dataclass(frozen=True)
class StoreProbe:
    """An address of this launcher each node connects to during the checks;
    whatever answers there must send `answer` (launch/ssh/storesite.py)."""

    host: str
    port: int
    answer: str


@dataclass(frozen=True)
class HostProblem:
    node: int
    host: str
    check: str
    detail: str


@dataclass
class HostFacts:
    node: int
    endpoint: Endpoint
    client: paramiko.SSHClient | None = None
    # The gated session, waiting for GO; the node's output follows on `stream`.
    channel: paramiko.Channel | None = None
    stream: paramiko.ChannelFile | None = None
    sections: dict[str, str] = field(default_factory=dict)
    problems: list[HostProblem] = field(default_factory=list)

    def problem(self, check: str, detail: str) -> None:
        self.problems.append(HostProblem(self.node, str(self.endpoint), check, detail))


def probe_script(spec: JobSpec, store: StoreProbe | None = None) -> str:
    """Shell that prints one marked section per fact. Builtins where they
    will do: every host runs this on each launch, before anything starts."""
    py = shlex.quote(spec.command.python)
    lines = [f"echo {MARK}hostname; {{ read -r h < /proc/sys/kernel/hostname && echo \"$h\"; }} 2>/dev/null || hostname"]
    if spec.ssh.docker:
        lines.append(f"echo {MARK}docker; docker image inspect --format ok {shlex.quote(spec.image)} 2>&1")
    else:
        if spec.ssh.workdir:
            wd = shlex.quote(spec.ssh.workdir)
            lines.append(f"echo {MARK}workdir; if cd -- {wd} 2>/dev/null; then echo ok; else echo missing; fi")
        lines.append(f"echo {MARK}python; command -v {py} || echo missing")
        lines.append(f"echo {MARK}torch; {py} -c {shlex.quote(TORCH_VERSION)} 2>&1")
    lines.append(f"echo {MARK}netdev; while IFS= read -r l; do echo \"$l\"; done < /proc/net/dev")
    lines.append(f"echo {MARK}tcp; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    if store is not None:
        lines.append(f"echo {MARK}store; {store_check(store)}")
    return "\n".join(lines) + "\n"


def store_check(store: StoreProbe) -> str:
    """Connect to the launcher's address from the node (bash's /dev/tcp; the
    node command needs bash anyway) and print the first line it sends."""
    read = 'exec 3<>"/dev/tcp/$0/$1" && IFS= read -r line <&3 && printf "%s\\n" "$line"'
    return (f"timeout {STORE_CHECK_S} bash --norc -c {shlex.quote(read)} {shlex.quote(store.host)} {store.port} "
            f"2>&1 || {{ [ $? = 124 ] && echo 'no answer within {STORE_CHECK_S} s'; }}")


def gated_command(spec: JobSpec, start: Start, store: StoreProbe | None = None) -> str:
    """The checks, then the node command once the launcher says which (its
    verdict, one of `start`'s words). Run by `sh` so a csh or fish login
    shell sees one simple command."""
    cases = "".join(f"  {word}) set -- {prefix} ;;\n" for word, prefix in start.prefixes.items())
    script = (probe_script(spec, store) + f"echo {READY}\n"
              'IFS= read -r verdict || exit 0\n'
              f'case "$verdict" in\n{cases}  *) exit 0 ;;\nesac\n'
              f'exec "$@" {start.payload}\n')
    return f"sh -c {shlex.quote(script)}"


def verdict(word: str) -> bytes:
    return f"{word}\n".encode()


# Sections whose answer is the last line (a version, or the end of an error).
LAST_LINE_ONLY = ("torch", "docker")


def parse_sections(text: str) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(MARK):
            current = line[len(MARK):]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    parsed = {k: "\n".join(v).strip() for k, v in sections.items()}
    for key in LAST_LINE_ONLY:
        if key in parsed:
            parsed[key] = parsed[key].rsplit("\n", 1)[-1].strip()
    return parsed


def interfaces(netdev: str) -> set[str]:
    return {line.split(":", 1)[0].strip() for line in netdev.splitlines() if ":" in line}


def listening_ports(tcp: str) -> set[int]:
    """Ports in LISTEN state (st 0A) from /proc/net/tcp{,6}."""
    ports = set()
    for line in tcp.splitlines():
        cols = line.split()
        if len(cols) > 3 and cols[3] == "0A" and ":" in cols[1]:
            ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def read_facts(facts: HostFacts, command: str, timeout: float) -> None:
    """Start the gated command and read its facts, up to READY; the channel
    stays open, paused at the verdict."""
    assert facts.client is not None
    transport = facts.client.get_transport()
    if transport is None:
        raise paramiko.SSHException("not connected")
    channel = transport.open_session(timeout=timeout)
    channel.set_combine_stderr(True)
    channel.settimeout(timeout)
    channel.exec_command(command)
    facts.channel, facts.stream = channel, channel.makefile("rb")
    lines: list[str] = []
    for raw in facts.stream:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line == READY:
            channel.settimeout(None)  # from here on it carries the job's output, for hours
            facts.sections = parse_sections("\n".join(lines))
            return
        lines.append(line)
    tail = " | ".join(lines[-3:]) or "no output"
    facts.problem("checks", f"the host ended the checks early (exit status {channel.recv_exit_status()}: {tail}); "
                  "check that its login shell runs `sh -c` commands")


def gather(facts: HostFacts, spec: JobSpec, settings: SshSettings, start: Start,
           store: StoreProbe | None = None) -> HostFacts:
    try:
        facts.client = connect(facts.endpoint, settings)
    except ConnectError as exc:
        facts.problem(exc.kind, str(exc))
        return facts
    timeout = settings.timeout_s + 20
    try:
        read_facts(facts, gated_command(spec, start, store), timeout)
    except TimeoutError:
        facts.problem("checks", f"no answer to the checks within {timeout:g} s; the login shell may be stuck "
                      "in the host's rc files (try: ssh HOST true), or the host is overloaded")
    except SSH_ERRORS as exc:
        facts.problem("unreachable", f"connection failed during the checks: {str(exc) or type(exc).__name__}")
    return facts


def judge_host(facts: HostFacts, spec: JobSpec, master_port: int | None) -> None:
    """`master_port` None: node 0 listens on no port of the job's (the
    launcher hosts the rendezvous store)."""
    s = facts.sections
    if not s:
        return
    if s.get("workdir") == "missing":
        facts.problem("workdir", f"{spec.ssh.workdir!r} does not exist; create it or fix ssh.workdir")
    if s.get("python") == "missing":
        facts.problem("interpreter", f"{spec.command.python!r} not found; install it or set command.python")
    elif "torch" in s and not _is_version(s["torch"]):
        facts.problem("torch", f"{spec.command.python} cannot find torch ({s['torch'][-120:]}); install torch there")
    if "docker" in s and s["docker"] != "ok":
        facts.problem("image", f"image {spec.image!r} not on the host ({s['docker'][-120:]}); docker pull it there")
    if not spec.network.is_auto:
        missing = [n for n in spec.network.names if n not in interfaces(s.get("netdev", ""))]
        if missing:
            have = ", ".join(sorted(interfaces(s.get("netdev", "")))) or "none"
            facts.problem("interface", f"no interface {', '.join(missing)} (has {have}); "
                          "fix network.interface or use auto")
    if facts.node == 0 and master_port is not None and master_port in listening_ports(s.get("tcp", "")):
        facts.problem("master port", f"port {master_port} is already in use on the master host; "
                      "stop what holds it or set master_port")


def _is_version(text: str) -> bool:
    return bool(text) and text[0].isdigit() and "\n" not in text and " " not in text


def judge_all(all_facts: list[HostFacts], spec: JobSpec, master_port: int | None) -> list[HostProblem]:
    for facts in all_facts:
        judge_host(facts, spec, master_port)
    versions = {f.sections["torch"] for f in all_facts if _is_version(f.sections.get("torch", ""))}
    problems = [p for f in all_facts for p in f.problems]
    if len(versions) > 1:
        for facts in all_facts:
            if facts.sections.get("torch") in versions:
                problems.append(HostProblem(facts.node, str(facts.endpoint), "torch version",
                                        f"torch {facts.sections['torch']} (hosts differ: "
                                        f"{', '.join(sorted(versions))}); install one version everywhere"))
    names: dict[str, int] = {}
    for facts in all_facts:
        name = facts.sections.get("hostname")
        if name and name in names:
            problems.append(HostProblem(facts.node, str(facts.endpoint), "duplicate host",
                                    f"same machine as node {names[name]} ({name}); list each host once"))
        elif name:
            names[name] = facts.node
    return sorted(problems, key=lambda p: p.node)


def store_unreached(all_facts: list[HostFacts], store: StoreProbe) -> str | None:
    """Why the nodes cannot use the launcher's store at `store` (the first
    node that did not get its answer, and what it got); None: every node did."""
    for facts in all_facts:
        got = facts.sections.get("store", "")
        if got != store.answer:
            said = got.rsplit("\n", 1)[-1].strip() or "no answer"
            if got.startswith("ddpkit-store "):
                said = "another launcher's store answered"
            return f"node {facts.node} ({facts.endpoint.alias}): {said}"
    return None


def preflight(endpoints: list[Endpoint], spec: JobSpec, settings: SshSettings, master_port: int,
              starts: list[Start], store: StoreProbe | None = None) -> tuple[list[HostFacts], list[HostProblem]]:
    """Connect to and check every host at once; `starts[i]` is node i's
    command, run on the verdict. `store`: where each node tries this
    launcher (an elastic job's store); when every node reaches it, node 0's
    port is not checked. The sessions stay open, waiting, when there are no
    problems; otherwise they are closed and every host's command exits."""
    facts = [HostFacts(i, ep) for i, ep in enumerate(endpoints)]
    with ThreadPoolExecutor(max_workers=min(64, len(facts)) or 1) as pool:
        facts = list(pool.map(lambda f: gather(f, spec, settings, starts[f.node], store), facts))
    node0_port = None if store is not None and store_unreached(facts, store) is None else master_port
    problems = judge_all(facts, spec, node0_port)
    if problems:
        close_all(facts)
    return facts, problems


def close_all(facts: list[HostFacts]) -> None:
    """Close every session and connection: a host still waiting for the
    verdict reads EOF and exits without starting."""
    for f in facts:
        if f.channel is not None:
            f.channel.close()
        if f.client is not None:
            close(f.client)


def problem_table(problems: list[HostProblem]) -> object:
    from rich.table import Table
    from rich.text import Text  # plain text: '[host]:port' is not rich markup

    table = Table(title=f"preflight: {len(problems)} problem(s), nothing was started", show_lines=False)
    for column in ("node", "host", "check", "problem"):
        table.add_column(column, overflow="fold")
    for p in problems:
        table.add_row(*(Text(v) for v in (str(p.node), p.host, p.check, p.detail)))
    return table
