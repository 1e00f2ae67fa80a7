"""Pure parts of `ddpkit doctor`: the busbw formula against hand-computed
values, sizes, the checks that take their inputs as arguments, the tables."""

from __future__ import annotations

import io
import resource
import socket
import time
from pathlib import Path

import pytest

from ddpkit.doctor import local, network
from ddpkit.doctor.report import merged, print_tables, rank_ranges
from ddpkit.doctor.results import BenchRow, Check, DoctorResult, Status
from ddpkit.doctor.sizes import GIB, KIB, MIB, algbw, bus_factor, busbw, message_sizes, parse_size
from ddpkit.host import netif
from ddpkit.shared.exitcodes import ExitCode
from ddpkit.train.startup import netlocal, netproblem
from ddpkit.train.startup.launchinfo import LaunchInfo

WHERE = local.Where(rank=3, host="node1")


@pytest.mark.parametrize(
    ("op", "world", "size", "seconds", "alg", "bus"),
    [
        # 1 GB in 1 s = 1 GB/s; all_reduce busbw = 2(n-1)/n: n=4 -> 1.5, n=8 -> 1.75, n=2 -> 1.0
        ("all_reduce", 4, 10**9, 1.0, 1.0, 1.5),
        ("all_reduce", 8, 10**9, 1.0, 1.0, 1.75),
        ("all_reduce", 2, 10**9, 0.5, 2.0, 2.0),
        ("all_reduce", 1, 10**9, 1.0, 1.0, 0.0),
        # 64 MiB in 10 ms: 6.7108864 GB/s, x 2*15/16 = 12.582912
        ("all_reduce", 16, 64 * MIB, 0.01, 6.7108864, 12.582912),
        ("all_gather", 4, 10**9, 1.0, 1.0, 0.75),
        ("broadcast", 4, 10**9, 2.0, 0.5, 0.5),
    ],
)
def test_busbw_matches_hand_computed(op: str, world: int, size: int, seconds: float, alg: float,
                                    bus: float) -> None:
    assert algbw(size, seconds) == pytest.approx(alg)
    assert busbw(op, size, seconds, world) == pytest.approx(bus)


def test_bus_factor_rejects_unknown_op_and_bad_world() -> None:
    with pytest.raises(ValueError, match="all_reduce"):
        bus_factor("alltoall", 4)
    with pytest.raises(ValueError):
        bus_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        algbw(1024, 0.0)


def test_sizes_from_1kib_to_1gib() -> None:
    sizes = message_sizes(KIB, GIB)
    assert sizes[0] == 1024 and sizes[-1] == GIB
    assert all(b == 4 * a for a, b in zip(sizes, sizes[1:]))
    assert message_sizes(KIB, 3 * KIB) == [KIB, 3 * KIB]
    with pytest.raises(ValueError, match="above"):
        message_sizes(MIB, KIB)


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("64KiB", 64 * KIB), ("64M", 64 * MIB),
                                            ("1GiB", GIB), ("2 gb", 2 * GIB)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1.5G", "12XB", "0", "-4K"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_gpus_fewer_than_processes_fails_and_blocks() -> None:
    c = local.check_gpus(WHERE, wants_cuda=True, visible=1, local_world_size=2)
    assert c.status is Status.FAIL and c.blocking and "nproc_per_node to 1" in c.fix
    assert local.check_gpus(WHERE, wants_cuda=True, visible=0, local_world_size=1).status is Status.FAIL
    assert local.check_gpus(WHERE, wants_cuda=True, visible=8, local_world_size=4).status is Status.WARN
    assert local.check_gpus(WHERE, wants_cuda=True, visible=4, local_world_size=4).status is Status.PASS
    assert local.check_gpus(WHERE, wants_cuda=False, visible=0, local_world_size=4).status is Status.SKIP


def test_memlock_warns_only_where_it_matters() -> None:
    assert local.check_memlock(WHERE, rdma_or_gpu=True, limit=64 * KIB).status is Status.WARN
    assert local.check_memlock(WHERE, rdma_or_gpu=False, limit=64 * KIB).status is Status.PASS
    assert local.check_memlock(WHERE, rdma_or_gpu=True, limit=resource.RLIM_INFINITY).status is Status.PASS


def test_disk_threshold_and_missing_folder(tmp_path: Path) -> None:
    target = tmp_path / "not" / "yet"
    ok = local.check_disk(WHERE, target, 1)
    assert ok.status is Status.PASS and str(tmp_path) in ok.detail
    assert local.check_disk(WHERE, target, 1 << 60).status is Status.FAIL


