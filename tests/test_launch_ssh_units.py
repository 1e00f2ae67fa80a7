"""Hostfile parsing and the remote command text, without any host; where an
elastic job's rendezvous store lives, decided from the preflight's store
check run under the local shell.

The quoting test runs the exact start command under a local POSIX shell
with a recorder standing in for the interpreter: whatever hostile text the
spec holds must arrive at the process byte for byte, and nothing in it may run.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.launch.secrets import stdin_payload, with_run_key
from ddpkit.launch.ssh.connect import Endpoint
from ddpkit.launch.ssh.hostfile import HostEntry, load_hosts, parse_hostfile
from ddpkit.launch.ssh.launcher import SshPlan, place_store
from ddpkit.launch.ssh.preflight import (
    GO,
    GO_LAUNCHER_STORE,
    READY,
    HostFacts,
    Start,
    StoreProbe,
    gated_command,
    parse_sections,
    probe_script,
)
from ddpkit.launch.ssh.storesite import Answerer, node0_hosts_line, open_answerer, route_address
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import SpecError, build_spec
from ddpkit.targets import sshnode as remote

RECORDER = """#!{python}
import json, os, sys
keys = json.loads(os.environ["KEYS"])
print(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in keys}}}}))
"""


def live_in_group(pgid: int) -> list[str]:
    """Processes of a group that still run (zombies wait for a reaper, they run nothing)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat=,pid=,args="], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if ln.split()[0] == str(pgid) and not ln.split()[1].startswith("Z")]


def spec(**fields: object) -> JobSpec:
    return build_spec({"name": "unit", **fields})


# ---- hostfile ---------------------------------------------------------------

def test_hostfile_lines_comments_users_ports_and_ipv6() -> None:
    text = "# rack A\n\ngpu1 slots=4\nubuntu@gpu2:2222   slots=4  # spare\n[fe80::1%eth0]:23\n  10.0.0.9\n"
    assert parse_hostfile(text, "hf") == [
        HostEntry("gpu1", None, None, 4, "hf:3"),
        HostEntry("gpu2", "ubuntu", 2222, 4, "hf:4"),
        HostEntry("fe80::1%eth0", None, 23, None, "hf:5"),
        HostEntry("10.0.0.9", None, None, None, "hf:6"),
    ]


@pytest.mark.parametrize(("text", "message"), [
    ("gpu1\ngpu2\ngpu1\n", "hf:3: gpu1 is listed twice (first at hf:1)"),
    ("gpu1 slots=8\ngpu2 slots=4\ngpu3\n", "hf:1: slots=8 but nproc_per_node=4; write slots=4 or pass --nproc-per-node 8"),
    ("gpu1\ngpu2\n", "nodes: the job has nodes=3 but 2 hosts are listed; pass --nodes 2 or list 3 hosts"),
    ("gpu1 max_slots=4\n", "hf:1: unknown option 'max_slots=4'; the only option is slots=N"),
    ("-oProxyCommand=x\n", "hf:1: '-oProxyCommand=x' is not a host"),
    ("gpu1:99999\n", "hf:1: port 99999 is out of range"),
    ("", "hosts: none given"),
])
def test_hostfile_errors_name_the_line_and_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "hf"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        load_hosts(spec(nodes=3, nproc_per_node=4), path)
    assert any(message.replace("hf:", f"{path}:") in p for p in err.value.problems), err.value.problems


def test_hosts_come_from_the_spec_without_a_hostfile() -> None:
    entries = load_hosts(spec(nodes=2, ssh={"hosts": ["a", "root@b:2200"]}), None)
    assert [str(e) for e in entries] == ["a", "root@b:2200"]


def test_missing_hostfile_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read it"):
        load_hosts(spec(), tmp_path / "nope")


# ---- remote command quoting ------------------------------------------------

HOSTILE = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=40)
SEEDS = ["$(touch CANARY)", "`touch CANARY`", "'; touch CANARY; '", "\"$HOME\"\n-rf", "-- --node-rank=7", "é ü 日本"]


