"""The Kubernetes renderer: PyTorchJob, Indexed Job + Service, TrainJob, JobSet.

No API server can run here, so each manifest is checked the way its consumer
would check it: built-in kinds with `kubernetes-validate --strict`, the CRDs
against their OpenAPI schemas (vendored from upstream, tests/schemas/), and
every pod's command expanded as the kubelet would with the variables its
controller injects (tests/emulators.controller_env)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.cli import main as cli_main
from ddpkit.contract import RowKey, sources, torchrun_argv
from ddpkit.render.engine import RenderError
from ddpkit.rendezvous import runkey
from ddpkit.spec import JobSpec, doctor_mode
from ddpkit.spec.yamlfile import SpecError, load_spec
from ddpkit.targets import kubernetes, render
from ddpkit.targets.kubernetes import pod as k8s_pod
from tests.emulators import check_views, controller_env, node_views
from tests.expansion import kubelet_container_env, kubelet_expand

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KINDS = ("pytorchjob", "indexed-job", "trainjob", "jobset")
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSIONS = ("1.33.0", "1.37.0")  # an older supported release and the newest the tool knows


def make_spec(kind: str = "pytorchjob", **fields: Any) -> JobSpec:
    k8s = {"kind": kind, **fields.pop("k8s", {})}
    return JobSpec.model_validate({"name": fields.pop("name", "demo"), "k8s": k8s, **fields})


def render_docs(spec: JobSpec, *, doctor: bool = False) -> list[dict[str, Any]]:
    text = render(doctor_mode(spec) if doctor else spec, "k8s").files[kubernetes.filename(spec)]
    return [d for d in yaml.safe_load_all(text) if d is not None]


FULL = {
    "nodes": 3,
    "nproc_per_node": 2,
    "env": {"NCCL_DEBUG": "INFO", "HF_HOME": "/cache"},
    "k8s": {
        "namespace": "ml",
        "cpu": "8",
        "memory": "64Gi",
        "shm_size": "4Gi",
        "node_selector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "image_pull_secrets": ["regcred"],
        "image_pull_policy": "Always",
        "clean_pod_policy": "Running",
        "backoff_limit": 2,
        "ttl_seconds_after_finished": 600,
    },
}


def full_spec(kind: str, **extra: Any) -> JobSpec:
    fields: dict[str, Any] = copy.deepcopy(FULL)
    fields["k8s"].update(extra.pop("k8s", {}))
    return make_spec(kind, **fields, **extra)


# ---- pods as the kubelet would start them ----


def pods(spec: JobSpec, docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(container, injected env) for every pod, in node-rank order."""
    kind = spec.k8s.kind
    target = kubernetes.KIND_TARGET[kind]
    if kind == "pytorchjob":
        specs = docs[0]["spec"]["pytorchReplicaSpecs"]
        containers = [specs["Master"]["template"]["spec"]["containers"][0]]
        if "Worker" in specs:
            containers += [specs["Worker"]["template"]["spec"]["containers"][0]] * specs["Worker"]["replicas"]
    elif kind == "indexed-job":
        job = next(d for d in docs if d["kind"] == "Job")
        containers = [job["spec"]["template"]["spec"]["containers"][0]] * job["spec"]["completions"]
    elif kind == "jobset":
        (rjob,) = docs[0]["spec"]["replicatedJobs"]
        job_spec = rjob["template"]["spec"]
        containers = [job_spec["template"]["spec"]["containers"][0]] * job_spec["completions"] * rjob["replicas"]
    else:
        trainer = docs[0]["spec"]["trainer"]
        containers = [{"name": "node", **trainer}] * trainer["numNodes"]
    return [(c, controller_env(spec, target, i)) for i, c in enumerate(containers)]


