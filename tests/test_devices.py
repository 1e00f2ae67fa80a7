"""The device-ownership rule (agreed.device_block): GPUs per node =
processes per node x devices per process, every target requests that many,
and each local rank owns the contiguous block [r*K, (r+1)*K)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError

from ddpkit.launch.docker import _gpu_requests
from ddpkit.shared.agreed import DeviceBlock, device_block
from ddpkit.spec import JobSpec
from ddpkit.targets import kubernetes, render, slurm
from ddpkit.train.model.strategy import StrategyError, cuda_devices
from ddpkit.train.startup.distributed import StartupError, resolve_device


@dataclass(frozen=True)
class Layout:
    """A strategy row: the spec fields and train flags, and the GPUs per node it needs."""

    fields: dict[str, Any]
    args: list[str]
    gpus_per_node: int


LAYOUTS = {
    "ddp-1-per-process": Layout({"nodes": 2, "nproc_per_node": 4}, [], 4),
    "ddp-model-split-2": Layout({"nodes": 2, "nproc_per_node": 2, "devices_per_process": 2},
                                ["--devices-per-process", "2"], 4),
    "ddp-model-split-3": Layout({"nodes": 1, "nproc_per_node": 2, "devices_per_process": 3},
                                ["--devices-per-process=3"], 6),
    "dp-4": Layout({"strategy": "dp", "devices_per_process": 4}, ["--strategy", "dp"], 4),
    "dp-balanced-8": Layout({"strategy": "dp", "devices_per_process": 8},
                            ["--strategy=dp", "--gpu0-batch", "16"], 8),
    "cpu": Layout({"device": "cpu", "nodes": 2, "nproc_per_node": 3}, [], 0),
}


def make_spec(layout: Layout, **extra: Any) -> JobSpec:
    return JobSpec.model_validate({"name": "gpujob", **layout.fields, "command": {"args": layout.args}, **extra})


def _walk(node: Any) -> Iterator[Any]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    for child in children:
        yield from _walk(child)


def k8s_gpus(spec: JobSpec) -> set[int]:
    """Every nvidia.com/gpu limit in the rendered manifests: a container's
    resources, or a TrainJob's resourcesPerNode (0: a limits block without one)."""
    docs = list(yaml.safe_load_all(render(spec, "k8s").files[kubernetes.filename(spec)]))
    limits = [n["limits"] for doc in docs for n in _walk(doc) if isinstance(n, dict) and "limits" in n]
    return {int(lim.get(kubernetes.GPU_RESOURCE, 0)) for lim in limits} or {0}


def slurm_gpus(spec: JobSpec) -> set[int]:
    """--gpus-per-node of the #SBATCH header and of the srun line (0: not requested)."""
    text = render(spec, "slurm").files[slurm.filename(spec)]
    words = [w for line in text.splitlines() for w in line.replace("#SBATCH ", " ").split()]
    found = {int(w.split("=", 1)[1]) for w in words if w.startswith("--gpus-per-node=")}
    assert text.count("--gpus-per-node=") in (0, 2), "requested in the header and again on srun, or not at all"
    return found or {0}


def compose_ids(spec: JobSpec) -> list[list[str]]:
    """Each service's reserved GPU ids, in node order."""
    doc = yaml.safe_load(render(spec, "compose").files["compose.yaml"])
    return [[i for d in svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
             for i in d["device_ids"]] for svc in doc["services"].values()]


def _per_node(ids: list[list[str]]) -> set[int]:
    """GPUs per node, after checking that no two nodes on the one host share a GPU."""
    flat = [i for node in ids for i in node]
    assert len(flat) == len(set(flat)), f"two containers on one host share a GPU: {ids}"
    return {len(node) for node in ids}


def compose_gpus(spec: JobSpec) -> set[int]:
    """compose reserves each node's own block of the host's GPUs."""
    return _per_node(compose_ids(spec))


def docker_gpus(spec: JobSpec) -> set[int]:
    """The docker launcher's DeviceRequests, per container (`docker run --gpus device=...`)."""
    return _per_node([[i for r in _gpu_requests(spec, n) for i in r.device_ids]  # type: ignore[attr-defined]
                      for n in range(spec.nodes)])


