"""Kubernetes options for real GPU clusters: volumes, security context and
Pod Security level, RDMA / host network, fail-fast fields. Each rendered
manifest is also checked by the consumers' own validators (kubernetes-validate
--strict, the vendored CRD schemas) in tests/test_render_k8s.py's helpers."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from ddpkit.cli import main as cli_main
from ddpkit.render.engine import RenderError
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import kubernetes, podsecurity, render
from ddpkit.targets.podsecurity import Level
from tests.test_render_k8s import (
    BIN,
    EXAMPLES,
    K8S_VERSIONS,
    KINDS,
    check_against_crd,
    make_spec,
    render_docs,
)

VOLUMES: list[dict[str, Any]] = [
    {"name": "data", "mount_path": "/data", "read_only": True, "persistent_volume_claim": "cifar-data"},
    {"name": "ckpt", "mount_path": "/ckpt", "persistent_volume_claim": "ckpts", "sub_path": "run1"},
    {"name": "cfg", "mount_path": "/etc/train", "config_map": "train-cfg"},
    {"name": "token", "mount_path": "/var/run/token", "read_only": True, "secret": "hf-token"},
    {"name": "scratch", "mount_path": "/scratch", "empty_dir": {"size_limit": "100Gi"}},
]
NFS = {"name": "shared", "mount_path": "/shared", "nfs": {"server": "10.0.0.5", "path": "/exports/ml"}}
HOST = {"name": "nvme", "mount_path": "/nvme", "host_path": "/mnt/nvme0"}
RESUME = ["--checkpoint-dir=/ckpt/run", "--resume=auto"]


def pod_specs(spec: JobSpec) -> list[dict[str, Any]]:
    return kubernetes.pod_specs(render_docs(spec), spec.k8s.kind)


def main_container(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod["containers"]
    return c


# ---- volumes ----


@pytest.mark.parametrize("kind", KINDS)
def test_volumes_are_rendered_alike_in_every_kind(kind: str) -> None:
    spec = make_spec(kind, nodes=2, k8s={"volumes": VOLUMES + [NFS, HOST]})
    for pod in pod_specs(spec):
        assert pod["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "cifar-data", "readOnly": True}},
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpts"}},
            {"name": "cfg", "configMap": {"name": "train-cfg"}},
            {"name": "token", "secret": {"secretName": "hf-token"}},
            {"name": "scratch", "emptyDir": {"sizeLimit": "100Gi"}},
            {"name": "shared", "nfs": {"server": "10.0.0.5", "path": "/exports/ml"}},
            {"name": "nvme", "hostPath": {"path": "/mnt/nvme0", "type": "Directory"}},
        ]
        assert main_container(pod)["volumeMounts"] == [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "data", "mountPath": "/data", "readOnly": True},
            {"name": "ckpt", "mountPath": "/ckpt", "subPath": "run1"},
            {"name": "cfg", "mountPath": "/etc/train"},
            {"name": "token", "mountPath": "/var/run/token", "readOnly": True},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "shared", "mountPath": "/shared"},
            {"name": "nvme", "mountPath": "/nvme"},
        ]


@pytest.mark.parametrize(("volume", "message"), [
    ({"name": "a", "mount_path": "/a"}, "exactly one"),
    ({"name": "a", "mount_path": "/a", "secret": "s", "config_map": "c"}, "exactly one"),
    ({"name": "dshm", "mount_path": "/a", "secret": "s"}, "ddpkit's /dev/shm"),
    ({"name": "a", "mount_path": "/dev/shm/", "secret": "s"}, "/dev/shm is mounted by ddpkit"),
    ({"name": "a", "mount_path": "data", "secret": "s"}, "absolute path"),
    ({"name": "a", "mount_path": "/a", "secret": "s", "sub_path": "../x"}, "relative path"),
    ({"name": "A_b", "mount_path": "/a", "secret": "s"}, "DNS-1123 label"),
    ({"name": "a", "mount_path": "/a", "persistent_volume_claim": "Bad_Claim"}, "object name"),
])
def test_bad_volume_is_refused_with_its_reason(volume: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make_spec("pytorchjob", k8s={"volumes": [volume]})


def test_two_volumes_on_one_path_are_refused() -> None:
    with pytest.raises(ValidationError, match="mount_path.*appears twice"):
        make_spec("pytorchjob", k8s={"volumes": [{"name": "a", "mount_path": "/x", "secret": "s"},
                                                 {"name": "b", "mount_path": "/x/", "secret": "t"}]})


# ---- --resume auto needs a shared checkpoint volume ----


@pytest.mark.parametrize(("args", "volumes", "warned"), [
    (RESUME, [], True),
    (["--checkpoint-dir", "/ckpt/run", "--resume", "auto"], [], True),
    (RESUME, [{"name": "c", "mount_path": "/ckpt", "persistent_volume_claim": "c"}], False),
    (RESUME, [{"name": "c", "mount_path": "/ckpt/run", "nfs": {"server": "s", "path": "/e"}}], False),
    (RESUME, [{"name": "c", "mount_path": "/ckpt", "persistent_volume_claim": "c", "read_only": True}], True),
    (RESUME, [{"name": "c", "mount_path": "/ckpt", "empty_dir": {}}], True),  # dies with the pod
    (RESUME, [{"name": "c", "mount_path": "/ck", "persistent_volume_claim": "c"}], True),  # not a parent
    (RESUME, [{"name": "c", "mount_path": "/ckpt/run/sub", "persistent_volume_claim": "c"}], True),
    (["--checkpoint-dir=/ckpt/run"], [], False),  # no resume asked
])
def test_resume_auto_without_shared_checkpoint_volume_warns(
        args: list[str], volumes: list[dict[str, Any]], warned: bool) -> None:
    spec = make_spec("indexed-job", command={"args": args}, k8s={"volumes": volumes})
    warning = kubernetes.resume_warning(spec)
    assert (warning is not None) == warned
    if warning:
        assert "--checkpoint-dir /ckpt/run" in warning and "mount_path: /ckpt" in warning


def test_resume_warning_reaches_stderr_and_the_render_succeeds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["render", "k8s", "--set", "k8s.kind=indexed-job", "--set", "command.args=" + repr(RESUME),
            "-o", str(tmp_path)]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert "warning: k8s: --resume auto" in err and "Fix: add to k8s.volumes" in err
    assert (tmp_path / "ddp-job.indexed-job.yaml").exists()


# ---- security context and the Pod Security level ----


@pytest.mark.parametrize("kind", KINDS)
def test_default_container_meets_restricted(kind: str) -> None:
    spec = make_spec(kind, k8s={"run_as_user": 4242, "volumes": VOLUMES})
    text = render(spec, "k8s").files[kubernetes.filename(spec)]
    assert text.startswith("# Pod Security Standard: restricted")
    for pod in pod_specs(spec):
        sc = main_container(pod)["securityContext"]
        assert sc == {"runAsNonRoot": True, "runAsUser": 4242, "allowPrivilegeEscalation": False,
                      "seccompProfile": {"type": "RuntimeDefault"}, "capabilities": {"drop": ["ALL"]}}
        assert podsecurity.restricted_problems(pod) == [] and podsecurity.baseline_problems(pod) == []


@pytest.mark.parametrize(("k8s", "level"), [
    ({"volumes": [NFS]}, Level.BASELINE),  # restricted allows no nfs volume
    ({"volumes": [HOST]}, Level.PRIVILEGED),  # baseline allows no hostPath
    ({"rdma": {"count": 2}}, Level.PRIVILEGED),  # IPC_LOCK is not in baseline's list
    ({"host_network": True}, Level.PRIVILEGED),
])
@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "jobset"])
def test_privileged_asks_lower_the_reported_level(
        kind: str, k8s: dict[str, Any], level: Level, capsys: pytest.CaptureFixture[str]) -> None:
    spec = make_spec(kind, k8s=k8s)
    rendered = render(spec, "k8s")
    text = rendered.files[kubernetes.filename(spec)]
    assert text.split("\n", 1)[0] == f"# Pod Security Standard: {level.value}"
    assert f"meets Pod Security level {level.value}" in rendered.notes[kubernetes.filename(spec)]
    assert capsys.readouterr().err == "", "a target returns its notes; the CLI prints them"


def test_rdma_adds_the_resource_and_ipc_lock_and_host_network_its_dns_policy() -> None:
    spec = make_spec("indexed-job", k8s={"rdma": {"resource": "rdma/hca_shared_devices_a", "count": 2},
                                         "host_network": True,
                                         "pod_annotations": {"k8s.v1.cni.cncf.io/networks": "ib0-net"}})
    job = render_docs(spec)[1]
    pod = job["spec"]["template"]
    c = main_container(pod["spec"])
    assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "2"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert pod["spec"]["hostNetwork"] is True and pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["metadata"]["annotations"] == {"k8s.v1.cni.cncf.io/networks": "ib0-net"}


def test_trainjob_refuses_host_network_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="TrainJob cannot set it"):
        make_spec("trainjob", k8s={"host_network": True})


def test_verify_rejects_a_wrong_pod_security_line() -> None:
    spec = make_spec("pytorchjob", k8s={"volumes": [HOST]})
    rendered = render(spec, "k8s")
    name = kubernetes.filename(spec)
    rendered.files[name] = rendered.files[name].replace(": privileged", ": restricted", 1)
    with pytest.raises(RenderError, match="Pod Security level its pods meet"):
        kubernetes.verify(spec, rendered)


# Table from "Pod Security Standards" (kubernetes.io/docs/concepts/security/
# pod-security-standards/), one row per control: a pod that breaks it, and the level left.
RESTRICTED_CONTAINER: dict[str, Any] = {"name": "c", "securityContext": {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"},
    "capabilities": {"drop": ["ALL"]}}}


def _pod(container_sc: dict[str, Any] | None = None, **pod: Any) -> dict[str, Any]:
    c = copy.deepcopy(RESTRICTED_CONTAINER)
    c["securityContext"].update(container_sc or {})
    return {"containers": [c], **pod}


@pytest.mark.parametrize(("pod", "level"), [
    (_pod(), Level.RESTRICTED),
    (_pod(volumes=[{"name": "v", "persistentVolumeClaim": {"claimName": "x"}}]), Level.RESTRICTED),
    (_pod({"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}), Level.RESTRICTED),
    # runAsNonRoot / seccomp may come from the pod instead of the container
    (_pod({"runAsNonRoot": None, "seccompProfile": None},
          securityContext={"runAsNonRoot": True, "seccompProfile": {"type": "Localhost"}}), Level.RESTRICTED),
    (_pod({"allowPrivilegeEscalation": True}), Level.BASELINE),
    (_pod({"runAsNonRoot": False}), Level.BASELINE),
    (_pod({"runAsUser": 0}), Level.BASELINE),
    (_pod({"seccompProfile": None}), Level.BASELINE),
    (_pod({"capabilities": {"drop": ["NET_RAW"]}}), Level.BASELINE),
    (_pod({"capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}), Level.BASELINE),
    (_pod(volumes=[{"name": "v", "nfs": {"server": "s", "path": "/"}}]), Level.BASELINE),
    (_pod({"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}), Level.PRIVILEGED),
    (_pod({"privileged": True}), Level.PRIVILEGED),
    (_pod({"seccompProfile": {"type": "Unconfined"}}), Level.PRIVILEGED),
    (_pod({"procMount": "Unmasked"}), Level.PRIVILEGED),
    (_pod(hostNetwork=True), Level.PRIVILEGED),
    (_pod(hostPID=True), Level.PRIVILEGED),
    (_pod(hostIPC=True), Level.PRIVILEGED),
    (_pod(volumes=[{"name": "v", "hostPath": {"path": "/"}}]), Level.PRIVILEGED),
    ({"containers": [{**RESTRICTED_CONTAINER, "ports": [{"containerPort": 80, "hostPort": 80}]}]},
     Level.PRIVILEGED),
])
def test_pod_security_rules(pod: dict[str, Any], level: Level) -> None:
    for c in pod["containers"]:
        c["securityContext"] = {k: v for k, v in c["securityContext"].items() if v is not None}
    assert podsecurity.level(pod) == level


# ---- fail-fast ----


def test_fail_fast_fields_in_every_kind() -> None:
    k8s = {"termination_grace_s": 120, "active_deadline_s": 7200}
    (pj,) = render_docs(make_spec("pytorchjob", nodes=2, k8s=k8s))
    assert pj["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"  # the default now
    assert pj["spec"]["runPolicy"]["activeDeadlineSeconds"] == 7200
    _, job = render_docs(make_spec("indexed-job", nodes=2, k8s=k8s))
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    assert job["spec"]["podFailurePolicy"]["rules"][1] == {
        "action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "NotIn", "values": [0]}}
    (tj,) = render_docs(make_spec("trainjob", nodes=2, k8s=k8s))
    assert tj["spec"]["activeDeadlineSeconds"] == 7200
    for kind in KINDS:
        for pod in pod_specs(make_spec(kind, nodes=2, k8s=k8s)):
            assert pod["terminationGracePeriodSeconds"] == 120


def test_indexed_job_with_retries_counts_a_failure_instead_of_failing_the_job() -> None:
    _, job = render_docs(make_spec("indexed-job", k8s={"backoff_limit": 3}))
    assert job["spec"]["podFailurePolicy"]["rules"][1]["action"] == "Count"


# ---- the upstream validators accept every option ----

EVERYTHING = {"volumes": VOLUMES + [NFS, HOST], "rdma": {"count": 1}, "host_network": True,
              "pod_annotations": {"k8s.v1.cni.cncf.io/networks": "ib0"}, "active_deadline_s": 60,
              "termination_grace_s": 30, "backoff_limit": 1}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_indexed_job_with_every_option_passes_kubernetes_validate_strict(tmp_path: Path, version: str) -> None:
    spec = make_spec("indexed-job", nodes=2, k8s=EVERYTHING)
    path = tmp_path / "job.yaml"
    path.write_text(render(spec, "k8s").files[kubernetes.filename(spec)], encoding="utf-8")
    result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", version, str(path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob", "jobset"])
def test_crd_kinds_with_every_option_match_the_upstream_schema(tmp_path: Path, kind: str) -> None:
    k8s = {k: v for k, v in EVERYTHING.items() if not (kind == "trainjob" and k == "host_network")}
    docs = render_docs(make_spec(kind, nodes=3, k8s=k8s))
    result = check_against_crd(tmp_path, kind, docs)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- gang scheduling: Kueue and Volcano ----


@pytest.mark.parametrize("kind", ["pytorchjob", "indexed-job", "trainjob", "jobset"])
def test_kueue_queue_labels_the_job_object_and_creates_it_suspended(kind: str) -> None:
    docs = render_docs(make_spec(kind, nodes=2, k8s={"queue": "team-a"}))
    obj = kubernetes.job_object(docs)
    assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert (obj["spec"]["runPolicy"] if kind == "pytorchjob" else obj["spec"])["suspend"] is True
    plain = kubernetes.job_object(render_docs(make_spec(kind, nodes=2)))
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    assert "suspend" not in (plain["spec"]["runPolicy"] if kind == "pytorchjob" else plain["spec"])


@pytest.mark.parametrize("kind", ["indexed-job", "jobset"])
def test_volcano_podgroup_for_kinds_without_a_native_field(kind: str) -> None:
    docs = render_docs(make_spec(kind, nodes=3, k8s={"scheduler": "volcano"}))
    (group,) = [d for d in docs if d["kind"] == "PodGroup"]
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["spec"] == {"minMember": 3}
    for pod in pod_specs(make_spec(kind, nodes=3, k8s={"scheduler": "volcano"})):
        assert pod["schedulerName"] == "volcano"
    templates = [d["spec"]["template"]["metadata"] for d in docs if d["kind"] == "Job"] or [
        r["template"]["spec"]["template"]["metadata"] for r in docs[0]["spec"]["replicatedJobs"]]
    assert templates[0]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]


def test_volcano_pytorchjob_uses_its_scheduling_policy() -> None:
    spec = make_spec("pytorchjob", nodes=3, k8s={"scheduler": "volcano"})
    (doc,) = render_docs(spec)
    assert doc["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 3}
    assert all(p["schedulerName"] == "volcano" for p in pod_specs(spec))


@pytest.mark.parametrize(("kind", "k8s", "message"), [
    ("trainjob", {"scheduler": "volcano"}, "podGroupPolicy.volcano in the ClusterTrainingRuntime"),
    ("indexed-job", {"scheduler": "volcano", "queue": "q"}, "choose one"),
    ("jobset", {"scheduler": "volcano", "pod_annotations": {"scheduling.k8s.io/group-name": "x"}}, "remove it"),
])
def test_gang_scheduling_refused_with_a_reason(kind: str, k8s: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make_spec(kind, k8s=k8s)


def test_verify_rejects_a_podgroup_of_the_wrong_size() -> None:
    spec = make_spec("indexed-job", nodes=3, k8s={"scheduler": "volcano"})
    rendered = render(spec, "k8s")
    name = kubernetes.filename(spec)
    rendered.files[name] = rendered.files[name].replace("minMember: 3", "minMember: 2")
    with pytest.raises(RenderError, match="PodGroup"):
        kubernetes.verify(spec, rendered)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_indexed_job_with_kueue_passes_kubernetes_validate_strict(tmp_path: Path, version: str) -> None:
    spec = make_spec("indexed-job", nodes=2, k8s={"queue": "team-a"})
    path = tmp_path / "job.yaml"
    path.write_text(render(spec, "k8s").files[kubernetes.filename(spec)], encoding="utf-8")
    result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", version, str(path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("kind", "k8s"), [
    ("pytorchjob", {"queue": "q"}), ("pytorchjob", {"scheduler": "volcano"}), ("trainjob", {"queue": "q"}),
    ("jobset", {"queue": "q"}),
])
def test_gang_options_match_the_upstream_crd_schema(tmp_path: Path, kind: str, k8s: dict[str, Any]) -> None:
    result = check_against_crd(tmp_path, kind, render_docs(make_spec(kind, nodes=2, k8s=k8s)))
    assert result.returncode == 0, result.stdout + result.stderr


# ---- every example x kind x option set passes the upstream validators ----

OPTION_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything": EVERYTHING,
    "kueue": {"queue": "team-a", "active_deadline_s": 600},
    "volcano": {"scheduler": "volcano", "rdma": {"count": 2}},
}
SCHEMA_OF = {"PyTorchJob": "pytorchjob", "TrainJob": "trainjob", "JobSet": "jobset", "PodGroup": "podgroup"}
BUILTIN = {"Service", "Job"}


def test_every_example_kind_and_option_set_passes_its_validator(tmp_path: Path) -> None:
    by_schema: dict[str, list[dict[str, Any]]] = {k: [] for k in SCHEMA_OF.values()}
    builtin: list[Path] = []
    rendered = 0
    for example in EXAMPLES:
        for kind in KINDS:
            for name, k8s in OPTION_SETS.items():
                k8s = {k: v for k, v in k8s.items()
                       if not (kind == "trainjob" and k in ("host_network", "scheduler"))}
                fields = load_spec(example, overrides=[f"k8s.kind={kind}"]).model_dump(exclude_unset=True)
                fields["k8s"] = {**fields.get("k8s", {}), **copy.deepcopy(k8s)}
                spec = JobSpec.model_validate(fields)
                docs = render_docs(spec)
                rendered += 1
                for i, doc in enumerate(docs):
                    if doc["kind"] in BUILTIN:
                        path = tmp_path / f"{example.stem}-{kind}-{name}-{i}.yaml"
                        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
                        builtin.append(path)
                    else:
                        by_schema[SCHEMA_OF[doc["kind"]]].append(doc)
    assert rendered == len(EXAMPLES) * len(KINDS) * len(OPTION_SETS)
    result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", K8S_VERSIONS[-1],
                             *map(str, builtin)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for kind, docs in by_schema.items():
        assert docs, f"no {kind} document rendered"
        result = check_against_crd(tmp_path, kind, docs)
        assert result.returncode == 0, f"{kind}: {result.stdout}{result.stderr}"