def started_argv(container: dict[str, Any], injected: dict[str, str]) -> list[str]:
    env = kubelet_container_env(container.get("env", []), injected)
    return [kubelet_expand(a, env) for a in container["command"]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_every_pod_runs_the_contract_line(kind: str, rdzv: str, nodes: int) -> None:
    spec = make_spec(kind, nodes=nodes, nproc_per_node=2, rendezvous={"backend": rdzv})
    target = kubernetes.KIND_TARGET[kind]
    argv = torchrun_argv(spec, sources(spec, target))
    views = node_views(spec, target)
    assert check_views(views) == []
    started = [started_argv(c, inj) for c, inj in pods(spec, render_docs(spec))]
    assert len(started) == nodes
    for i, got in enumerate(started):
        assert got == [a.resolve(controller_env(spec, target, i)) for a in argv]
        if rdzv == "static":
            assert f"--node-rank={views[i].node_rank}" in got
            assert f"--master-addr={views[0].host}" in got
    assert not any("$(" in a for line in started for a in line), "an unexpanded $(VAR) reached a process"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_render_and_verify(kind: str, example: Path) -> None:
    spec = load_spec(example, overrides=[f"k8s.kind={kind}"])
    first = render(spec, "k8s").files
    assert render(spec, "k8s").files == first, "same spec, same bytes"


# ---- validation by the consumers' own rules ----


def _write_docs(tmp_path: Path, docs: list[dict[str, Any]], stem: str) -> list[Path]:
    paths = []
    for i, doc in enumerate(docs):
        path = tmp_path / f"{stem}-{i}.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        paths.append(path)
    return paths


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_indexed_job_and_service_pass_kubernetes_validate_strict(tmp_path: Path, version: str) -> None:
    paths = []
    for name, spec in {
        "minimal": make_spec("indexed-job"),
        "full": full_spec("indexed-job"),
        "cpu": make_spec("indexed-job", nodes=2, device="cpu", k8s={"cpu": "500m"}),
    }.items():
        text = render(spec, "k8s").files[kubernetes.filename(spec)]
        path = tmp_path / f"{name}.yaml"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    result = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "-k", version, *paths],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == 2 * len(paths), result.stdout


def test_kubernetes_validate_strict_catches_a_typo(tmp_path: Path) -> None:
    """The validator above can fail: an unknown field is refused."""
    docs = render_docs(make_spec("indexed-job"))
    docs[1]["spec"]["completionMod"] = docs[1]["spec"].pop("completionMode")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", K8S_VERSIONS[-1], str(path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0