TARGETS: dict[str, tuple[dict[str, Any], Callable[[JobSpec], set[int]]]] = {
    "slurm-torchrun": ({"slurm": {"mode": "torchrun"}}, slurm_gpus),
    "slurm-srun": ({"slurm": {"mode": "srun"}}, slurm_gpus),
    "pytorchjob": ({"k8s": {"kind": "pytorchjob"}}, k8s_gpus),
    "indexed-job": ({"k8s": {"kind": "indexed-job"}}, k8s_gpus),
    "trainjob": ({"k8s": {"kind": "trainjob"}}, k8s_gpus),
    "docker": ({}, docker_gpus),
    "compose": ({}, compose_gpus),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_target_requests_the_gpus_the_layout_needs(layout: str, target: str) -> None:
    extra, read_back = TARGETS[target]
    spec = make_spec(LAYOUTS[layout], **extra)
    assert spec.gpus_per_node == LAYOUTS[layout].gpus_per_node
    assert read_back(spec) == {LAYOUTS[layout].gpus_per_node}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compose_cpu_test_reserves_no_gpu_and_runs_gloo(layout: str) -> None:
    spec = make_spec(LAYOUTS[layout], compose={"cpu_test": True})
    text = render(spec, "compose").files["compose.yaml"]
    assert compose_ids(spec) == [[]] * spec.nodes and "nvidia" not in text
    assert all(svc["environment"]["DDPKIT_BACKEND"] == "gloo" for svc in yaml.safe_load(text)["services"].values())


def test_a_cuda_compose_file_says_what_it_does_with_the_gpus() -> None:
    spec = make_spec(LAYOUTS["ddp-model-split-2"])
    assert compose_ids(spec) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    [note] = render(spec, "compose").notes["compose.yaml"]
    assert note.startswith("reserves 4 GPUs per node, 8 in all on the Docker host")
    test = make_spec(LAYOUTS["ddp-model-split-2"], compose={"cpu_test": True})
    [note] = render(test, "compose").notes["compose.yaml"]
    assert note.startswith("a gloo test of this cuda job on CPU (compose.cpu_test): no GPUs are reserved")
    assert "gloo on CPU (a test of a cuda job: compose.cpu_test)" in render(test, "compose").files["compose.yaml"]


@pytest.mark.parametrize(
    ("fields", "args", "needle"),
    [
        ({"strategy": "dp", "nproc_per_node": 2}, ["--strategy", "dp"],
         "strategy: dp runs one process, but nodes x nproc_per_node is 2; set nodes: 1"),
        ({"strategy": "dp", "nodes": 2}, ["--strategy", "dp"], "nodes x nproc_per_node is 2"),
        ({"devices_per_process": 2}, ["--devices-per-process", "1"],
         "command.args has --devices-per-process 1 but devices_per_process is 2"),
        ({}, ["--devices-per-process", "2"], "command.args has --devices-per-process 2 but devices_per_process is 1"),
        ({}, ["--strategy", "dp"], "command.args runs --strategy dp but strategy is ddp; set strategy: dp"),
        ({"strategy": "dp"}, [], "command.args runs --strategy ddp but strategy is dp"),
        ({"nproc_per_node": 16, "devices_per_process": 8}, ["--devices-per-process", "8"],
         "nproc_per_node 16 x devices_per_process 8 needs more than 64 GPUs per node"),
        ({"devices_per_process": 0}, [], "greater than or equal to 1"),
    ],
)
def test_inconsistent_layouts_are_refused_with_the_fix(fields: dict[str, Any], args: list[str], needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({"name": "gpujob", **fields, "command": {"args": args}})
    assert needle in str(err.value)


def test_devices_per_process_is_said_once_the_trainer_is_told_by_the_spec() -> None:
    """Written only as the field, it reaches ddpkit.train's command line;
    the issue was a refusal that claimed the args held `--devices-per-process 1`."""
    spec = JobSpec.model_validate({"name": "gpujob", "nodes": 2, "nproc_per_node": 4, "devices_per_process": 2,
                                   "command": {"args": ["--model", "resnet50"]}})
    assert spec.command.args == ["--model", "resnet50", "--devices-per-process", "2"]
    assert spec.gpus_per_node == 8
    assert JobSpec.model_validate(spec.model_dump()).command.args == spec.command.args  # once, not twice


def test_another_programs_flags_are_not_read() -> None:
    spec = JobSpec.model_validate({"name": "gpujob", "devices_per_process": 2,
                                   "command": {"module": "mypkg.train", "args": ["--strategy", "dp"]}})
    assert spec.gpus_per_node == 2


@pytest.mark.parametrize(
    ("local_rank", "per_process", "visible", "block"),
    [
        (0, 1, 1, [0]),
        (3, 1, 4, [3]),
        (0, 2, 4, [0, 1]),
        (1, 2, 4, [2, 3]),  # not cuda:1, which is rank 0's second GPU
        (1, 3, 8, [3, 4, 5]),
        (3, 2, 8, [6, 7]),
        (0, 8, 8, list(range(8))),  # dp: one process drives every GPU
    ],
)
def test_each_local_rank_owns_a_contiguous_block(local_rank: int, per_process: int, visible: int,
                                                 block: list[int]) -> None:
    got = device_block(local_rank, per_process, visible)
    assert got == DeviceBlock(block[0], per_process)
    assert got.indices == block and got.primary == block[0]
    assert [d.index for d in cuda_devices(local_rank, per_process, visible)] == block


def test_blocks_of_a_node_partition_its_gpus() -> None:
    nproc, per_process = 4, 2
    owned = [i for r in range(nproc) for i in device_block(r, per_process, nproc * per_process).indices]
    assert owned == list(range(nproc * per_process))


@pytest.mark.parametrize(("local_rank", "per_process", "visible"), [(1, 2, 3), (2, 1, 2), (0, 4, 2)])
def test_too_few_visible_gpus_name_the_request(local_rank: int, per_process: int, visible: int) -> None:
    with pytest.raises(ValueError, match="request nproc_per_node x devices_per_process GPUs per node"):
        device_block(local_rank, per_process, visible)
    with pytest.raises(StrategyError, match=f"--devices-per-process {per_process}: local rank {local_rank} owns"):
        cuda_devices(local_rank, per_process, visible)


def test_cpu_device_ignores_the_gpu_rule() -> None:
    assert resolve_device("cpu", 5, 3) == torch.device("cpu")


@pytest.mark.gpu
def test_resolve_device_picks_the_first_gpu_of_the_block() -> None:
    count = torch.cuda.device_count()
    assert resolve_device("cuda", 0, count) == torch.device("cuda", 0)
    assert resolve_device("cuda", count - 1, 1) == torch.device("cuda", count - 1)
    assert resolve_device("cuda", count, 1, wrap=True) == torch.device("cuda", 0)
    with pytest.raises(StartupError, match=f"sees {count}"):
        resolve_device("cuda", 1, count)
