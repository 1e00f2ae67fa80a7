"""The rank contract, target by target (the table in docs/CONTRACT.md, contract.CONTRACT), as data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddpkit.contract import RowKey, hosts_for, master_port
from ddpkit.shared.agreed import slurm_port_for_job
from ddpkit.spec import JobSpec
from tests.emulators import check_views, controller_env, node_views, process_views

SHAPES = [(1, 1), (2, 4), (3, 2), (5, 1)]
RDZV = ["static", "c10d"]


def spec_for(target: RowKey, nodes: int, nproc: int, rdzv: str = "static") -> JobSpec:
    hosts = {"ssh": {"hosts": [f"gpu{i:02d}.example" for i in range(nodes)]}} if target == RowKey.SSH else {}
    return JobSpec.model_validate(
        {"name": "job", "nodes": nodes, "nproc_per_node": nproc, "rendezvous": {"backend": rdzv}, **hosts})


@pytest.mark.parametrize("target", list(RowKey))
@pytest.mark.parametrize(("nodes", "nproc"), SHAPES)
@pytest.mark.parametrize("rdzv", RDZV)
def test_node_ranks_are_a_permutation_and_node0_hosts_the_master(target: RowKey, nodes: int, nproc: int,
                                                                  rdzv: str) -> None:
    spec = spec_for(target, nodes, nproc, rdzv)
    views = node_views(spec, target)
    assert check_views(views) == []
    assert sorted(v.node_rank for v in views) == list(range(nodes))
    node0 = next(v for v in views if v.node_rank == 0)
    assert {v.master_addr for v in views} == {node0.host} or node0.host.startswith(views[0].master_addr)
    assert all(v.world_size == nodes * nproc for v in views)
    ranks = [p.rank for v in views for p in process_views(v)]
    assert sorted(ranks) == list(range(nodes * nproc))
    for v in views:
        for p in process_views(v):
            assert p.rank == v.node_rank * nproc + p.local_rank


# What each controller injects on node i of N (P processes per node), per
# the contract table (tests/emulators.py plays the controllers); {i}, {n}, {p}, {w} are filled in below.
INJECTED = {
    RowKey.SLURM: {"SLURM_NODEID": "{i}", "SLURM_JOB_NUM_NODES": "{n}", "SLURM_JOB_ID": "4242"},
    RowKey.SLURM_SRUN: {"SLURM_NODEID": "{i}", "SLURM_JOB_NUM_NODES": "{n}"},
    RowKey.PYTORCHJOB: {
        "RANK": "{i}", "PET_NODE_RANK": "{i}", "WORLD_SIZE": "{w}", "PET_NNODES": "{n}",
        "PET_NPROC_PER_NODE": "{p}", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
        "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456", "PYTHONUNBUFFERED": "1",
    },
    RowKey.INDEXED_JOB: {"JOB_COMPLETION_INDEX": "{i}"},
    RowKey.JOBSET: {"JOB_COMPLETION_INDEX": "{i}"},
    RowKey.TRAINJOB: {
        "PET_NODE_RANK": "{i}", "PET_NNODES": "{n}", "PET_NPROC_PER_NODE": "{p}",
        "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500",
    },
    RowKey.SSH: {"DDPKIT_NODE_RANK": "{i}"},
    RowKey.COMPOSE: {"DDPKIT_NODE_RANK": "{i}"},
    RowKey.LOCAL: {"DDPKIT_NODE_RANK": "{i}"},
}

MASTER = {
    RowKey.SLURM: ("node1", slurm_port_for_job(4242)),
    RowKey.SLURM_SRUN: ("node1", slurm_port_for_job(4242)),
    RowKey.PYTORCHJOB: ("job-master-0", 23456),
    RowKey.INDEXED_JOB: ("job-0.job", 29500),
    RowKey.TRAINJOB: ("job-node-0-0.job", 29500),
    RowKey.JOBSET: ("job-node-0-0.job", 29500),
    RowKey.SSH: ("gpu00.example", 29500),
    RowKey.COMPOSE: ("node0", 29500),
    RowKey.LOCAL: ("127.0.0.1", 29500),
}


def test_every_target_is_in_the_tables() -> None:
    assert set(INJECTED) == set(RowKey) == set(MASTER)


@pytest.mark.parametrize("target", list(RowKey))
def test_injected_variables_match_the_design_table(target: RowKey) -> None:
    n, p = 3, 2
    spec = spec_for(target, n, p)
    for i in range(n):
        got = controller_env(spec, target, i)
        want = {k: v.format(i=i, n=n, p=p, w=n * p) for k, v in INJECTED[target].items()}
        assert want.items() <= got.items(), f"{target.value} node {i}: {got}"


@pytest.mark.parametrize("target", list(RowKey))
def test_master_address_and_port(target: RowKey) -> None:
    views = node_views(spec_for(target, 3, 2), target)
    assert {(v.master_addr, v.master_port) for v in views} == {MASTER[target]}


@pytest.mark.parametrize("target", list(RowKey))
def test_fixed_master_port_wins_everywhere(target: RowKey) -> None:
    spec = spec_for(target, 2, 1).model_copy(update={"master_port": 31337})
    assert master_port(spec, target) == 31337
    assert {v.master_port for v in node_views(spec, target)} == {31337}


def test_slurm_port_follows_the_job_id() -> None:
    spec = spec_for(RowKey.SLURM, 2, 1)
    assert master_port(spec, RowKey.SLURM) is None
    ports = {node_views(spec, RowKey.SLURM, job_id=j)[0].master_port for j in (100, 101)}
    assert len(ports) == 2, "two jobs on the same nodes must not share a port"


def test_pytorchjob_pod_names_follow_the_operator() -> None:
    spec = spec_for(RowKey.PYTORCHJOB, 3, 1)
    assert hosts_for(spec, RowKey.PYTORCHJOB) == ["job-master-0", "job-worker-0", "job-worker-1"]


def test_ssh_ranks_follow_the_hostfile_order() -> None:
    spec = spec_for(RowKey.SSH, 3, 1)
    hosts = ["c", "a", "b"]
    views = node_views(spec, RowKey.SSH, hosts=hosts)
    assert [(v.host, v.node_rank) for v in views] == [("c", 0), ("a", 1), ("b", 2)]
    assert {v.master_addr for v in views} == {"c"}


def test_check_views_finds_broken_contracts() -> None:
    """The checker above can fail: duplicate ranks, a disagreeing master and
    a master that is not node 0 are all reported."""
    views = node_views(spec_for(RowKey.COMPOSE, 3, 2), RowKey.COMPOSE)
    assert check_views([views[0], views[0], views[2]])
    assert check_views([views[0], views[1], replace(views[2], master_addr="elsewhere")])
    moved = [replace(v, master_addr="node2") for v in views]
    assert any("not node 0" in p for p in check_views(moved))


# ---- OMP_NUM_THREADS: set by ddpkit so torchrun never prints its banner


def _omp_spec(**fields: object) -> JobSpec:
    return JobSpec.model_validate({"name": "omp", "nodes": 2, "nproc_per_node": 2, **fields})


@pytest.mark.parametrize("target", [t for t in RowKey if t is not RowKey.SLURM_SRUN])
def test_omp_num_threads_is_one_per_process_as_torchrun_would_set_it(target: RowKey) -> None:
    from ddpkit.contract import target_env
    from ddpkit.shared import envnames

    assert target_env(_omp_spec(), target)[envnames.OMP_NUM_THREADS] == "1"


def test_omp_num_threads_is_the_cpus_per_process_where_the_spec_knows_them() -> None:
    from ddpkit.contract import target_env
    from ddpkit.shared import envnames

    omp = envnames.OMP_NUM_THREADS
    assert target_env(_omp_spec(slurm={"cpus_per_process": 6}), RowKey.SLURM)[omp] == "6"
    assert target_env(_omp_spec(slurm={"cpus_per_process": 6, "mode": "srun"}), RowKey.SLURM_SRUN)[omp] == "6"
    assert target_env(_omp_spec(k8s={"cpu": "8"}), RowKey.PYTORCHJOB)[omp] == "4"  # a pod's 8 CPUs, 2 processes
    assert target_env(_omp_spec(k8s={"cpu": "3"}), RowKey.JOBSET)[omp] == "1"  # rounded down
    assert target_env(_omp_spec(k8s={"cpu": "500m"}), RowKey.INDEXED_JOB)[omp] == "1"  # never below 1
    assert target_env(_omp_spec(compose={"cpus_per_node": 6}), RowKey.COMPOSE)[omp] == "3"


def test_omp_num_threads_is_left_alone_where_torchrun_never_set_it_or_the_user_did() -> None:
    from ddpkit.contract import target_env
    from ddpkit.shared import envnames

    omp = envnames.OMP_NUM_THREADS
    assert omp not in target_env(_omp_spec(nproc_per_node=1), RowKey.SLURM)  # torchrun sets it only for N > 1
    assert omp not in target_env(_omp_spec(slurm={"mode": "srun"}), RowKey.SLURM_SRUN)  # no torchrun there
    assert target_env(_omp_spec(env={"OMP_NUM_THREADS": "12"}), RowKey.SLURM)[omp] == "12"


@pytest.mark.parametrize("target", ["slurm", "k8s", "ssh", "compose"])
def test_every_rendered_target_sets_omp_num_threads(target: str) -> None:
    from ddpkit.targets import render

    rendered = render(_omp_spec(image="ddpkit:cpu", device="cpu", backend="gloo"), target)
    assert any("OMP_NUM_THREADS" in text for text in rendered.files.values()), list(rendered.files)


# ---- resolve: the contract once, as one typed plan ----

def test_resolve_gathers_what_the_piecemeal_calls_gave() -> None:
    """The plan is the same line, environment, hosts and port the separate calls give."""
    from ddpkit.contract import resolve, sources, target_env, torchrun_argv

    for target in RowKey:
        spec = spec_for(target, 3, 2, "c10d")
        plan = resolve(spec, target)
        assert (plan.target, plan.hosts, plan.port) == (target, hosts_for(spec, target), master_port(spec, target))
        assert plan.env == target_env(spec, target)
        if target is not RowKey.SLURM_SRUN:  # srun starts each process: no torchrun line
            assert plan.argv == torchrun_argv(spec, sources(spec, target))


def test_resolve_says_what_ddpkit_injects_and_where_a_launcher_adds_its_own() -> None:
    from ddpkit.contract import FromNode, resolve

    spec = spec_for(RowKey.COMPOSE, 3, 1)
    assert [v["DDPKIT_NODE_RANK"] for v in resolve(spec, RowKey.COMPOSE).node_vars] == ["0", "1", "2"]
    assert resolve(spec_for(RowKey.SLURM, 3, 1), RowKey.SLURM).node_vars == ()  # Slurm injects its own
    srun = resolve(spec_for(RowKey.SLURM_SRUN, 2, 1), RowKey.SLURM_SRUN)
    assert "ddpkit.agent" not in [a.resolve({}) for a in srun.argv]
    ssh = resolve(spec_for(RowKey.SSH, 2, 1), RowKey.SSH, ["a", "b"], master_addr=FromNode("MASTER_ADDR"))
    assert ssh.hosts == ["a", "b"] and ssh.sources.master_addr == FromNode("MASTER_ADDR")


def test_resolve_gives_an_elastic_jobs_timeouts_only_where_it_can_run() -> None:
    from ddpkit.contract import resolve

    elastic = JobSpec.model_validate({"name": "job", "nodes": 3, "elastic": {"min_nodes": 2}})
    assert resolve(elastic, RowKey.PYTORCHJOB).rdzv_conf is not None
    local = resolve(elastic, RowKey.LOCAL, store_host="1")
    env = {"DDPKIT_NODE_RANK": "0", "DDPKIT_RDZV_ID": "run-1"}
    conf = next(w for w in (a.resolve(env) for a in local.argv) if w.startswith("--rdzv-conf="))
    assert conf.endswith(",is_host=1") and local.rdzv_conf is not None
    assert resolve(spec_for(RowKey.PYTORCHJOB, 3, 1), RowKey.PYTORCHJOB).rdzv_conf is None
