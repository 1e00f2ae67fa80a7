"""`ddpkit launch local`: real torchrun agents as nodes on this machine."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.cli import build_parser
from ddpkit.launch.local import AGENT_LOG, build_nodes, local_spec
from ddpkit.launch.supervise import proctree
from ddpkit.shared.exitcodes import ExitCode
from tests.helpers.runs import TINY
from tests.test_startup import ROOT, report_lines

REPORT_ONLY = str(ROOT / "tests" / "helpers" / "report_only.py")
FAIL_ON_NODE = str(ROOT / "tests" / "helpers" / "fail_on_node.py")


def launch_argv(*argv: str) -> list[str]:
    return [sys.executable, "-m", "ddpkit.cli", "launch", "local", *argv]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GLOO_", "NCCL_", "DDPKIT_", "RANK", "WORLD"))
           or k == "DDPKIT_RUNS_DIR"}  # the suite's run folders (conftest), not ~/.ddpkit
    return {**env, **extra}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", "local", *argv])


def test_local_spec_runs_here_with_gloo_and_appends_train_args() -> None:
    spec = local_spec(parse("-f", str(ROOT / "examples/cifar10-resnet18.yaml"), "--nodes", "3",
                            "--nproc-per-node", "2", "--", "--epochs=1", "--batch-size", "8"))
    assert (spec.nodes, spec.nproc_per_node, spec.backend, spec.device) == (3, 2, "gloo", "cpu")
    assert spec.rendezvous.backend == "static" and spec.master_port is not None
    assert spec.command.args[-3:] == ["--epochs=1", "--batch-size", "8"]
    assert spec.command.python == sys.executable


def test_each_node_gets_its_rank_and_name() -> None:
    spec = local_spec(parse("--nodes", "2", "--nproc-per-node", "2"))
    nodes = build_nodes(spec, Path("/logs"))
    assert [n.env["DDPKIT_NODE_RANK"] for n in nodes] == ["0", "1"]
    assert len({n.env["DDPKIT_HOSTNAME"] for n in nodes}) == 2
    for i, node in enumerate(nodes):
        assert f"--node-rank={i}" in node.argv
        assert "--master-addr=127.0.0.1" in node.argv and f"--master-port={spec.master_port}" in node.argv
        assert node.argv[-2:] == ["-m", "ddpkit.train"]
        assert node.argv[3:5] == ["--tee=3", f"--log-dir=/logs/node{i}"]
        assert not any("is_host" in word for word in node.argv)  # static: no c10d store to place


def test_no_agent_hosts_an_elastic_jobs_store() -> None:
    """Every local agent sees 127.0.0.1 in the endpoint, and the launcher hosts the
    c10d store (rdzv_store.py): every agent is told it does not."""
    spec = local_spec(parse("--nodes", "3", "--set", "elastic.min_nodes=2"))
    for node in build_nodes(spec, Path("/logs")):
        (conf,) = [word for word in node.argv if word.startswith("--rdzv-conf=")]
        assert conf.endswith(",is_host=0") and conf.count("is_host") == 1, conf


def test_bad_input_exits_2_before_starting_anything() -> None:
    res = subprocess.run(launch_argv("--nodes", "0"), env=clean_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "nodes" in res.stderr
    assert "launch local:" not in res.stdout


@pytest.mark.slow
def test_two_nodes_two_processes_rank_report() -> None:
    res = subprocess.run(launch_argv("--nodes", "2", "--nproc-per-node", "2", "--set", f"command.script={REPORT_ONLY}"),
                         env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = report_lines(res.stdout)
    assert sorted(rows) == [0, 1, 2, 3]
    assert [(rows[r]["node"], rows[r]["local"]) for r in range(4)] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {r["launcher"] for r in rows.values()} == {"torchrun"}
    assert {r["interface"] for r in rows.values()} == {"lo"}  # auto, master 127.0.0.1
    for line in res.stdout.splitlines():  # each line comes from the node that owns the rank
        m = re.match(r"\[node(\d) rank(\d)\] REPORT-OK rank=(\d)", line)
        if m:  # one prefix, node and rank, and both right
            assert int(m.group(1)) == int(m.group(3)) // 2 and m.group(2) == m.group(3)
    assert "[node0 rank0] rank report: 4 processes" in res.stdout
    assert re.search(r"node1\s*│\s*0\s*│\s*ok", res.stdout)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
def test_fail_fast_stops_the_other_nodes(tmp_path: Path) -> None:
    res = subprocess.run(launch_argv("--nodes", "2", "--nproc-per-node", "2", "--grace", "5",
                                     "--set", f"command.script={FAIL_ON_NODE}"),
                         env=clean_env(STARTED_DIR=str(tmp_path)), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"launch local: node 1 \(\S+\) failed first: exit status 1; every other node was stopped",
                     " ".join(res.stdout.split())), res.stdout[-3000:]
    assert re.search(r"node0\s*│\s*\S+\s*│\s*stopped", res.stdout)
    pids = [int(p) for p in re.findall(r"\[node0 rank\d\] STARTED node=0 local=\d pid=(\d+)", res.stdout)]
    assert len(pids) == 2 and all(_gone(p) for p in pids)


@pytest.mark.slow
def test_a_worker_fault_ends_the_launch_with_its_code_and_one_cause_line(tmp_path: Path) -> None:
    """Issue 29 item 3: the data folder is missing; every worker prints
    ddpkit's line and exits 12; torchrun's agents exit 1. The launcher exits
    12, ends with the cause once, and keeps torchrun's traceback boxes out of
    the console; they stay in the node's agent log."""
    missing = tmp_path / "no-such-data"
    res = subprocess.run(launch_argv("--nodes", "2", "--nproc-per-node", "1", "--grace", "3",
                                     "--log-dir", str(tmp_path / "logs"), "--",
                                     *TINY, "--data", "imagefolder", "--data-dir", str(missing), "--max-steps", "1",
                                     "--batch-size", "4", "--no-eval"),
                         env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == ExitCode.DATA_MISSING, out[-4000:]
    cause = [ln for ln in out.splitlines() if ln.startswith("ddpkit train: ")]
    assert len(cause) == 1 and f"--data-dir {missing} is missing on host" in cause[0], out[-4000:]
    assert sum(f"--data-dir {missing} is missing" in ln for ln in out.splitlines()) == 1, out[-4000:]
    assert out.rstrip("\n").splitlines()[-1] == cause[0], out[-2000:]
    assert "exit status 12; every other node was stopped" in " ".join(out.split()), out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    logs = [(tmp_path / "logs" / f"node{i}" / AGENT_LOG).read_text() for i in (0, 1)]
    assert any("Traceback (most recent call last):" in log and "ChildFailedError" in log for log in logs), logs


def _sigint_ignored_on_entry() -> None:
    """As for a launcher started in the background by a script: Python then
    installs no SIGINT handler of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.full  # launch local's Ctrl-C: test_stop_summary.py; nothing of a stopped run left: test_runs.py's cancel
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_all_nodes(tmp_path: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen(launch_argv("--nodes", "2", "--nproc-per-node", "1", "--grace", "5",
                                        "--set", f"command.script={FAIL_ON_NODE}"),
                            env=clean_env(FAIL_NODE="none", STARTED_DIR=str(tmp_path)), cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, preexec_fn=_sigint_ignored_on_entry)
    assert proc.stdout is not None
    out, started = [], 0
    for line in proc.stdout:
        out.append(line)
        started += "STARTED" in line
        if started == 2:
            break
    job = [proc.pid, *proctree.descendants(proc.pid)]
    proc.send_signal(sig)
    try:
        rest, _ = proc.communicate(timeout=120)
        left = [pid for pid in job[1:] if not _gone(pid)]  # before the clean-up below
    finally:  # if the launcher ignored the signal or died of it, leave none of its nodes running
        proctree.signal_all(proctree.alive(job), signal.SIGKILL)
    text = "".join(out) + rest
    assert proc.returncode == 130, text
    assert "interrupted; stopped all nodes" in text
    pids = [int(p) for p in re.findall(r"STARTED node=\d local=\d pid=(\d+)", text)]
    assert len(pids) == 2 and set(pids) <= set(job) and left == []


@pytest.mark.slow
def test_ddpkit_env_under_real_torchrun_agents() -> None:
    """`ddpkit env` run as the job: what each process resolves without a process group."""
    res = subprocess.run(launch_argv("--nodes", "2", "--nproc-per-node", "1", "--set", "command.module=ddpkit.cli",
                                     "--", "env", "--json"),
                         env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    seen = {}
    for line in res.stdout.splitlines():
        m = re.match(r"\[node(\d) rank\d\] (\{.*\})$", line)
        if m:
            seen[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(seen) == [0, 1]
    for node, got in seen.items():
        assert (got["launcher"], got["rank"], got["node_rank"], got["world_size"]) == ("torchrun", node, node, 2)
        assert (got["master_addr"], got["interface"], got["backend"]) == ("127.0.0.1", "lo", "gloo")
        assert got["host"].endswith(f"-node{node}")


def test_omp_num_threads_comes_from_the_job_unless_this_shell_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun prints its OMP_NUM_THREADS banner on every node when the variable
    is unset; the job environment sets it, and a value in this shell still wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    for nodes, nproc in (("2", "2"), ("2", "1"), ("1", "1")):  # one process per node too: it has no torchrun default
        spec = local_spec(parse("--nodes", nodes, "--nproc-per-node", nproc))
        want = str(max(1, cores // (int(nodes) * int(nproc))))  # every node's processes share this machine's cores
        assert {n.env["OMP_NUM_THREADS"] for n in build_nodes(spec, Path("/logs"))} == {want}
    spec = local_spec(parse("--nodes", "2", "--set", "resources.cpus_per_process=3"))
    assert {n.env["OMP_NUM_THREADS"] for n in build_nodes(spec, Path("/logs"))} == {"3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert {n.env["OMP_NUM_THREADS"] for n in build_nodes(spec, Path("/logs"))} == {"5"}
