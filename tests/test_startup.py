"""Start-up: launcher detection (table-driven, fake environments), interface
selection, and real gloo processes started by --spawn and by hand (tcp://, file://)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.contract import RowKey
from ddpkit.host import netif
from ddpkit.launch.local import free_port
from ddpkit.shared.agreed import slurm_port_for_job
from ddpkit.spec import JobSpec
from ddpkit.train.startup.distributed import add_startup_arguments
from ddpkit.train.startup.launchinfo import LaunchInfo, StartupError, detect_launch, parse_hostlist
from tests.emulators import controller_env

ROOT = Path(__file__).resolve().parents[1]
REPORT_ONLY = ROOT / "tests" / "helpers" / "report_only.py"
PY = sys.executable


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_startup_arguments(parser)
    return parser.parse_args(list(argv))


def fake_expand(nodelist: str) -> list[str]:
    return parse_hostlist(nodelist)


SLURM_SPEC = JobSpec(name="j", nodes=2, nproc_per_node=4)
SLURM_NODE1 = {k: v for k, v in controller_env(SLURM_SPEC, RowKey.SLURM_SRUN, 1, job_id=777).items()
               if k not in ("MASTER_ADDR", "MASTER_PORT")}

# (case, env, argv, expected LaunchInfo)
CASES = [
    ("alone", {}, [], LaunchInfo("single", 0, 0, 1, 1, 0, None, None, "env://")),
    ("torchrun", {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                  "MASTER_ADDR": "n0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}, [],
     LaunchInfo("torchrun", 5, 1, 8, 4, 1, "n0", 29500, "env://")),
    # torchrun inside a Kubeflow pod: the worker's own variables win over the
    # operator's RANK (= pod index); PET_NODE_RANK is the node when GROUP_RANK is absent.
    ("torchrun-kubeflow", {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                           "PET_NODE_RANK": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4",
                           "MASTER_ADDR": "j-master-0", "MASTER_PORT": "23456"}, [],
     LaunchInfo("torchrun", 6, 2, 8, 4, 1, "j-master-0", 23456, "env://")),
    ("slurm-per-gpu", {**SLURM_NODE1, "SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_LOCALID": "2",
                       "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}, [],
     LaunchInfo("slurm", 6, 2, 8, 4, 1, "gpu07", slurm_port_for_job(777), "env://")),
    ("slurm-exported-master", {"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2",
                               "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "9",
                               "MASTER_ADDR": "head", "MASTER_PORT": "31000"}, [],
     LaunchInfo("slurm", 1, 1, 2, 2, 0, "head", 31000, "env://")),
    # The batch script itself (no step) is not a rank of the job.
    ("slurm-batch-shell", {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "9"}, [],
     LaunchInfo("single", 0, 0, 1, 1, 0, None, None, "env://")),
    ("openmpi", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "h0"}, [],
     LaunchInfo("mpi", 3, 1, 4, 2, 1, "h0", 29500, "env://")),
    ("openmpi-mpi-backend", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, ["--backend", "mpi"],
     LaunchInfo("mpi", 0, 0, 2, 1, 0, None, 29500, "env://")),
    ("pytorchjob-no-torchrun", {**controller_env(JobSpec(name="j", nodes=3), RowKey.PYTORCHJOB, 2)}, [],
     LaunchInfo("pytorchjob", 2, 0, 3, 1, 2, "j-master-0", 23456, "env://")),
    ("manual-tcp", {}, ["--init-method", "tcp://10.0.0.1:23456", "--rank", "1", "--world-size", "2"],
     LaunchInfo("manual", 1, 0, 2, 1, None, "10.0.0.1", 23456, "tcp://10.0.0.1:23456")),
    ("manual-file", {}, ["--init-method", "file:///shared/rdzv", "--rank", "0", "--world-size", "3"],
     LaunchInfo("manual", 0, 0, 3, 1, None, None, None, "file:///shared/rdzv")),
    ("manual-env", {"MASTER_ADDR": "m", "MASTER_PORT": "1234", "RANK": "1", "WORLD_SIZE": "2"},
     ["--init-method", "env://"], LaunchInfo("manual", 1, 0, 2, 1, None, "m", 1234, "env://")),
    # Flags beat whatever a launcher left in the environment.
    ("manual-beats-torchrun", {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"},
     ["--init-method", "tcp://h:1", "--rank", "0", "--world-size", "2"],
     LaunchInfo("manual", 0, 1, 2, 2, None, "h", 1, "tcp://h:1")),
]


@pytest.mark.parametrize("case,env,argv,expected", CASES, ids=[c[0] for c in CASES])
def test_detect_launch(case: str, env: dict[str, str], argv: list[str], expected: LaunchInfo) -> None:
    assert detect_launch(env, parse(*argv), expand=fake_expand) == expected


BAD = [
    ("rank-not-int", {"RANK": "one", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, [], "RANK='one' is not an integer"),
    ("rank-outside-world", {}, ["--init-method", "tcp://h:1", "--rank", "2", "--world-size", "2"],
     "rank 2 is outside 0..1"),
    ("manual-no-rank", {}, ["--init-method", "tcp://h:1"], "needs --rank R and --world-size W"),
    ("manual-bad-url", {}, ["--init-method", "http://h:1", "--rank", "0", "--world-size", "1"],
     "use tcp://HOST:PORT, file:///PATH or env://"),
    ("tcp-no-port", {}, ["--init-method", "tcp://h", "--rank", "0", "--world-size", "1"], "write tcp://HOST:PORT"),
    ("env-no-master", {}, ["--init-method", "env://", "--rank", "0", "--world-size", "1"],
     "needs MASTER_ADDR and MASTER_PORT"),
    ("mpirun-gloo-no-master", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, [],
     "mpirun -x MASTER_ADDR"),
    ("pytorchjob-nproc-without-torchrun", {**controller_env(JobSpec(name="j", nodes=2, nproc_per_node=4),
                                                            RowKey.PYTORCHJOB, 1)}, [],
     "start the container with torchrun"),
    ("slurm-no-nodelist", {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, [],
     "export MASTER_ADDR"),
]


@pytest.mark.parametrize("case,env,argv,message", BAD, ids=[c[0] for c in BAD])
def test_detect_launch_refuses(case: str, env: dict[str, str], argv: list[str], message: str) -> None:
    with pytest.raises(StartupError, match=message.replace("(", r"\(").replace(".", r"\.")):
        detect_launch(env, parse(*argv), expand=fake_expand)


def test_parse_hostlist() -> None:
    assert parse_hostlist("gpu[07-09,12],cpu1") == ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1"]


def test_flag_defaults_come_from_the_rendered_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_BACKEND", "gloo")
    monkeypatch.setenv("DDPKIT_INTERFACE", "eth9")
    args = parse()
    assert (args.backend, args.interface) == ("gloo", "eth9")


# ---- interfaces -------------------------------------------------------------

def test_interfaces_include_loopback_with_its_address() -> None:
    assert netif.Interface("lo", "127.0.0.1") in netif.interfaces()


def test_auto_interface_is_lo_for_a_loopback_master(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in netif.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    assert netif.route_interface("127.0.0.1") == "lo"
    assert netif.apply_interface("auto", "localhost") == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_auto_interface_matches_the_routing_table() -> None:
    """For a remote master, the pick is the interface `ip route get` names."""
    remote = "198.51.100.7"  # TEST-NET-2: reached through the default route, if any
    out = subprocess.run(["ip", "-o", "route", "get", remote], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("no route to a remote address here (or no `ip`)")
    words = out.stdout.split()
    assert netif.route_interface(remote) == words[words.index("dev") + 1]


def test_auto_interface_on_the_master_itself_is_not_lo() -> None:
    """On node 0 the master address is its own: the kernel would route that
    over lo, but peers must reach the interface that carries the address."""
    own = [i for i in netif.interfaces() if i.address and not i.address.startswith("127.")]
    if not own:
        pytest.skip("no non-loopback IPv4 interface here")
    assert own[0].address is not None  # filtered above
    assert netif.route_interface(own[0].address) == own[0].name


def test_interface_already_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    assert netif.apply_interface("auto", "127.0.0.1") == "lo"


def test_named_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in netif.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(netif.InterfaceError, match="interface nosuch0 not found on this host"):
        netif.apply_interface("lo,nosuch0", None)
    with pytest.raises(netif.InterfaceError, match="exclusion"):
        netif.apply_interface("^lo", None)
    assert netif.apply_interface("lo", None) == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"


# ---- ddpkit env -------------------------------------------------------------

def ddpkit(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD", "SLURM_", "OMPI_",
                                                                         "PET_", "MASTER_", "GLOO_", "NCCL_"))}
    return subprocess.run([PY, "-m", "ddpkit.cli", *argv], env={**clean, **(env or {})}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_ddpkit_env_under_torchrun_variables() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    out = ddpkit("env", "--json", env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert {k: got[k] for k in ("launcher", "rank", "local_rank", "node_rank", "world_size", "master_port",
                                "interface", "address", "backend", "device")} == {
        "launcher": "torchrun", "rank": 3, "local_rank": 1, "node_rank": 1, "world_size": 4,
        "master_port": 29999, "interface": "lo", "address": "127.0.0.1", "backend": "gloo", "device": "cpu"}


def test_ddpkit_env_bad_input_exits_2() -> None:
    out = ddpkit("env", "--init-method", "tcp://127.0.0.1:1", "--rank", "0")
    assert out.returncode == 2
    assert "needs --rank R and --world-size W" in out.stderr
    out = ddpkit("env", "--device", "cpu", "--backend", "nccl")
    assert out.returncode == 2 and "--backend nccl needs GPUs" in out.stderr


# ---- real processes ---------------------------------------------------------

def report_lines(text: str) -> dict[int, dict[str, str]]:
    rows = {}
    for line in text.splitlines():
        if "REPORT-OK" in line:
            fields = dict(f.split("=", 1) for f in line.split("REPORT-OK", 1)[1].split())
            rows[int(fields["rank"])] = fields
    return rows


def run_ranks(argvs: list[list[str]], env: dict[str, str] | None = None,
              timeout: float = 180) -> list[subprocess.CompletedProcess[str]]:
    """Start every process of a manual job at once, wait for all."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD", "MASTER_",
                                                                        "GLOO_", "NCCL_", "DDPKIT_"))}
    procs = [subprocess.Popen([PY, str(REPORT_ONLY), *argv], env={**base, **(env or {})}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argvs]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.slow
def test_spawn_two_processes() -> None:
    [res] = run_ranks([["--spawn", "2"]])
    assert res.returncode == 0, res.stderr
    rows = report_lines(res.stdout)
    assert sorted(rows) == [0, 1]
    assert {r["launcher"] for r in rows.values()} == {"spawn"}
    assert [rows[r]["local"] for r in (0, 1)] == ["0", "1"]
    assert "rank report: 2 processes" in res.stdout


@pytest.mark.slow
def test_manual_tcp_init_two_processes() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    results = run_ranks([["--init-method", url, "--rank", str(r), "--world-size", "2"] for r in (0, 1)])
    for res in results:
        assert res.returncode == 0, res.stderr
    rows = {**report_lines(results[0].stdout), **report_lines(results[1].stdout)}
    assert sorted(rows) == [0, 1]
    # One host, node rank not given: both are node 0, local ranks from rank order.
    assert [(rows[r]["node"], rows[r]["local"]) for r in (0, 1)] == [("0", "0"), ("0", "1")]
    assert {rows[r]["interface"] for r in (0, 1)} == {"lo"}
    assert "rank report: 2 processes" in results[0].stdout


@pytest.mark.slow
def test_manual_file_init_two_processes(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/rendezvous"
    results = run_ranks([["--init-method", url, "--rank", str(r), "--world-size", "2"] for r in (0, 1)])
    for res in results:
        assert res.returncode == 0, res.stderr
    rows = {**report_lines(results[0].stdout), **report_lines(results[1].stdout)}
    assert sorted(rows) == [0, 1] and {r["launcher"] for r in rows.values()} == {"manual"}


def test_ddpkit_run_refuses_a_bad_srun_task_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # an srun task whose launch environment cannot give the torchrun variables: one line, exit 2
    from ddpkit.run import prepare

    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    with pytest.raises(SystemExit) as ended:
        prepare(["train.py"], env)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpkit.run: ") and "export MASTER_ADDR" in err and err.count("\n") == 1, err
