"""The targets matrix's cross-module bookkeeping (tests/helpers/matrix.py):
a difference between two targets is found whichever finished first, and a
run where part of the matrix skipped beside real targets does not pass."""

from __future__ import annotations

from typing import Any

from tests.helpers import matrix


def _records(interface: str, **change: Any) -> list[dict[str, Any]]:
    rows = []
    for rank in range(4):
        row = {"kind": "rank_report", "rank": rank, "local_rank": rank % 2, "node_rank": rank // 2,
               "world_size": 4, "master_port": 29500, "interface": interface, "host": f"h{rank // 2}",
               "pid": 100 + rank, "launcher": "torchrun", "env": {"HOSTILE": "x"}}
        rows.append(row | (change if rank == 3 else {}))
    return rows


def test_targets_that_agree_have_no_disagreements() -> None:
    # Hosts, pids and (for launch local) the interface may differ.
    assert matrix.disagreements("launch local", _records("lo"), "launch ssh", _records("eth0")) == []


def test_a_field_that_differs_is_named_either_way_round() -> None:
    ours, theirs = _records("eth0", env={"HOSTILE": "y"}), _records("eth0")
    for a, b in ((ours, theirs), (theirs, ours)):
        [diff] = matrix.disagreements("slurm srun", a, "launch ssh", b)
        assert diff.field == "rank 3 env"


def test_the_interface_counts_between_remote_targets() -> None:
    [diff] = matrix.disagreements("slurm srun", _records("eth1"), "launch ssh", _records("eth0"))[:1]
    assert diff.field == "rank 0 interface"


def test_part_of_the_matrix_skipped_beside_a_real_target_is_missing() -> None:
    passed = {nodeid: ("passed", True) for nodeid in matrix.TARGET_TESTS.values()}
    assert matrix.missing_targets(passed) == []
    docker = matrix.TARGET_TESTS["launch docker"]
    assert matrix.missing_targets(passed | {docker: ("skipped", True)}) == ["launch docker"]


def test_a_run_without_root_or_with_part_selected_checks_only_what_ran() -> None:
    local = matrix.TARGET_TESTS["launch local"]
    no_root = {nodeid: ("skipped", True) for nodeid in matrix.TARGET_TESTS.values()} | {local: ("passed", False)}
    assert matrix.missing_targets(no_root) == []
    assert matrix.missing_targets({matrix.TARGET_TESTS["slurm srun"]: ("passed", True)}) == []