def test_a_failure_must_carry_a_fix() -> None:
    with pytest.raises(ValueError, match="fix"):
        Check("local", "x", Status.FAIL, "broken")


def test_interface_variables_win_over_the_flag() -> None:
    env = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "^lo"}
    assert network.interface_names("auto", env) == [("NCCL_SOCKET_IFNAME", "^lo"), ("GLOO_SOCKET_IFNAME", "eth1")]
    assert network.interface_names("eth0", {}) == [("--interface / DDPKIT_INTERFACE", "eth0")]


def test_gloo_refuses_nccl_exclusion_syntax() -> None:
    c = network.check_interface("GLOO_SOCKET_IFNAME", "^lo", "127.0.0.1", 0, "h")
    assert c.status is Status.FAIL and "Gloo" in c.detail
    assert network.check_interface("NCCL_SOCKET_IFNAME", "^docker", "127.0.0.1", 0, "h").status is Status.PASS


def test_hosts_store_ordering() -> None:
    # torchrun's agent holds the store: even rank 0 can probe it.
    assert not network.hosts_store(0, "torchrun", {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    # srun / mpirun / a pod: rank 0 opens the port inside init_process_group.
    assert network.hosts_store(0, "slurm", {})
    assert not network.hosts_store(1, "slurm", {})


def test_rank_ranges() -> None:
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_ranges([3]) == "3"


def test_tables_merge_ranks_and_show_every_fix() -> None:
    checks = [Check("local", "shm", Status.PASS, "ok", rank=r, host="h") for r in range(4)]
    checks.append(Check("network", "master port", Status.FAIL, "closed", "open TCP 29500", rank=2, host="h"))
    rows = merged(checks)
    assert [(r, c.name) for r, c in rows] == [("2", "master port"), ("0-3", "shm")]
    result = DoctorResult(4, checks, [BenchRow("gloo", "all_reduce", MIB, "float32", 3, 100.0, 10.5, 15.75)])
    out = io.StringIO()
    print_tables(result, out)
    text = out.getvalue()
    assert "open TCP 29500" in text and "FAIL" in text and "15.75" in text and "1 MiB" in text
    assert result.verdict == "FAIL" and result.to_json()["verdict"] == "FAIL"


# ---- pre-join network checks (ddpkit.train.startup.netcheck) and interface auto (ddpkit.host.netif) ----

LO = netif.Interface("lo", "127.0.0.1")
ETH_DOWN = netif.Interface("eth0", "10.0.0.5", up=False)
ENS = netif.Interface("ens5", "10.1.0.7")
BARE = netif.Interface("ib0", None)
HAVE = [LO, ETH_DOWN, ENS, BARE]


@pytest.mark.parametrize(
    ("source", "value", "spans", "says"),
    [
        ("GLOO_SOCKET_IFNAME", "nosuch0", False, "no interface nosuch0"),
        ("GLOO_SOCKET_IFNAME", "eth0", False, "eth0=10.0.0.5 (down) is down"),
        ("NCCL_SOCKET_IFNAME", "ens5,ib0", False, "ib0=no IPv4 is down or has no IPv4"),
        ("GLOO_SOCKET_IFNAME", "^lo", False, "Gloo does not accept"),
        ("--interface", "lo", True, "loopback but the job spans hosts"),
    ],
)
def test_interface_problem_names_the_cause_and_offers_what_exists(source: str, value: str, spans: bool,
                                                                  says: str) -> None:
    problem = netlocal.interface_problem(source, value, spans, HAVE)
    assert problem is not None and says in problem.cause
    assert "ens5=10.1.0.7" in problem.fix and "auto" in problem.fix


@pytest.mark.parametrize(("source", "value", "spans"), [
    ("GLOO_SOCKET_IFNAME", "ens5", True), ("NCCL_SOCKET_IFNAME", "^lo,docker", True),
    ("NCCL_SOCKET_IFNAME", "=ens5", True), ("--interface", "auto", True), ("--interface", "lo", False)])
def test_interface_problem_passes_what_works(source: str, value: str, spans: bool) -> None:
    assert netlocal.interface_problem(source, value, spans, HAVE) is None


def test_env_wins_over_the_flag() -> None:
    env = {"NCCL_SOCKET_IFNAME": "a", "GLOO_SOCKET_IFNAME": "b"}
    assert netlocal.interface_settings("auto", env) == [("NCCL_SOCKET_IFNAME", "a"), ("GLOO_SOCKET_IFNAME", "b")]
    assert netlocal.interface_settings("ens5", {}) == [("--interface", "ens5")]


def test_default_route_is_read_from_the_route_table(tmp_path: Path) -> None:
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
                     "ens5\t0000010A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                     "ens6\t00000000\t0100010A\t0003\t0\t0\t0\t00000000\n")
    assert netif.default_route_interface(table) == "ens6"
    assert netif.default_route_interface(tmp_path / "absent") is None


def _host(monkeypatch: pytest.MonkeyPatch, have: list[netif.Interface], own: list[str], default: str | None,
          resolves: str = "127.0.1.1") -> None:
    """This host as `auto` sees it: its interfaces, its name's addresses,
    its default route, and what the master's name resolves to here."""
    monkeypatch.setattr(netif, "interfaces", lambda: have)
    monkeypatch.setattr(netif, "_own_name_addresses", lambda: own)
    monkeypatch.setattr(netif, "default_route_interface", lambda: default)
    monkeypatch.setattr(netif, "resolve_ipv4", lambda host: resolves)


def test_auto_on_node0_takes_the_interface_holding_this_hosts_address(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, HAVE + [netif.Interface("ens6", "10.2.0.9")], own=["10.1.0.7"], default="ens6")
    picked = netif.choose("node0")
    assert picked.name == "ens5" and "loopback" in picked.reason and "10.1.0.7" in picked.reason


def test_auto_on_node0_falls_back_to_the_default_route_then_the_only_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, HAVE + [netif.Interface("ens6", "10.2.0.9")], own=[], default="ens6")
    assert netif.choose("node0") == netif.Choice("ens6", "node0 -> 127.0.1.1 (loopback) here; ens6 carries the "
                                                 "default route")
    _host(monkeypatch, HAVE, own=[], default="eth0")  # the default route's interface is down: never it
    assert netif.choose("node0").name == "ens5"


def test_auto_never_picks_a_down_interface_and_keeps_loopback_for_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, [LO, ETH_DOWN], own=["10.0.0.5"], default="eth0")
    assert netif.choose("node0").name == "lo"  # nothing else is up: the multi-host check then refuses it
    _host(monkeypatch, HAVE, own=["10.1.0.7"], default="ens5", resolves="127.0.0.1")
    assert netif.choose("localhost").name == "lo" and netif.choose("127.0.0.1").name == "lo"


