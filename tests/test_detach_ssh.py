"""`ddpkit launch ssh --detach` on real hosts (docs/guides/detach.md): sshd
in network namespaces, the launcher on a fourth host ("login"), real
torchrun agents and ddpkit train ranks over gloo. The run's supervisor runs
on the job's first host; the launch returns with the run's name; the login
host is then cut off (its link down) and the job goes on to its end
without it; once the login host is back, `ddpkit status` and `logs
--follow` there reach the run on the first host, and `logs --follow` ends
with the summary and closing line, as the attached console does. A node
lost while detached, a cancel at once, the first host's refusals: `full`."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from tests.infra import netns, sshd
from tests.test_launch_ssh import DDPKIT, NODES, TRAIN_ARGS, Cluster, cluster, hostfile, job_processes, write_job

__all__ = ["cluster"]  # the module's sshd hosts (tests/infra/shared.py), a fixture

_REASON = netns.available() or sshd.available()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

DETACHED = (r"launch ssh: run (\S+)-(\w{6}) detached: supervised by pid (\d+) on (\S+), the job's first host, "
            r"which outlives this terminal and this machine")


def login_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "DDPKIT_RUNS_DIR": str(tmp_path / "login-runs")}


def detach(net: netns.Network, hosts: sshd.SshHosts, tmp_path: Path, job: Path, *flags: str,
           timeout: float = 120) -> tuple[float, object]:
    """`launch ssh --detach` from the login host: how long it took, and its result."""
    argv = [DDPKIT, "launch", "ssh", "-f", str(job), "--hostfile", str(hostfile(tmp_path, net)),
            *hosts.launcher_flags(), "--detach", "--detach-runs-dir", str(tmp_path / "node-runs"), *flags]
    began = time.monotonic()
    done = net["login"].run(argv, cwd=str(tmp_path), env=login_env(tmp_path), timeout=timeout)
    return time.monotonic() - began, done


def ddpkit_on_login(net: netns.Network, tmp_path: Path, *argv: str, timeout: float = 180) -> object:
    return net["login"].run([DDPKIT, *argv], env=login_env(tmp_path), timeout=timeout)


def there(tmp_path: Path, folder_name: str) -> Path:
    """The run folder on the first host (the hosts share this machine's files)."""
    return tmp_path / "node-runs" / folder_name


def wait_ended(folder: Path, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        try:
            record = json.loads((folder / "run.json").read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("state") not in (None, "running"):
            return record
        assert time.monotonic() < deadline, f"the detached run did not end within {within_s:.0f} s: {record}"
        time.sleep(0.3)


def test_ssh_detach_survives_its_launcher_host(cluster: Cluster, tmp_path: Path) -> None:
    net, hosts = cluster
    job = write_job(tmp_path, "away", args=TRAIN_ARGS)
    returned, done = detach(net, hosts, tmp_path, job)
    said = done.stdout + done.stderr  # type: ignore[attr-defined]
    found = re.search(DETACHED, said)
    assert done.returncode == 0 and found, said[-3000:]  # type: ignore[attr-defined]
    folder_name, run_id, supervisor = f"{found.group(1)}-{found.group(2)}", found.group(2), int(found.group(3))
    assert found.group(4) == net[NODES[0]].addr
    # The launching host is cut off for good: its link down, nothing of it reaches the hosts.
    cut = time.monotonic()
    net["login"].run(["ip", "link", "set", net["login"].ifname, "down"], check=True)
    record = wait_ended(there(tmp_path, folder_name), within_s=150)
    ended_after_cut = time.monotonic() - cut
    assert (record["state"], record["exit_code"]) == ("finished", 0), record
    assert record["summary"]["closing"] == "launch ssh: every node finished", record["summary"]
    assert record["launcher"]["pid"] == supervisor and record["detached"] is True
    console = (there(tmp_path, folder_name) / "console.log").read_text()
    assert console.rstrip().splitlines()[-1] == "launch ssh: every node finished", console[-2000:]
    net["login"].run(["ip", "link", "set", net["login"].ifname, "up"], check=True)
    # From the machine that started it: status, logs --follow (ending as the console did); report: the node-loss test.
    asked = time.monotonic()
    status = ddpkit_on_login(net, tmp_path, "status", run_id)
    assert status.returncode == 0, status.stdout + status.stderr  # type: ignore[attr-defined]
    assert re.search(rf"^run {run_id}: finished, exit code 0$", status.stdout, re.M), status.stdout
    followed = ddpkit_on_login(net, tmp_path, "logs", run_id, "--follow")
    lines = followed.stdout.rstrip().splitlines()  # type: ignore[attr-defined]
    assert followed.returncode == 0 and lines[-1] == "launch ssh: every node finished", followed.stdout[-3000:]
    assert any(re.search(r"^\[node0\] .*ddpkit train finished", line) for line in lines), followed.stdout
    handle = json.loads((tmp_path / "login-runs" / folder_name / "run.json").read_text())
    assert (handle["state"], handle["exit_code"], handle["remote"]["folder"]) == (
        "finished", 0, str(there(tmp_path, folder_name))), handle  # `ddpkit runs` here shows what was copied back
    assert job_processes(str(tmp_path)) == []
    print(f"DETACH ssh: returned in {returned:.1f} s; the login host cut off; the run finished "
          f"{ended_after_cut:.1f} s after the cut, exit 0; status and logs from the login host took "
          f"{time.monotonic() - asked:.1f} s")


LATE_STDIN = """
import sys, time
from pathlib import Path
import paramiko
from ddpkit.launch.ssh.detached import SETSID, supervisor_command
host, key, known, python, folder, release = sys.argv[1:]
client = paramiko.SSHClient()
client.load_host_keys(known)
client.connect(host, username="root", key_filename=key, look_for_keys=False, allow_agent=False)
channel = client.get_transport().open_session()
channel.exec_command(supervisor_command(python, SETSID, folder, []))
time.sleep(2)  # the payload arrives after the keeper's first process has exited
try:
    channel.sendall(b'{"payload": "all of it"}')
    channel.shutdown_write()
except OSError:  # the session already ended: the payload never reached it
    pass
print(b"".join(iter(lambda: channel.recv(65536), b"")).decode(), end="")
# the session ends while the supervisor goes on (it waits for the release file)
print("session ended" if channel.status_event.wait(60) else "session still open", flush=True)
Path(release).touch()
"""


def test_the_supervisor_there_reads_its_whole_stdin_and_outlives_the_session(cluster: Cluster,
                                                                             tmp_path: Path) -> None:
    """The supervisor's start over ssh: its payload (spec, hosts, secrets) must
    reach it whole however late the connection delivers it (sshd passes no
    more stdin on once the command's first process has exited), and the
    session must end once it said it is ready, while it goes on."""
    net, hosts = cluster
    got, release = tmp_path / "payload", tmp_path / "release"
    python = tmp_path / "python-that-reads-stdin"
    python.write_text(f"#!/bin/sh\ncat > {got}\necho ready $$\nexec >&- 2>&-\n"  # as take_over: its console elsewhere
                      f"i=0; while [ ! -e {release} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done\n")
    python.chmod(0o755)
    script = tmp_path / "late_stdin.py"
    script.write_text(LATE_STDIN)
    done = net["login"].run([sys.executable, str(script), net["node1"].addr, str(hosts.client_key),
                             str(hosts.known_hosts), str(python), str(tmp_path / "run"), str(release)], timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ready "), done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "session ended", done.stdout
    assert got.read_text() == '{"payload": "all of it"}'


def long_job(tmp_path: Path, name: str, **ssh: object) -> Path:
    """3 nodes of ddpkit train that run until stopped; `ssh`: the spec's ssh settings over write_job's."""
    job = write_job(tmp_path, name, args=[*TRAIN_ARGS, "--epochs=100000", "--log-every=1"])
    if ssh:
        import yaml

        spec = yaml.safe_load(job.read_text())
        spec["ssh"].update(ssh)
        job.write_text(yaml.safe_dump(spec))
    return job


def detached_run(net: netns.Network, hosts: sshd.SshHosts, tmp_path: Path, job: Path) -> tuple[str, str]:
    """Detach `job`; its folder's name and its id."""
    _, done = detach(net, hosts, tmp_path, job)
    said = done.stdout + done.stderr  # type: ignore[attr-defined]
    found = re.search(DETACHED, said)
    assert done.returncode == 0 and found, said[-3000:]  # type: ignore[attr-defined]
    return f"{found.group(1)}-{found.group(2)}", found.group(2)


@pytest.mark.full  # supervision as attached: test_detach_ssh.py::test_ssh_detach_survives_its_launcher_host
def test_a_node_lost_while_detached_fails_the_run_as_when_attached(cluster: Cluster, tmp_path: Path) -> None:
    """node 2's host cut off mid-run: the supervisor on node 0's host finds it
    unanswered and stops every other node; the summary and the exit code
    are the attached launch's (test_launch_ssh's host that stops answering),
    and `logs --follow` from the login host ends with that closing line."""
    net, hosts = cluster
    job = long_job(tmp_path, "loses", grace_s=1, alive_interval_s=1, alive_count=2)
    folder_name, run_id = detached_run(net, hosts, tmp_path, job)
    node0_log = tmp_path / "logs" / f"loses.node0.{net['node1'].addr}.log"  # rank 0 prints the steps
    deadline = time.monotonic() + 120
    while not (node0_log.exists() and re.search(r"step \d+", node0_log.read_text(errors="replace"))):
        assert time.monotonic() < deadline, "rank 0 logged no step within 120 s"
        time.sleep(0.3)
    net["node3"].run(["ip", "link", "set", net["node3"].ifname, "down"], check=True)
    record = wait_ended(there(tmp_path, folder_name), within_s=90)
    closing = record["summary"]["closing"]
    assert (record["state"], record["exit_code"]) == ("failed", 1), record
    assert closing.startswith(f"launch ssh: node 2 ({net['node3'].addr}) failed first: host stopped answering"), closing
    followed = ddpkit_on_login(net, tmp_path, "logs", run_id, "--follow")
    # As the attached console ends: the closing line, then the workers' own cause lines, if any.
    causes = record["summary"]["causes"]
    lines = followed.stdout.rstrip().splitlines()  # type: ignore[attr-defined]
    assert lines[len(lines) - 1 - len(causes)] == closing, followed.stdout[-3000:]
    status = ddpkit_on_login(net, tmp_path, "status", run_id)
    assert re.search(rf"^run {run_id}: failed, exit code 1$", status.stdout, re.M), status.stdout
    # The page is drawn here from the records copied back (rank 0's metrics were written beside the run folder).
    report = ddpkit_on_login(net, tmp_path, "report", run_id, "-o", str(tmp_path / "page.html"))
    assert report.returncode == 0 and (tmp_path / "page.html").stat().st_size > 0, report.stdout + report.stderr
    print(f"DETACH ssh node loss: the run ended failed, exit 1, in {record['ended'] - record['started']:.1f} s; "
          f"its closing line: {closing}")


@pytest.mark.full  # held stop: test_detach_ssh_units.py; test_detach_ssh.py::test_ssh_detach_survives_its_launcher_host
def test_a_cancel_right_after_the_ssh_detach_returns_cancels_cleanly(cluster: Cluster, tmp_path: Path) -> None:
    net, hosts = cluster
    folder_name, run_id = detached_run(net, hosts, tmp_path, long_job(tmp_path, "early"))
    cancel = ddpkit_on_login(net, tmp_path, "cancel", run_id)
    assert cancel.stdout.splitlines()[-1] == f"ddpkit cancel: run {run_id} cancelled (launcher exit code 130)", \
        cancel.stdout + cancel.stderr  # type: ignore[attr-defined]
    assert cancel.returncode == 0
    record = json.loads((there(tmp_path, folder_name) / "run.json").read_text())
    assert (record["state"], record["exit_code"]) == ("cancelled", 130), record
    console = (there(tmp_path, folder_name) / "console.log").read_text()
    assert console.rstrip().splitlines()[-1].startswith("launch ssh: interrupted: every node was stopped"), console
    status = ddpkit_on_login(net, tmp_path, "status", run_id)
    assert re.search(rf"^run {run_id}: cancelled, exit code 130$", status.stdout, re.M), status.stdout
    assert job_processes(str(tmp_path)) == []


@pytest.mark.full  # the first host's checks judged: test_detach_ssh_units.py; a refusal on the terminal: test_detach_local.py
@pytest.mark.parametrize("case", ["runs folder", "supervisor's preflight"])
def test_a_detach_the_first_host_cannot_take_is_refused_and_starts_nothing(cluster: Cluster, tmp_path: Path,
                                                                          case: str) -> None:
    net, hosts = cluster
    first = net["node1"].addr
    if case == "runs folder":
        job = write_job(tmp_path, "nowhere", args=TRAIN_ARGS)
        _, done = detach(net, hosts, tmp_path, job, "--detach-runs-dir", "/proc/no-runs-here")
        last = done.stderr.rstrip().splitlines()[-1]  # type: ignore[attr-defined]
        assert last == (f"launch ssh: --detach: node 0 (root@{first}:22): runs folder /proc/no-runs-here cannot be "
                        "made or written there; give one it can with --detach-runs-dir DIR"), done.stderr
    else:
        job = long_job(tmp_path, "nowork", workdir=str(tmp_path / "missing"))
        _, done = detach(net, hosts, tmp_path, job)
        err = done.stderr  # type: ignore[attr-defined]
        assert "preflight: 3 problem(s), nothing was started" in err and "workdir" in err, err
        assert re.search(r"launch ssh: --detach: the run's supervisor on node 0 ended before it started the job "
                         r"\(exit code 3\); its folder there: \S+$", err.rstrip().splitlines()[-1]), err
    assert done.returncode == 3 and "detached" not in done.stdout  # type: ignore[attr-defined]
    listed = ddpkit_on_login(net, tmp_path, "runs")
    assert re.search(r"│\s*ssh\s*│\s*failed\s*│.*│\s*3\s*│", listed.stdout), listed.stdout
    assert job_processes(str(tmp_path)) == []
