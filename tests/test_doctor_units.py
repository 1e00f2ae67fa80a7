"""Pure parts of `ddpkit doctor`: the busbw formula against hand-computed
values, sizes, the checks that take their inputs as arguments, the tables."""

from __future__ import annotations

import io
import resource
from pathlib import Path

import pytest

from ddpkit.doctor import local, network
from ddpkit.doctor.report import merged, print_tables, rank_ranges
from ddpkit.doctor.results import BenchRow, Check, DoctorResult, Status
from ddpkit.doctor.sizes import GIB, KIB, MIB, algbw, bus_factor, busbw, message_sizes, parse_size

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
def test_busbw_matches_hand_computed(op, world, size, seconds, alg, bus):
    assert algbw(size, seconds) == pytest.approx(alg)
    assert busbw(op, size, seconds, world) == pytest.approx(bus)


def test_bus_factor_rejects_unknown_op_and_bad_world():
    with pytest.raises(ValueError, match="all_reduce"):
        bus_factor("alltoall", 4)
    with pytest.raises(ValueError):
        bus_factor("all_reduce", 0)
    with pytest.raises(ValueError):
        algbw(1024, 0.0)


def test_sizes_from_1kib_to_1gib():
    sizes = message_sizes(KIB, GIB)
    assert sizes[0] == 1024 and sizes[-1] == GIB
    assert all(b == 4 * a for a, b in zip(sizes, sizes[1:]))
    assert message_sizes(KIB, 3 * KIB) == [KIB, 3 * KIB]
    with pytest.raises(ValueError, match="above"):
        message_sizes(MIB, KIB)


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("64KiB", 64 * KIB), ("64M", 64 * MIB),
                                            ("1GiB", GIB), ("2 gb", 2 * GIB)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1.5G", "12XB", "0", "-4K"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_gpus_fewer_than_processes_fails_and_blocks():
    c = local.check_gpus(WHERE, wants_cuda=True, visible=1, local_world_size=2)
    assert c.status is Status.FAIL and c.blocking and "nproc_per_node to 1" in c.fix
    assert local.check_gpus(WHERE, wants_cuda=True, visible=0, local_world_size=1).status is Status.FAIL
    assert local.check_gpus(WHERE, wants_cuda=True, visible=8, local_world_size=4).status is Status.WARN
    assert local.check_gpus(WHERE, wants_cuda=True, visible=4, local_world_size=4).status is Status.PASS
    assert local.check_gpus(WHERE, wants_cuda=False, visible=0, local_world_size=4).status is Status.SKIP


def test_memlock_warns_only_where_it_matters():
    assert local.check_memlock(WHERE, rdma_or_gpu=True, limit=64 * KIB).status is Status.WARN
    assert local.check_memlock(WHERE, rdma_or_gpu=False, limit=64 * KIB).status is Status.PASS
    assert local.check_memlock(WHERE, rdma_or_gpu=True, limit=resource.RLIM_INFINITY).status is Status.PASS


def test_disk_threshold_and_missing_folder(tmp_path: Path):
    target = tmp_path / "not" / "yet"
    ok = local.check_disk(WHERE, target, 1)
    assert ok.status is Status.PASS and str(tmp_path) in ok.detail
    assert local.check_disk(WHERE, target, 1 << 60).status is Status.FAIL


def test_a_failure_must_carry_a_fix():
    with pytest.raises(ValueError, match="fix"):
        Check("local", "x", Status.FAIL, "broken")


def test_interface_variables_win_over_the_flag():
    env = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "^lo"}
    assert network.interface_names("auto", env) == [("NCCL_SOCKET_IFNAME", "^lo"), ("GLOO_SOCKET_IFNAME", "eth1")]
    assert network.interface_names("eth0", {}) == [("--interface / DDPKIT_INTERFACE", "eth0")]


def test_gloo_refuses_nccl_exclusion_syntax():
    c = network.check_interface("GLOO_SOCKET_IFNAME", "^lo", "127.0.0.1", 0, "h")
    assert c.status is Status.FAIL and "Gloo" in c.detail
    assert network.check_interface("NCCL_SOCKET_IFNAME", "^docker", "127.0.0.1", 0, "h").status is Status.PASS


def test_hosts_store_ordering():
    # torchrun's agent holds the store: even rank 0 can probe it.
    assert not network.hosts_store(0, "torchrun", {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    # srun / mpirun / a pod: rank 0 opens the port inside init_process_group.
    assert network.hosts_store(0, "slurm", {})
    assert not network.hosts_store(1, "slurm", {})


def test_rank_ranges():
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_ranges([3]) == "3"


def test_tables_merge_ranks_and_show_every_fix():
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