def _launch(launcher: str, rank: int, master: str, node_rank: int | None = None) -> LaunchInfo:
    return LaunchInfo(launcher, rank=rank, local_rank=0, world_size=2, local_world_size=1,
                      node_rank=rank if node_rank is None else node_rank, master_addr=master, master_port=29500,
                      init_method="env://")


def test_who_opens_the_store() -> None:
    pod0 = netproblem.Peers.from_launch(_launch("pytorchjob", 0, "job-master-0"), {})
    pod1 = netproblem.Peers.from_launch(_launch("pytorchjob", 1, "job-master-0"), {})
    agent = netproblem.Peers.from_launch(_launch("torchrun", 0, "n0"), {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    local = netproblem.Peers.from_launch(_launch("slurm", 1, "127.0.0.1", node_rank=0), {})
    assert (pod0.hosts_store, pod0.joins_store, pod0.spans_hosts) == (True, True, True)
    assert (pod1.hosts_store, pod1.joins_store, pod1.on_master_node) == (False, True, False)
    assert not agent.joins_store and not agent.hosts_store  # torchrun's agent already met its peers
    assert not local.spans_hosts  # a master named 127.0.0.1 means one machine


def test_a_port_someone_listens_on_is_in_use_and_a_closed_one_is_unreachable() -> None:
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        busy = netlocal.port_in_use_problem(port)
        assert busy is not None and f"master port {port} is already in use" in busy.cause and "ss -ltnp" in busy.fix
    assert netlocal.port_in_use_problem(port) is None
    started = time.monotonic()
    gone = netlocal.connect_problem("127.0.0.1", port, window=0.6)
    assert gone is not None and "Connection refused" in gone.cause and "firewall" in gone.fix
    assert 0.4 < time.monotonic() - started < 5  # retried for the window, not forever


def test_a_bad_window_is_a_start_up_error_with_its_own_code() -> None:
    with pytest.raises(netproblem.NetCheckError, match="DDPKIT_RENDEZVOUS_WINDOW='soon'") as err:
        netproblem.window_s({"DDPKIT_RENDEZVOUS_WINDOW": "soon"})
    assert err.value.exit_code == ExitCode.STARTUP
    assert netproblem.window_s({}) == netproblem.DEFAULT_WINDOW_S