def run_start(tmp_path: Path, env: dict[str, str], args: list[str], master: str) -> dict:
    recorder = tmp_path / "recorder"
    recorder.write_text(RECORDER.format(python=sys.executable))
    recorder.chmod(0o755)
    keys = sorted(env)
    job = spec(nodes=2, env={**env, "KEYS": json.dumps(keys)}, command={"python": str(recorder), "args": args})
    cmd = remote.node_command(job, 1, master)
    # sh -c is what sshd runs the command with; stdin stays open like a launcher's.
    proc = subprocess.Popen(["sh", "-c", cmd.start], cwd=tmp_path, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(stdin_payload(with_run_key({})))  # type: ignore[union-attr]  # what launch ssh sends after GO
    proc.stdin.flush()  # type: ignore[union-attr]
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    assert proc.wait(30) == 0, out + err
    proc.stdin.close()  # type: ignore[union-attr]
    lines = out.decode().splitlines()
    assert remote.parse_pgid(lines[0]) is not None
    return json.loads(lines[-1])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.sampled_from(SEEDS), HOSTILE), arg=st.one_of(st.sampled_from(SEEDS), HOSTILE),
       master=st.sampled_from(["10.0.0.1", "$(touch CANARY)", "a'b"]))
def test_hostile_values_arrive_exactly_and_never_run(tmp_path: Path, value: str, arg: str, master: str) -> None:
    got = run_start(tmp_path, {"HOSTILE": value}, [arg, "--x"], master)
    assert got["env"]["HOSTILE"] == value
    argv = got["argv"]
    assert argv[:5] == ["-m", "ddpkit.agent", "--nnodes=2", "--nproc-per-node=1", "--node-rank=1"]
    assert argv[5] == f"--master-addr={master}"
    assert argv[-2:] == [arg, "--x"]
    assert not (tmp_path / "CANARY").exists()


def test_stop_command_is_bound_to_one_pgid() -> None:
    cmd = remote.node_command(spec(), 0, "h")
    assert cmd.stop(4242).startswith("env DDPKIT_PGID=4242 DDPKIT_NODE_RANK=0 bash --norc -c ")
    assert 'ddpkit_kill_tree "$DDPKIT_PGID"' in remote.stop_script(spec())