def strict_schema(schema: Any) -> Any:
    """The CRD schema with unknown fields refused, as `kubectl apply
    --validate=strict` does (the API server prunes them silently otherwise)."""
    if isinstance(schema, dict):
        out = {k: strict_schema(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_schema(v) for v in schema]
    return schema


CRD_SCHEMAS = {"pytorchjob": "pytorchjob-kubeflow.org-v1.json", "trainjob": "trainjob-trainer.kubeflow.org-v1alpha1.json",
               "jobset": "jobset-jobset.x-k8s.io-v1alpha2.json", "podgroup": "podgroup-scheduling.volcano.sh-v1beta1.json"}


def check_against_crd(tmp_path: Path, kind: str, docs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    schema = strict_schema(json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text(encoding="utf-8")))
    schema_path = tmp_path / f"{kind}.schema.json"
    schema_path.write_text(json.dumps(schema), encoding="utf-8")
    paths = _write_docs(tmp_path, docs, kind)
    return subprocess.run(
        [str(BIN / "check-jsonschema"), "--schemafile", str(schema_path), *map(str, paths)],
        capture_output=True, text=True, check=False,
    )


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob", "jobset"])
def test_crd_kinds_match_the_upstream_crd_schema(tmp_path: Path, kind: str) -> None:
    docs = render_docs(make_spec(kind)) + render_docs(full_spec(kind)) + render_docs(
        make_spec(kind, nodes=1, device="cpu"))
    result = check_against_crd(tmp_path, kind, docs)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob", "jobset"])
def test_crd_schema_check_catches_a_wrong_field(tmp_path: Path, kind: str) -> None:
    docs = render_docs(make_spec(kind))
    docs[0]["spec"][{"pytorchjob": "runPolicyy", "trainjob": "trainerr", "jobset": "networkk"}[kind]] = {}
    assert check_against_crd(tmp_path, kind, docs).returncode != 0


# ---- PyTorchJob details ----


def test_pytorchjob_shape() -> None:
    spec = full_spec("pytorchjob")
    (doc,) = render_docs(spec)
    s = doc["spec"]
    assert s["nprocPerNode"] == "2"  # *string in kubeflow.org/v1
    assert s["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 2, "ttlSecondsAfterFinished": 600}
    assert {r: v["replicas"] for r, v in s["pytorchReplicaSpecs"].items()} == {"Master": 1, "Worker": 2}
    for role in ("Master", "Worker"):
        rs = s["pytorchReplicaSpecs"][role]
        assert rs["restartPolicy"] == "OnFailure"  # backoff_limit > 0
        pod = rs["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == spec.image and c["imagePullPolicy"] == "Always"
        assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}]
        assert c["resources"] == {
            "requests": {"cpu": "8", "memory": "64Gi"},
            "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
        }
        assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert doc["metadata"]["namespace"] == "ml"


def test_pytorchjob_single_node_has_no_worker_and_cpu_has_no_gpu() -> None:
    (doc,) = render_docs(make_spec("pytorchjob", nodes=1, device="cpu", master_port=31000))
    specs = doc["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Master"]
    c = specs["Master"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["ports"][0]["containerPort"] == 31000
    assert specs["Master"]["restartPolicy"] == "Never"  # backoff_limit 0
    assert "ttlSecondsAfterFinished" not in doc["spec"]["runPolicy"]


# ---- Indexed Job details ----


def test_indexed_job_service_names_the_pods() -> None:
    spec = full_spec("indexed-job")
    svc, job = render_docs(spec)
    assert svc["kind"] == "Service" and job["kind"] == "Job"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 3, 3)
    assert job["spec"]["backoffLimit"] == 2 and job["spec"]["ttlSecondsAfterFinished"] == 600
    assert pod["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    hosts = [v.host for v in node_views(spec, RowKey.INDEXED_JOB)]
    assert hosts == [f"demo-{i}.{svc['metadata']['name']}" for i in range(3)]


# ---- TrainJob details ----


def test_trainjob_shape() -> None:
    spec = full_spec("trainjob", k8s={"runtime": "torch-distributed-h100"})
    (doc,) = render_docs(spec)
    t = doc["spec"]["trainer"]
    assert doc["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "torch-distributed-h100"}
    assert (t["numNodes"], t["numProcPerNode"], t["image"]) == (3, 2, spec.image)
    assert t["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "2"
    assert not {e["name"] for e in t["env"]} & kubernetes.TRAINJOB_RESERVED_ENV
    (patch,) = doc["spec"]["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert rjob["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_trainjob_refuses_reserved_env() -> None:
    spec = make_spec("trainjob")
    # The spec already refuses PET_*; build() checks again because the torch
    # plugin's list is the authority for this kind.
    object.__setattr__(spec, "env", {"PET_NODE_RANK": "3"})
    with pytest.raises(SpecError, match="PET_NODE_RANK"):
        kubernetes.build(spec)


# ---- --doctor swaps the command and nothing else ----


@pytest.mark.parametrize("kind", KINDS)
def test_doctor_swaps_only_the_command(kind: str) -> None:
    spec = full_spec(kind)
    plain, doctor = render_docs(spec), render_docs(spec, doctor=True)
    commands = []
    for docs in (plain, doctor):
        for c, _ in pods(spec, docs):
            commands.append(c["command"])
        text = json.dumps(docs)
        docs[:] = json.loads(re.sub(r'"command": \[[^\]]*\]', '"command": []', text))
    assert plain == doctor
    assert commands[-1][-2:] == ["-m", "ddpkit.doctor"] and commands[0][-2:] != ["-m", "ddpkit.doctor"]


# ---- verify() applies the operators' rules ----

TAMPER = {
    "pytorchjob": [
        ('"Master":\n      replicas: 1', '"Master":\n      replicas: 2', "one Master"),
        ('- name: "pytorch"', '- name: "torch"', "pytorch"),
        ('"--max-restarts=0"', '"--max-restarts=3"', "command"),
        ('value: "INFO"', 'value: "WARN"', "env"),
        ('nprocPerNode: "2"', "nprocPerNode: 2", "nprocPerNode"),
        ('name: "pytorchjob-port"', 'name: "port"', "pytorchjob-port"),
    ],
    "indexed-job": [
        ('clusterIP: "None"', 'clusterIP: "10.0.0.1"', "headless"),
        ('subdomain: "demo"', 'subdomain: "other"', "subdomain"),
        ("completions: 3", "completions: 2", "Indexed"),
        ('"ddpkit.io/job": "demo"\n  ports', '"ddpkit.io/job": "other"\n  ports', "selector"),
    ],
    "trainjob": [
        ("numNodes: 3", "numNodes: 2", "numNodes"),
        ('name: "torch-distributed"', 'name: "mpi-distributed"', "runtimeRef"),
        ('- name: "HF_HOME"', '- name: "PET_NNODES"', "reserved"),
    ],
    "jobset": [
        ("enableDNSHostnames: true", "enableDNSHostnames: false", "enableDNSHostnames"),
        ("replicas: 1", "replicas: 2", "replicas 1"),
        ("completions: 3", "completions: 2", "Indexed"),
        ("maxRestarts: 2", "maxRestarts: 0", "maxRestarts"),
        ('restartPolicy: "Never"', 'restartPolicy: "OnFailure"', "restartPolicy Never"),
        ('- name: "node"\n                  image', '- name: "trainer"\n                  image', "container is named"),
    ],
}


@pytest.mark.parametrize(("kind", "old", "new", "message"),
                         [(k, *t) for k, items in TAMPER.items() for t in items])
def test_verify_rejects_a_broken_manifest(kind: str, old: str, new: str, message: str) -> None:
    spec = full_spec(kind)
    rendered = render(spec, "k8s")
    name = kubernetes.filename(spec)
    assert old in rendered.files[name], f"tamper target {old!r} not found"
    rendered.files[name] = rendered.files[name].replace(old, new, 1)
    with pytest.raises(RenderError, match=message):
        kubernetes.verify(spec, rendered)


# ---- bad input: exit 2, nothing written ----


@pytest.mark.parametrize(("kind", "nodes", "longest"), [
    ("pytorchjob", 12, "-worker-10"), ("indexed-job", 100, "-99"), ("trainjob", 12, "-node-0-11"),
    ("jobset", 12, "-node-0-11-abcde"),  # the JobSet webhook counts the pod name's random suffix
])
def test_name_too_long_for_pod_hostnames(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          kind: str, nodes: int, longest: str) -> None:
    name = "a" * (63 - len(longest) + 1)
    out = tmp_path / "out"
    code = cli_main(["render", "k8s", "--set", f"name={name}", "--set", f"k8s.kind={kind}",
                     "--nodes", str(nodes), "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "name:" in err and f"at most {len(name) - 1} characters" in err
    assert not out.exists()
    # One character shorter fits.
    assert cli_main(["render", "k8s", "--set", f"name={name[1:]}", "--set", f"k8s.kind={kind}",
                     "--nodes", str(nodes), "-o", str(out)]) == 0


# ---- secrets: valueFrom.secretKeyRef in every kind, valid for the API server ----

SECRETS = [{"name": "WANDB_API_KEY"}, "HF_TOKEN", {"name": "S3_KEY", "k8s": {"secret": "s3-creds", "key": "secret-key"}}]


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "trainjob", "jobset"])
def test_secrets_are_secret_key_refs_that_pass_the_schemas(tmp_path: Path, kind: str) -> None:
    spec = full_spec(kind, secrets=SECRETS, k8s={"secret": "train-keys"})
    docs = render_docs(spec)
    want = [{"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "train-keys", "key": "WANDB_API_KEY"}}},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "train-keys", "key": "HF_TOKEN"}}},
            {"name": "S3_KEY", "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "secret-key"}}}]
    envs = ([docs[0]["spec"]["trainer"]["env"]] if kind == "trainjob"
            else [c["env"] for pod in kubernetes.pod_specs(docs, kind) for c in pod["containers"]])
    assert envs and all([e for e in env if "secretKeyRef" in e.get("valueFrom", {})] == want for env in envs), envs
    if kind == "indexed-job":
        path = tmp_path / "secrets.yaml"
        path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
        result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", K8S_VERSIONS[-1], str(path)],
                                capture_output=True, text=True, check=False)
    else:
        result = check_against_crd(tmp_path, kind, docs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_secret_without_a_kubernetes_source_is_refused_with_the_fix() -> None:
    spec = make_spec("pytorchjob", secrets=["WANDB_API_KEY", {"name": "HF_TOKEN", "k8s": {"secret": "hf"}}])
    with pytest.raises(SpecError) as err:
        render(spec, "k8s")
    assert err.value.problems == [
        "secrets: ['WANDB_API_KEY'] have no Kubernetes Secret to come from; set k8s.secret (a Secret with a key of "
        "each name), or give each entry its own k8s: {secret: NAME, key: KEY}"]


def test_verify_catches_a_secret_ref_that_differs() -> None:
    spec = make_spec("indexed-job", secrets=["HF_TOKEN"], k8s={"secret": "keys"})
    rendered = render(spec, "k8s")
    name = kubernetes.filename(spec)
    rendered.files[name] = rendered.files[name].replace('key: "HF_TOKEN"', 'key: "hf"')
    with pytest.raises(RenderError, match="valueFrom items differ"):
        kubernetes.verify(spec, rendered)


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "trainjob", "jobset"])
def test_every_pod_gets_the_secrets_values_from_the_secret(kind: str) -> None:
    """As the kubelet resolves the items (tests/expansion.py): every pod of
    the job gets each value from its Secret, `$(...)` and all, as it is."""
    value = "it's $(HOME) $$ `id` \nline"
    spec = make_spec(kind, nodes=3, secrets=SECRETS, k8s={"secret": "train-keys"})
    data = {"train-keys": {"WANDB_API_KEY": value, "HF_TOKEN": "hf"}, "s3-creds": {"secret-key": value + "3"}}
    seen = [kubelet_container_env(c.get("env", []), injected, data) for c, injected in pods(spec, render_docs(spec))]
    assert len(seen) == 3
    assert all((e["WANDB_API_KEY"], e["HF_TOKEN"], e["S3_KEY"]) == (value, "hf", value + "3") for e in seen)
    with pytest.raises(KeyError):  # a key the Secret lacks: the pod does not start
        kubelet_container_env(pods(spec, render_docs(spec))[0][0]["env"], {}, {"train-keys": {}, "s3-creds": {}})


# ---- the run key: the owning Job's uid, through the downward API ------------------------------


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "trainjob", "jobset"])
def test_every_pod_of_one_job_gets_the_jobs_uid_as_its_run_key(kind: str) -> None:
    """As the kubelet resolves the items: every pod of one Job reads the same
    key from the label the Job controller sets (a PyTorchJob's pods carry no
    uid they share: they run unkeyed, and no item asks for one)."""
    spec = make_spec(kind, nodes=3)
    labels = {k8s_pod.JOB_UID_LABEL: "0d6f5a3e-5c1b-4d57-9a7e-3f1c2b8e4a10"}
    seen = [kubelet_container_env(c.get("env", []), injected, labels=labels).get(runkey.ENV)
            for c, injected in pods(spec, render_docs(spec))]
    assert seen == ([None] * 3 if kind == "pytorchjob" else [labels[k8s_pod.JOB_UID_LABEL]] * 3)


def test_verify_catches_a_run_key_item_that_differs() -> None:
    spec = make_spec("indexed-job")
    rendered = render(spec, "k8s")
    name = kubernetes.filename(spec)
    rendered.files[name] = rendered.files[name].replace(k8s_pod.JOB_UID_LABEL, "job-name")
    with pytest.raises(RenderError, match="valueFrom items differ"):
        kubernetes.verify(spec, rendered)
