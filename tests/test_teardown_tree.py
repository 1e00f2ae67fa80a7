"""Teardown reaches workers that torchrun put in sessions of their own and
that ignore SIGTERM (a trainer blocked in a collective whose peer died only
sets its stop flag): both the local launcher and the SSH node scripts."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ddpkit.launch import local
from ddpkit.launch.supervise import proctree
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets.sshnode import stop_script

# An "agent" that starts a "worker" in a new session; the worker ignores
# SIGTERM, like a rank waiting on a dead peer.
AGENT = """
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
    start_new_session=True, stdout=subprocess.PIPE, text=True)
worker.stdout.readline()
print(worker.pid, flush=True)
time.sleep(300)
"""


def _start_agent(tmp: Path) -> tuple[subprocess.Popen[str], int]:
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    assert worker in proctree.descendants(agent.pid)
    return agent, worker


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while proctree.alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not proctree.alive([pid])


def test_local_stop_kills_workers_in_their_own_session(tmp_path: Path) -> None:
    agent, worker = _start_agent(tmp_path)
    node = local.LocalNode(index=0, argv=[], env={}, proc=agent)  # type: ignore[arg-type]
    local.stop([node], grace=1.0)
    assert agent.poll() is not None
    assert _gone(worker), "the worker outlived the launcher's teardown"


def test_ssh_stop_script_kills_workers_in_their_own_session(tmp_path: Path) -> None:
    agent, worker = _start_agent(tmp_path)
    script = stop_script(load_spec(None, overrides=["ssh.grace_s=1"]))
    subprocess.run(["bash", "-c", script, "ddpkit-stop"], env={"DDPKIT_PGID": str(agent.pid), "PATH": "/usr/bin:/bin"},
                   check=True, timeout=30)
    agent.wait(timeout=10)
    assert _gone(worker), "the worker outlived the stop script"