def test_stop_terms_then_kills_a_group_that_ignores_term(tmp_path: Path) -> None:
    # "ready" once the trap is set: a stop that came first would meet a bash that TERM still ends
    stubborn = subprocess.Popen(["setsid", "bash", "-c", "trap '' TERM; sleep 60 & echo ready; wait; sleep 60"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
        job = spec(ssh={"grace_s": 0.3})
        cmd = remote.node_command(job, 0, "h")
        subprocess.run(["sh", "-c", cmd.stop(stubborn.pid)], check=True, timeout=30)
        assert stubborn.wait(5) == -9
        assert live_in_group(stubborn.pid) == []
    finally:
        stubborn.kill()


def test_docker_mode_wraps_the_launch_line() -> None:
    job = spec(image="reg.example/ddp:1", device="cuda", ssh={"docker": True, "workdir": "/w"}, env={"A": "1"})
    text = remote.node_script(job)
    line = next(ln for ln in text.splitlines() if ln.startswith("docker run"))
    assert line.startswith('docker run --rm --name=ddpkit-unit-node"${DDPKIT_NODE_RANK}" --gpus all '
                           "--network host --ipc host -e A ")
    assert "-e DDPKIT_NODE_RANK -w /w reg.example/ddp:1 python3 -m ddpkit.agent" in line
    assert "cd -- " not in text  # the workdir is the container's
    assert "docker rm -f ddpkit-unit-node" in remote.stop_script(job)


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid (util-linux)")
def test_watchdog_stops_the_group_when_the_launcher_goes_away(tmp_path: Path) -> None:
    """Connection lost = stdin EOF on the host: the node's group must go."""
    job = spec(command={"python": "/bin/sleep", "args": []}, ssh={"grace_s": 1})
    script = remote.node_script(job).replace("/bin/sleep -m ddpkit.agent", "/bin/sleep 60 #")
    proc = subprocess.Popen(["setsid", "bash", "-c", script, "t"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={"DDPKIT_NODE_RANK": "0", "DDPKIT_MASTER_ADDR": "h", "PATH": "/usr/bin:/bin"})
    pgid = remote.parse_pgid(proc.stdout.readline().decode())  # type: ignore[union-attr]
    assert pgid is not None
    proc.stdin.close()  # type: ignore[union-attr]
    assert proc.wait(10) != 0
    for _ in range(50):
        if not live_in_group(pgid):
            break
        subprocess.run(["sleep", "0.1"])
    assert live_in_group(pgid) == []


def _dry(capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    from ddpkit.cli import main

    code = main(["launch", "ssh", "--nodes", "2", "--set", "ssh.hosts=[h0, h1]", "--dry-run", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_dry_run_shows_each_hosts_launch_line_and_full_the_exact_command(capsys: pytest.CaptureFixture[str]) -> None:
    short = _dry(capsys, "--", "--epochs", "2")
    lines = [line for line in short.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all(" -m ddpkit.agent " in line for line in lines)
    assert lines[0].startswith("env DDPKIT_NODE_RANK=0 ") and lines[0].endswith("-m ddpkit.train --epochs 2")
    assert "#   DDPKIT_JOB_NAME=ddp-job" in short and "setsid" not in short
    full = _dry(capsys, "--full", "--", "--epochs", "2")
    assert full.count("setsid -w ") == 2 and len(full.splitlines()) > 4 * len(short.splitlines())


def test_launch_ssh_takes_log_dir_grace_and_train_args_like_its_siblings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _dry(capsys, "--log-dir", str(tmp_path / "L"), "--grace", "7", "--", "--epochs", "3")
    assert f"log {tmp_path / 'L'}/ddp-job.node0.h0.log" in out and "--epochs 3" in out
    import argparse

    from ddpkit.launch.ssh import launcher as ssh

    parser = argparse.ArgumentParser()
    ssh.add_arguments(parser)
    args = parser.parse_args(["--grace", "7"])
    assert args.grace == 7.0


def test_a_host_name_that_does_not_resolve_says_so_not_sshd(tmp_path: Path) -> None:
    from ddpkit.launch.ssh.connect import ConnectError, SshSettings, connect, endpoint_for

    settings = SshSettings(config_path=tmp_path / "no-config", known_hosts=tmp_path / "known_hosts")
    endpoint = endpoint_for(parse_hostfile("gpu-a.no-such-domain.invalid slots=1\n")[0], settings)
    with pytest.raises(ConnectError) as err:
        connect(endpoint, settings)
    assert err.value.kind == "unknown host"
    assert "'gpu-a.no-such-domain.invalid' does not resolve" in str(err.value) and "sshd" not in str(err.value)
    assert "HostName for it in ~/.ssh/config" in str(err.value)


# ---- where an elastic job's rendezvous store lives ---------------------------

def _elastic_plan() -> SshPlan:
    job = spec(nodes=2, elastic={"min_nodes": 1}, command={"module": "ddpkit.train"})
    endpoints = [Endpoint(f"h{i}", f"h{i}", 22, "u") for i in range(2)]
    return SshPlan(job, endpoints, "h0", 29500, remote.new_rdzv_id(job))


def _store_section(plan: SshPlan, probe: StoreProbe) -> str:
    """The store check of the preflight's script, run here as a node runs it."""
    script = probe_script(plan.spec, probe)
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30).stdout
    return parse_sections(out)["store"]


def test_the_gate_starts_the_command_its_verdict_names() -> None:
    plan = _elastic_plan()
    start = Start({GO: "env WHERE=node0", GO_LAUNCHER_STORE: "env WHERE='the launcher'"},
                  """sh -c 'echo "store at $WHERE"'""")
    command = gated_command(plan.spec, start)
    for word, said in [(GO, "store at node0"), (GO_LAUNCHER_STORE, "store at the launcher"), ("gone", None)]:
        out = subprocess.run(["sh", "-c", command], input=f"{word}\n", capture_output=True, text=True,
                             timeout=60).stdout
        after = out.split(READY, 1)[1].strip()
        assert after == (said or ""), out


def test_nodes_that_cannot_reach_the_launcher_leave_the_store_on_node_0() -> None:
    plan = _elastic_plan()
    answerer = Answerer("127.0.0.1", 0).open()
    with contextlib.ExitStack() as stack, socket.socket() as mute, socket.socket() as closed:
        stack.callback(answerer.close)
        mute.bind(("127.0.0.1", 0))
        mute.listen()  # takes the connection, never says a word
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        reached = _store_section(plan, answerer.probe)
        assert reached == answerer.answer
        sections = {
            "refused": _store_section(plan, StoreProbe("127.0.0.1", closed.getsockname()[1], answerer.answer)),
            "silent": _store_section(plan, StoreProbe("127.0.0.1", mute.getsockname()[1], answerer.answer)),
        }
        assert "Connection refused" in sections["refused"], sections
        assert sections["silent"] == "no answer within 3 s", sections
        for section in sections.values():
            facts = [HostFacts(i, ep, sections={"store": got})
                     for i, (ep, got) in enumerate(zip(plan.endpoints, [reached, section]))]
            why = place_store(plan, answerer, facts, stack)
            assert why is not None and why.startswith(f"the nodes cannot reach this launcher at 127.0.0.1:"
                                                      f"{answerer.port} (node 1 (h1): "), why
            assert plan.store_at is None and plan.verdict == b"go\n"
            assert "DDPKIT_MASTER_ADDR=h0 " in plan.command(1).start
            line = node0_hosts_line(why)
            assert line.startswith("launch ssh: node 0's agent hosts the rendezvous store, so losing node 0 ends "
                                   "the job: the nodes cannot reach") and "\n" not in line
            assert "run launch ssh on a host every node reaches directly" in line


def test_nodes_that_reach_the_launcher_meet_in_its_store() -> None:
    import torch.distributed as dist

    plan = _elastic_plan()
    answerer = Answerer("127.0.0.1", 0).open()
    with contextlib.ExitStack() as stack:
        stack.callback(answerer.close)
        answer = _store_section(plan, answerer.probe)
        facts = [HostFacts(i, ep, sections={"store": answer}) for i, ep in enumerate(plan.endpoints)]
        assert place_store(plan, answerer, facts, stack) is None
        assert plan.store_at == "127.0.0.1" and plan.verdict == f"{GO_LAUNCHER_STORE}\n".encode()
        assert "DDPKIT_MASTER_ADDR=127.0.0.1 " in plan.command(0).start
        client = dist.TCPStore("127.0.0.1", answerer.port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")  # the launcher's store took the answerer's socket over
        assert client.get("k") == b"v"


def test_the_launcher_tries_its_address_towards_node_0_unless_a_jump_host_is_between() -> None:
    assert route_address(Endpoint("n0", "127.0.0.1", 22, "u")) == ("127.0.0.1", "")
    jumped = Endpoint("n0", "10.9.9.9", 22, "u", jump=Endpoint("bastion", "bastion.example", 22, "u"))
    assert route_address(jumped) == (None, "node 0 is reached through the jump host bastion.example")
    answerer, why = open_answerer(jumped, 29500)
    assert answerer is None and node0_hosts_line(why).startswith(
        "launch ssh: node 0's agent hosts the rendezvous store, so losing node 0 ends the job: node 0 is reached "
        "through the jump host bastion.example; to let any node go")


def test_a_program_of_the_users_own_sends_its_metrics_to_the_launcher_and_ddpkit_train_does_not(
        tmp_path: Path) -> None:
    """launch ssh and launch docker: the run folder's metrics file for a script
    (the env prefix / the container's environment names the launcher), none for
    ddpkit train (its --metrics file) or ssh.docker's containers."""
    from ddpkit.launch import docker
    from ddpkit.launch.runargs import metrics_from_output

    own = spec(command={"script": "train.py"}, image="img:1")
    kept = tmp_path / "metrics.jsonl"
    assert metrics_from_output(own, kept) == kept and metrics_from_output(spec(), kept) is None
    prefix = remote.node_command(own, 1, "h", metrics=True).start.split(" setsid ")[0]
    assert prefix == "env DDPKIT_NODE_RANK=1 DDPKIT_MASTER_ADDR=h DDPKIT_METRICS=-", prefix
    assert "DDPKIT_METRICS" not in remote.node_command(own, 1, "h").start
    assert [p.environment.get("DDPKIT_METRICS") for p in docker.plan(own, metrics=True)] == ["-"]
    assert "DDPKIT_METRICS" not in docker.plan(own)[0].environment
