"""Job spec validation: every error names the field, the value and the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.cli import main
from ddpkit.spec.yamlfile import SpecError, load_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(example: Path) -> None:
    spec = load_spec(example)
    assert spec.world_size == spec.nodes * spec.nproc_per_node


def test_the_agents_worker_start_is_the_users_to_set_in_env() -> None:
    spec = load_spec(None, overrides=["env.DDPKIT_AGENT_FORK=0", "env.DDPKIT_AGENT_PRELOAD=transformers"])
    assert spec.env == {"DDPKIT_AGENT_FORK": "0", "DDPKIT_AGENT_PRELOAD": "transformers"}


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("name=Bad_Name", "name: 'Bad_Name' is not a DNS-1035 label"),
        ("name=a" + "b" * 63, "at most 63 characters"),
        ("nodes=0", "nodes: Input should be greater than or equal to 1"),
        ("bogus=1", "bogus: unknown field; valid fields here: backend, command, compose"),
        ("slurm.partiton=gpu", "slurm.partiton: unknown field; valid fields here: account, constraint, container"),
        ("env.RANK=3", "'RANK' is set by the launcher"),
        ("env.PET_NNODES=3", "'PET_NNODES' is set by the launcher"),
        ("env.MASTER_PORT=1", "'MASTER_PORT' is set by the launcher"),
        ("env.DDPKIT_PREAMBLE=off", "'DDPKIT_PREAMBLE' is set by the launcher"),  # the spec's preamble: says it
        ("env.1BAD=x", "'1BAD' is not an environment variable name"),
        ("network.interface=^lo,docker", "Gloo does not accept NCCL's '^' exclusion syntax"),
        ("slurm.partition=gpu --qos=high", "slurm.partition: 'gpu --qos=high' may only hold"),
        ("slurm.time=forever", "slurm.time: 'forever' is not a Slurm time"),
        ("k8s.shm_size=lots", "k8s.shm_size: 'lots' is not a Kubernetes quantity"),
        ("k8s.memory=4Gi", "shm_size 8Gi (the default) is more than memory 4Gi: a memory-backed /dev/shm counts "
                           "against the pod's memory limit; lower shm_size or raise memory"),
        ("resources.memory_per_node=4Gi", "shm_size 8Gi (the default) is more than memory 4Gi"),
        ("k8s.kind=deployment", "k8s.kind: Input should be 'pytorchjob', 'indexed-job', 'trainjob' or 'jobset'"),
        ("command.module=a b", "command.module: 'a b' is not a dotted python module name"),
        ("master_port=80", "master_port: Input should be greater than or equal to 1024"),
    ],
)
def test_errors_name_field_value_and_fix(override: str, needle: str) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(None, overrides=[override])
    assert needle in str(err.value)


def test_set_keeps_strings_byte_exact() -> None:
    spec = load_spec(None, overrides=["env.FLAG=yes", "env.MODE=0755", "nodes=3", "slurm.exclusive=true"])
    assert spec.env == {"FLAG": "yes", "MODE": "0755"}
    assert spec.nodes == 3 and spec.slurm.exclusive is True


def test_set_keeps_annotated_text_fields_byte_exact() -> None:
    # Fields typed `SlurmTime | None`, `K8sQuantity`, ... are text too: YAML
    # would read 04:00:00 as 14400 (sexagesimal) and 0755 as 493.
    spec = load_spec(None, overrides=["slurm.time=04:00:00", "slurm.account=0755", "resources.shm_size=010",
                                      "k8s.namespace=no", "slurm.container.workdir=/null", "k8s.queue=off"])
    assert (spec.slurm.time, spec.slurm.account, spec.resources.shm_size) == ("04:00:00", "0755", "010")
    assert (spec.k8s.namespace, spec.slurm.container.workdir, spec.k8s.queue) == ("no", "/null", "off")


def test_cli_error_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["render", "compose", "--set", "env.WORLD_SIZE=8", "-o", str(out)])
    assert code == 2
    assert not out.exists()
    assert "env: 'WORLD_SIZE' is set by the launcher" in capsys.readouterr().err


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")


def test_flags_override_file() -> None:
    spec = load_spec(EXAMPLES[0], nodes=5, nproc_per_node=3, image="reg/x:1")
    assert (spec.nodes, spec.nproc_per_node, spec.image) == (5, 3, "reg/x:1")


def test_schema_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "nproc_per_node" in schema["properties"]


# ---- k8s.volumes in Kubernetes' own spelling (as the README's example writes them) ----

def _volume_spec(volume: dict[str, object]) -> dict[str, object]:
    return {"name": "v", "image": "x:1", "nodes": 2, "k8s": {"volumes": [volume]}}


@pytest.mark.parametrize(("kubernetes", "ours"), [
    ({"name": "data", "persistentVolumeClaim": {"claimName": "cifar10"}, "mountPath": "/data", "readOnly": True},
     {"name": "data", "persistent_volume_claim": "cifar10", "mount_path": "/data", "read_only": True}),
    ({"name": "h", "hostPath": {"path": "/scratch"}, "mountPath": "/s", "subPath": "a/b"},
     {"name": "h", "host_path": "/scratch", "mount_path": "/s", "sub_path": "a/b"}),
    ({"name": "c", "configMap": {"name": "cfg"}, "mountPath": "/etc/cfg"},
     {"name": "c", "config_map": "cfg", "mount_path": "/etc/cfg"}),
    ({"name": "s", "secret": {"secretName": "creds"}, "mountPath": "/creds"},
     {"name": "s", "secret": "creds", "mount_path": "/creds"}),
    ({"name": "e", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}, "mountPath": "/tmpfs"},
     {"name": "e", "empty_dir": {"medium": "Memory", "size_limit": "1Gi"}, "mount_path": "/tmpfs"}),
])
def test_kubernetes_spelling_of_a_volume_is_the_same_volume(kubernetes: dict[str, object],
                                                            ours: dict[str, object]) -> None:
    from ddpkit.spec.yamlfile import build_spec
    from ddpkit.targets import render

    a, b = build_spec(_volume_spec(kubernetes)), build_spec(_volume_spec(ours))
    assert a.k8s.volumes == b.k8s.volumes
    assert render(a, "k8s").files == render(b, "k8s").files


@pytest.mark.parametrize(("volume", "problem"), [
    ({"name": "d", "mountPath": "/d", "mount_path": "/d", "host_path": "/x"}, "both mountPath and mount_path are set"),
    ({"name": "d", "mountPath": "/d", "hostPath": {"path": "/x", "type": "Directory"}},
     "hostPath: only {path: ...} is understood here"),
])
def test_a_volume_spelt_both_ways_or_with_an_unknown_inner_key_is_one_line(volume: dict[str, object],
                                                                          problem: str) -> None:
    from ddpkit.spec.yamlfile import build_spec

    with pytest.raises(SpecError) as err:
        build_spec(_volume_spec(volume))
    assert any(problem in p and p.startswith("k8s.volumes.0") for p in err.value.problems), err.value.problems


def test_unknown_field_in_a_list_item_names_the_valid_fields() -> None:
    """The list of valid fields was empty for a field of a list's item."""
    from ddpkit.spec.yamlfile import build_spec

    with pytest.raises(SpecError) as err:
        build_spec(_volume_spec({"name": "d", "mount_path": "/d", "host_path": "/x", "bogus": 1}))
    (problem,) = err.value.problems
    assert problem.startswith("k8s.volumes.0.bogus: unknown field; valid fields here: ")
    assert "mount_path" in problem and "persistent_volume_claim" in problem


