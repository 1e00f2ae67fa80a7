"""Job spec validation: every error names the field, the value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.specfile import SpecError, load_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(example: Path) -> None:
    spec = load_spec(example)
    assert spec.world_size == spec.nodes * spec.nproc_per_node


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
        ("env.1BAD=x", "'1BAD' is not an environment variable name"),
        ("network.interface=^lo,docker", "Gloo does not accept NCCL's '^' exclusion syntax"),
        ("slurm.partition=gpu --qos=high", "slurm.partition: 'gpu --qos=high' may only hold"),
        ("slurm.time=forever", "slurm.time: 'forever' is not a Slurm time"),
        ("k8s.shm_size=lots", "k8s.shm_size: 'lots' is not a Kubernetes quantity"),
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
