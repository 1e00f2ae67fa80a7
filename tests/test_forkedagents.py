"""launch local's agents forked from one pre-imported process
(agent/forkserver.py, launch/forkedagents.py): each must be what the
launcher's Popen of the same line would have started (session, argv in ps,
working directory, stdin, one pipe for stdout and stderr, the exit code),
and where the server cannot fork, the launcher is told so and falls back to
Popen. The launches of every other launch-local test run through it too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ddpkit.launch.forkedagents import AgentServer, ForkedAgent
from ddpkit.shared import envnames

pytestmark = pytest.mark.slow

PROGRAM = """\
import os, sys, time
print("worker", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "says", sys.argv[1], flush=True)
if sys.argv[1] == "fail":
    sys.exit(3)
if sys.argv[1].startswith("sleep"):
    time.sleep(120)
"""


def agent_line(program: Path, mode: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit.agent", "--standalone", "--nproc-per-node=1", "--max-restarts=0",
            "--monitor-interval=0.1", str(program), mode]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("forked") / "program.py"
    path.write_text(PROGRAM)
    return path


@pytest.fixture(scope="module")
def server(program: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentServer]:
    env = {**os.environ, envnames.DDPKIT_RUN_ID: "forked-agents-test", envnames.PYTHONUNBUFFERED: "1"}
    log = tmp_path_factory.mktemp("log") / "server.log"
    started = AgentServer.start(agent_line(program, "sleep"), env, log)
    assert started is not None
    yield started
    started.close()
    assert not log.exists(), "a server with nothing to say leaves no log"


def forked(server: AgentServer, program: Path, mode: str) -> ForkedAgent:
    env = {**os.environ, envnames.PYTHONUNBUFFERED: "1", "NODE_ONLY": "node-own"}
    agent = server.spawn(agent_line(program, mode), env)
    assert agent is not None, "the server forked no agent"
    return agent


def output_of(agent: ForkedAgent | subprocess.Popen[bytes]) -> str:
    assert agent.stdout is not None
    return agent.stdout.read().decode()


def test_a_forked_agent_ends_as_the_same_line_under_popen_does(server: AgentServer, program: Path) -> None:
    agent = forked(server, program, "fail")
    seen = output_of(agent)
    code = agent.wait(timeout=120)
    popen = subprocess.Popen(agent_line(program, "fail"), env={**os.environ, envnames.PYTHONUNBUFFERED: "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    popen_seen = output_of(popen)
    assert (code, popen.wait(timeout=120)) == (1, 1)
    for out in (seen, popen_seen):  # the worker's line, and torchrun's report of its exit code, on the one pipe
        assert "worker 0 of 1 says fail" in out
        assert "exitcode  : 3" in out
    assert "found in sys.modules" not in seen  # the agent's module was run afresh, as `-m` runs it


def test_a_forked_agent_is_a_session_with_its_line_directory_and_pipes(server: AgentServer, program: Path) -> None:
    agent = forked(server, program, "sleep")
    line = agent.stdout.readline().decode()  # the worker runs: the agent is all set up
    deadline = time.monotonic() + 60
    while "says sleep" not in line and time.monotonic() < deadline:
        line = agent.stdout.readline().decode()
    proc = psutil.Process(agent.pid)
    assert os.getsid(agent.pid) == agent.pid
    assert [arg for arg in proc.cmdline() if arg] == agent_line(program, "sleep")  # NULs pad the server's longer area
    assert proc.cwd() == os.getcwd()
    assert proc.ppid() == server.proc.pid
    fds = {fd: os.readlink(f"/proc/{agent.pid}/fd/{fd}") for fd in (0, 1, 2)}
    assert fds[0] == os.devnull and fds[1] == fds[2] and fds[1].startswith("pipe:")
    # what /proc shows of its environment is the server's (what every node shares)
    assert proc.environ().get(envnames.DDPKIT_RUN_ID) == "forked-agents-test"
    assert "NODE_ONLY" not in proc.environ()
    workers = [p.pid for p in proc.children(recursive=True)]
    assert agent.poll() is None
    os.killpg(agent.pid, signal.SIGTERM)  # what launch local's stop sends
    assert agent.wait(timeout=60) == 1  # the agent's own stop: a line, exit 1, as under Popen
    assert "ddpkit.agent: node 0: SIGTERM: its worker stopped (killed by SIGTERM)" in output_of(agent)
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in workers if psutil.pid_exists(pid)], timeout=30)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


def test_the_exit_codes_of_a_signal_and_of_a_timeout_read_as_popens(server: AgentServer, program: Path) -> None:
    agent = forked(server, program, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        agent.wait(timeout=0.2)
    os.killpg(agent.pid, signal.SIGKILL)
    assert agent.wait(timeout=60) == -signal.SIGKILL


def test_an_interpreter_without_ddpkit_falls_back_to_popen(program: Path, tmp_path: Path) -> None:
    bare = "/usr/bin/python3"
    if not Path(bare).exists() or subprocess.run([bare, "-c", "import ddpkit"], capture_output=True).returncode == 0:
        pytest.skip("needs an interpreter without ddpkit")
    line = [bare, *agent_line(program, "fail")[1:]]
    server = AgentServer.start(line, dict(os.environ), tmp_path / "server.log")
    assert server is not None
    try:
        assert server.spawn(line, dict(os.environ)) is None
        assert not server.alive
        assert "No module named" in (tmp_path / "server.log").read_text()
    finally:
        server.close()
    assert (tmp_path / "server.log").exists()  # its error is kept


def test_no_server_where_forking_is_off(program: Path) -> None:
    env = {**os.environ, envnames.DDPKIT_AGENT_FORK: "0"}
    assert AgentServer.start(agent_line(program, "ok"), env, None) is None
    assert AgentServer.start([sys.executable, str(program), "ok"], dict(os.environ), None) is None


def shown_mode(pid: int, timeout: float = 60) -> str:
    """The last word of the line process `pid` shows once it shows an agent's
    (a fresh fork shows the server's line until it writes its own)."""
    deadline = time.monotonic() + timeout
    while True:
        line = [arg for arg in psutil.Process(pid).cmdline() if arg]
        if line[-1].startswith("sleep") or time.monotonic() > deadline:
            return line[-1]
        time.sleep(0.05)


def test_agents_asked_for_at_once_each_get_their_own_pid(server: AgentServer, program: Path) -> None:
    """Two nodes revived at once ask from two threads: each handle is its own agent."""
    modes = [f"sleep-{i}" for i in range(4)]
    agents: dict[str, ForkedAgent | None] = {}
    threads = [threading.Thread(target=lambda m=mode: agents.__setitem__(m, server.spawn(agent_line(program, m),
                                                                                         dict(os.environ))))
               for mode in modes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        for mode in modes:
            agent = agents[mode]
            assert agent is not None
            assert shown_mode(agent.pid) == mode
    finally:
        for agent in agents.values():
            if agent is not None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(timeout=60)
