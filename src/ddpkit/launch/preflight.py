"""Preflight: every host checked in parallel before anything starts.

One round trip per host gathers the facts (workdir, interpreter, torch
version, interfaces, listening ports, hostname); they are judged here, so the
remote side needs nothing but a POSIX shell. All problems are collected and
shown in one table; the launch goes ahead only when there are none.
"""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko

from ..spec import JobSpec
from .conn import ConnectError, Endpoint, SshSettings, close, connect

MARK = "@@ddpkit:"
# Reads the torch version without importing torch (an import takes seconds).
TORCH_VERSION = "import importlib.metadata as m; print(m.version('torch'))"


@dataclass(frozen=True)
class Problem:
    node: int
    host: str
    check: str
    detail: str


@dataclass
class HostFacts:
    node: int
    endpoint: Endpoint
    client: paramiko.SSHClient | None = None
    sections: dict[str, str] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def problem(self, check: str, detail: str) -> None:
        self.problems.append(Problem(self.node, str(self.endpoint), check, detail))


def probe_script(spec: JobSpec) -> str:
    """Shell that prints one marked section per fact."""
    py = shlex.quote(spec.command.python)
    lines = [f"echo {MARK}hostname; hostname"]
    if spec.ssh.docker:
        lines.append(f"echo {MARK}docker; docker image inspect --format ok {shlex.quote(spec.image)} 2>&1 | tail -n 1")
    else:
        if spec.ssh.workdir:
            wd = shlex.quote(spec.ssh.workdir)
            lines.append(f"echo {MARK}workdir; if cd -- {wd}; then echo ok; else echo missing; fi")
        lines.append(f"echo {MARK}python; command -v {py} || echo missing")
        lines.append(f"echo {MARK}torch; {py} -c {shlex.quote(TORCH_VERSION)} 2>&1 | tail -n 1")
    lines.append(f"echo {MARK}netdev; cat /proc/net/dev")
    lines.append(f"echo {MARK}tcp; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    return "\n".join(lines) + "\n"


def parse_sections(text: str) -> dict[str, str]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith(MARK):
            current = line[len(MARK):]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return {k: "\n".join(v).strip() for k, v in sections.items()}


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


def run_probe(client: paramiko.SSHClient, script: str, timeout: float) -> str:
    _, stdout, _ = client.exec_command(script, timeout=timeout)
    return stdout.read().decode("utf-8", "replace")


def gather(facts: HostFacts, spec: JobSpec, settings: SshSettings) -> HostFacts:
    try:
        facts.client = connect(facts.endpoint, settings)
    except ConnectError as exc:
        facts.problem(exc.kind, str(exc))
        return facts
    try:
        facts.sections = parse_sections(run_probe(facts.client, probe_script(spec), settings.timeout_s + 20))
    except (paramiko.SSHException, OSError) as exc:
        facts.problem("unreachable", f"connection failed during the checks: {exc}")
    return facts


def judge_host(facts: HostFacts, spec: JobSpec, master_port: int) -> None:
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
    if facts.node == 0 and master_port in listening_ports(s.get("tcp", "")):
        facts.problem("master port", f"port {master_port} is already in use on the master host; "
                      "stop what holds it or set master_port")


def _is_version(text: str) -> bool:
    return bool(text) and text[0].isdigit() and "\n" not in text and " " not in text


def judge_all(all_facts: list[HostFacts], spec: JobSpec, master_port: int) -> list[Problem]:
    for facts in all_facts:
        judge_host(facts, spec, master_port)
    versions = {f.sections["torch"] for f in all_facts if _is_version(f.sections.get("torch", ""))}
    problems = [p for f in all_facts for p in f.problems]
    if len(versions) > 1:
        for facts in all_facts:
            if facts.sections.get("torch") in versions:
                problems.append(Problem(facts.node, str(facts.endpoint), "torch version",
                                        f"torch {facts.sections['torch']} (hosts differ: "
                                        f"{', '.join(sorted(versions))}); install one version everywhere"))
    names: dict[str, int] = {}
    for facts in all_facts:
        name = facts.sections.get("hostname")
        if name and name in names:
            problems.append(Problem(facts.node, str(facts.endpoint), "duplicate host",
                                    f"same machine as node {names[name]} ({name}); list each host once"))
        elif name:
            names[name] = facts.node
    return sorted(problems, key=lambda p: p.node)


def preflight(endpoints: list[Endpoint], spec: JobSpec, settings: SshSettings,
              master_port: int) -> tuple[list[HostFacts], list[Problem]]:
    """Connect to and check every host at once. The clients stay open for
    the launch when there are no problems; otherwise they are closed."""
    facts = [HostFacts(i, ep) for i, ep in enumerate(endpoints)]
    with ThreadPoolExecutor(max_workers=min(64, len(facts)) or 1) as pool:
        facts = list(pool.map(lambda f: gather(f, spec, settings), facts))
    problems = judge_all(facts, spec, master_port)
    if problems:
        for f in facts:
            if f.client is not None:
                close(f.client)
    return facts, problems


def problem_table(problems: list[Problem]) -> object:
    from rich.table import Table
    from rich.text import Text  # plain text: '[host]:port' is not rich markup

    table = Table(title=f"preflight: {len(problems)} problem(s), nothing was started", show_lines=False)
    for column in ("node", "host", "check", "problem"):
        table.add_column(column, overflow="fold")
    for p in problems:
        table.add_row(*(Text(v) for v in (str(p.node), p.host, p.check, p.detail)))
    return table
