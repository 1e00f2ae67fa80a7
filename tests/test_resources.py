"""`resources:` (CPUs per process, memory and /dev/shm per node): one
spelling that every target maps, the old per-target spellings still read
with a one-line note, and the per-target fields that say what the portable
ones cannot still winning on their target. Each check reads the rendered
file back (or the launcher's own limits), as the consumers parse it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.contract import RowKey, target_env
from ddpkit.launch.docker import _limits
from ddpkit.spec import JobSpec, docker_size, slurm_size
from ddpkit.spec.yamlfile import SpecError, dump_yaml, load_spec
from ddpkit.targets import compose, kubernetes, render, slurm, sshnode
from ddpkit.targets.kubernetes import pod
from tests.golden import K8S_KINDS, ROOT

RESOURCES = ["resources.cpus_per_process=8", "resources.memory_per_node=64Gi", "resources.shm_size=4Gi"]
OLD = ["slurm.cpus_per_process=8", "k8s.memory=64Gi", "k8s.shm_size=4Gi"]


def spec_for(*overrides: str) -> JobSpec:
    return load_spec(None, overrides=["name=rj", "nodes=2", "nproc_per_node=2", "device=cpu", *overrides])


def directives(spec: JobSpec) -> dict[str, str]:
    text = render(spec, "slurm").files["rj.sbatch"]
    return dict(d.split("=", 1) for d in slurm.parse_directives(text) if "=" in d)


def k8s_containers(spec: JobSpec) -> list[dict[str, Any]]:
    """Every training container's resources block (TrainJob: resourcesPerNode), and each pod's volumes."""
    docs = [d for d in yaml.safe_load_all(render(spec, "k8s").files[kubernetes.filename(spec)]) if d]
    if spec.k8s.kind == "trainjob":
        return [docs[0]["spec"]["trainer"]["resourcesPerNode"]]
    return [c["resources"] for p in kubernetes.pod_specs(docs, spec.k8s.kind) for c in p["containers"]]


def shm_limits(spec: JobSpec) -> set[str]:
    docs = [d for d in yaml.safe_load_all(render(spec, "k8s").files[kubernetes.filename(spec)]) if d]
    return {v["emptyDir"]["sizeLimit"] for p in kubernetes.pod_specs(docs, spec.k8s.kind) for v in p["volumes"]
            if v["name"] == pod.SHM_VOLUME}


def compose_service(spec: JobSpec) -> dict[str, Any]:
    doc = yaml.safe_load(render(spec, "compose").files[compose.FILENAME])
    return doc["services"]["node0"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_slurm_maps_every_field(mode: str) -> None:
    got = directives(spec_for(*RESOURCES, f"slurm.mode={mode}"))
    # torchrun: one task per node holds both processes; srun: one task per process
    assert got["--cpus-per-task"] == ("16" if mode == "torchrun" else "8")
    assert got["--mem"] == "64G"  # Slurm's G is binary: 64Gi


@pytest.mark.parametrize("kind", K8S_KINDS)
def test_every_kubernetes_kind_maps_every_field(kind: str) -> None:
    spec = spec_for(*RESOURCES, f"k8s.kind={kind}")
    want = {"requests": {"cpu": "16", "memory": "64Gi"}, "limits": {"cpu": "16", "memory": "64Gi"}}
    assert k8s_containers(spec) and all(r == want for r in k8s_containers(spec))
    assert shm_limits(spec) == {"4Gi"}


def test_compose_launch_docker_and_ssh_docker_map_every_field() -> None:
    spec = spec_for(*RESOURCES, "ssh.docker=true")
    svc = compose_service(spec)
    assert (svc["cpus"], svc["mem_limit"], svc["shm_size"]) == (16.0, "64g", "4g")
    lim = _limits(spec, None)  # what launch docker hands the Docker API
    assert (lim.nano_cpus, lim.memory, lim.shm_size) == (16 * 10**9, "64g", "4g")
    argv = [a.resolve({"DDPKIT_NODE_RANK": "0"}) for a in sshnode.docker_argv(spec, {})]
    assert "--cpus=16" in argv and "--memory=64g" in argv  # /dev/shm: --ipc host, the host's


def test_the_default_shm_is_the_same_everywhere() -> None:
    spec = spec_for("k8s.kind=indexed-job")
    assert shm_limits(spec) == {"8Gi"} and compose_service(spec)["shm_size"] == "8g"
    assert _limits(spec, None).shm_size == "8g"  # launch docker's own default was 1g
    assert "cpus" not in compose_service(spec) and "mem_limit" not in compose_service(spec)
    assert "--cpus-per-task" not in directives(spec) and "--mem" not in directives(spec)


@pytest.mark.parametrize("target", list(RowKey))
def test_omp_num_threads_is_cpus_per_process_on_every_target(target: RowKey) -> None:
    assert target_env(spec_for("resources.cpus_per_process=3"), target)["OMP_NUM_THREADS"] == "3"


def test_old_spellings_render_the_same_and_move_into_resources() -> None:
    for kind in K8S_KINDS:
        old, new = spec_for(*OLD, f"k8s.kind={kind}"), spec_for(*RESOURCES, f"k8s.kind={kind}")
        assert render(old, "k8s").files == render(new, "k8s").files
    old, new = spec_for(*OLD), spec_for(*RESOURCES)
    assert render(old, "slurm").files == render(new, "slurm").files
    assert old.resources == new.resources and new.deprecations == []
    assert [line.split(" is deprecated")[0] for line in old.deprecations] == [
        "note: slurm.cpus_per_process", "note: k8s.memory", "note: k8s.shm_size"]
    # the run folder's spec.yaml keeps one spelling: read back, it is the same job, without a note
    again = JobSpec.model_validate(yaml.safe_load(dump_yaml(old)))
    assert again.resources == old.resources and again.deprecations == []


def test_an_old_spelling_prints_one_note_and_the_job_renders(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ddpkit.cli", "render", "slurm", "--set", "slurm.cpus_per_process=8",
                          "-o", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == ["ddpkit render: note: slurm.cpus_per_process is deprecated; write "
                                       "resources.cpus_per_process (one spelling that every target maps)"]


def test_two_spellings_that_disagree_are_refused() -> None:
    with pytest.raises(SpecError, match=r"k8s.memory 32Gi and resources.memory_per_node 64Gi disagree; keep "
                                        r"resources.memory_per_node only"):
        spec_for("resources.memory_per_node=64Gi", "k8s.memory=32Gi")
    assert spec_for("resources.memory_per_node=64Gi", "k8s.memory=64Gi").resources.memory_per_node == "64Gi"


def test_target_only_fields_win_on_their_target() -> None:
    spec = spec_for(*RESOURCES, "k8s.cpu=500m", "slurm.mem=0", "compose.cpus_per_node=1.5")
    assert all(r["limits"]["cpu"] == "500m" for r in k8s_containers(spec))
    assert directives(spec)["--mem"] == "0"  # Slurm's "all of the node's memory"
    assert compose_service(spec)["cpus"] == 1.5
    assert target_env(spec, RowKey.SLURM)["OMP_NUM_THREADS"] == "8"
    assert target_env(spec, RowKey.COMPOSE)["OMP_NUM_THREADS"] == "1"  # 1.5 CPUs for 2 processes


def test_launch_docker_shm_size_flag_still_wins_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    lim = _limits(spec_for(*RESOURCES), "1g")
    assert (lim.shm_size, lim.memory) == ("1g", "64g")
    assert capsys.readouterr().err.startswith("launch docker: note: --shm-size is deprecated; write resources.shm_size")


@pytest.mark.parametrize(("quantity", "in_slurm", "in_docker"), [
    ("64Gi", "64G", "64g"), ("512Mi", "512M", "512m"), ("1Ti", "1T", "1099511627776b"),
    ("1.5Gi", "1536M", "1610612736b"), ("100M", "96M", "100000000b"), ("2G", "1908M", "2000000000b"),
])
def test_sizes_in_each_syntax_round_up_never_down(quantity: str, in_slurm: str, in_docker: str) -> None:
    assert (slurm_size(quantity), docker_size(quantity)) == (in_slurm, in_docker)


def test_shm_above_memory_is_refused_whatever_the_spelling() -> None:
    for overrides in (["resources.memory_per_node=4Gi"], ["k8s.memory=4Gi"], ["resources.shm_size=5Gi", "k8s.memory=4Gi"]):
        with pytest.raises(SpecError, match="is more than memory 4Gi"):
            spec_for(*overrides)