# ---- values as a user writes them in YAML ----

def test_numbers_in_env_become_their_text_and_slurm_mem_0_means_all_memory(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: e\nimage: x:1\nnodes: 2\nenv: {OMP_NUM_THREADS: 4, RATIO: 0.5}\nslurm: {mem: 0}\n")
    spec = load_spec(job)
    assert spec.env == {"OMP_NUM_THREADS": "4", "RATIO": "0.5"} and spec.slurm.mem == "0"
    assert main(["render", "slurm", "-f", str(job), "-o", str(tmp_path / "out")]) == 0
    script = (tmp_path / "out" / "e.sbatch").read_text()
    assert "#SBATCH --mem=0\n" in script and "OMP_NUM_THREADS=4\n" in script


@pytest.mark.parametrize("value", ["yes", "off", "true", "null", "~"])
def test_a_yaml_boolean_or_null_in_env_is_refused_with_quote_it(tmp_path: Path, value: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(f"name: e\nimage: x:1\nnodes: 2\nenv: {{DEBUG: {value}}}\n")
    assert main(["render", "slurm", "-f", str(job), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "env: DEBUG: YAML read this as" in err and 'quote the text you meant, e.g. DEBUG: "1"' in err
    assert not (tmp_path / "out").exists()


def test_shm_size_may_equal_memory_in_any_unit_but_not_pass_it() -> None:
    from ddpkit.spec.fields import quantity_value

    assert quantity_value("8Gi") == 8 * 2**30 and quantity_value("1.5G") == 1_500_000_000
    assert quantity_value("500m") * 2 == 1
    assert load_spec(None, overrides=["k8s.shm_size=1024Mi", "k8s.memory=1Gi"]).resources.memory_per_node == "1Gi"
    with pytest.raises(SpecError, match=r"shm_size 1025Mi is more than memory 1Gi"):
        load_spec(None, overrides=["k8s.shm_size=1025Mi", "k8s.memory=1Gi"])


def test_the_default_image_is_the_one_make_image_builds_for_the_device() -> None:
    assert load_spec(None).image == "ddpkit:cuda"
    assert load_spec(None, overrides=["device=cpu"]).image == "ddpkit:cpu"
    assert load_spec(None, overrides=["device=cpu", "image=reg.example/me/ddp:1"]).image == "reg.example/me/ddp:1"


@pytest.mark.parametrize(("fields", "gpus", "want"), [
    ({}, 8, (8, 1)),
    ({"devices_per_process": 2, "command": {"args": ["--devices-per-process", "2"]}}, 8, (4, 2)),
    ({"strategy": "dp", "command": {"args": ["--strategy", "dp"]}}, 4, (1, 4)),
])
def test_gpus_per_node_counts_gpus_not_processes(tmp_path: Path, fields: dict[str, Any], gpus: int,
                                                 want: tuple[int, int]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "g", **fields}))
    spec = load_spec(job, gpus_per_node=gpus)
    assert (spec.nproc_per_node, spec.devices_per_process) == want and spec.gpus_per_node == gpus


@pytest.mark.parametrize(("fields", "extra", "needle"), [
    ({"devices_per_process": 4, "command": {"args": ["--devices-per-process", "4"]}}, {},
     "--gpus-per-node 6 is not a multiple of devices_per_process 4; pass a multiple of 4"),
    ({"device": "cpu"}, {}, "--gpus-per-node 6: this job runs on device: cpu; pass --nproc-per-node"),
    ({}, {"nproc_per_node": 2}, "--gpus-per-node 6 and --nproc-per-node both size the node; pass one"),
])
def test_gpus_per_node_refusals(tmp_path: Path, fields: dict[str, Any], extra: dict[str, Any], needle: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "g", **fields}))
    with pytest.raises(SpecError, match=re.escape(needle)):
        load_spec(job, gpus_per_node=6, **extra)


def test_a_job_without_a_name_is_ddp_job_and_the_schema_says_so(tmp_path: Path) -> None:
    from ddpkit.spec import JobSpec

    job = tmp_path / "job.yaml"
    job.write_text("nodes: 2\n")
    assert load_spec(job).name == load_spec(None).name == "ddp-job"
    schema = JobSpec.model_json_schema()
    assert "name" not in schema.get("required", []) and schema["properties"]["name"]["default"] == "ddp-job"
