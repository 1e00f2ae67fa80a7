"""The admission webhooks' rules, as tables taken from the upstream webhook
tests, applied to ddpkit's rendered manifests: each row breaks one rule in
a manifest that verify() accepts, and verify() must refuse it naming the rule.

Sources (the webhook code each row mirrors):
- PyTorchJob: kubeflow/training-operator release-1.9,
  pkg/webhooks/pytorch/pytorchjob_webhook.go (validatePyTorchJob, validateSpec,
  validatePyTorchReplicaSpecs) and its _test.go.
- TrainJob: kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go
  (Validate: reserved PET_* env names).
- JobSet: kubernetes-sigs/jobset v0.12.0, pkg/webhooks/jobset_webhook.go
  (ValidateCreate) and jobset_webhook_test.go: the row names quote its cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from ddpkit.render.engine import Rendered, RenderError
from ddpkit.spec.yamlfile import SpecError
from ddpkit.targets import kubernetes, render
from tests.test_render_k8s import full_spec, make_spec

Doc = dict[str, Any]


def _pj_specs(d: Doc) -> Doc:
    specs: Doc = d["spec"]["pytorchReplicaSpecs"]
    return specs


def _master_container(d: Doc) -> Doc:
    c: Doc = _pj_specs(d)["Master"]["template"]["spec"]["containers"][0]
    return c


def _js_job(d: Doc) -> Doc:
    job: Doc = d["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job


def _set(path: Callable[[Doc], Doc], key: str, value: Any) -> Callable[[list[Doc]], None]:
    def mutate(docs: list[Doc]) -> None:
        path(docs[0])[key] = value
    return mutate


def _drop(path: Callable[[Doc], Doc], key: str) -> Callable[[list[Doc]], None]:
    def mutate(docs: list[Doc]) -> None:
        del path(docs[0])[key]
    return mutate


def _rename(docs: list[Doc]) -> None:
    for d in docs:
        d["metadata"]["name"] = "Demo.Job"


def _elastic_without_worker(docs: list[Doc]) -> None:
    docs[0]["spec"]["elasticPolicy"] = {"maxRestarts": 1}
    del _pj_specs(docs[0])["Worker"]


ROWS: list[tuple[str, str, Callable[[list[Doc]], None], str]] = [
    # PyTorchJob
    ("pytorchjob", "name is not a DNS-1035 label", _rename, "DNS-1035"),
    ("pytorchjob", "Master replicas must be 1", lambda ds: _pj_specs(ds[0])["Master"].update(replicas=2),
     "one Master"),
    ("pytorchjob", "Master is missing", lambda ds: _pj_specs(ds[0]).pop("Master"), "one Master"),
    ("pytorchjob", "Worker replicas must be at least 1", lambda ds: _pj_specs(ds[0])["Worker"].update(replicas=0),
     "at least 1"),
    ("pytorchjob", "unknown replica type", lambda ds: _pj_specs(ds[0]).update(Launcher=_pj_specs(ds[0])["Worker"]),
     "only Master and Worker"),
    ("pytorchjob", "no container named pytorch", _set(_master_container, "name", "trainer"), "pytorch"),
    ("pytorchjob", "image is empty", _set(_master_container, "image", ""), "image"),
    ("pytorchjob", "elasticPolicy without Worker", _elastic_without_worker, "Worker must be configured"),
    ("pytorchjob", "elasticPolicy.nProcPerNode with nprocPerNode",
     lambda ds: ds[0]["spec"].update(elasticPolicy={"nProcPerNode": 2}), "must not be used with nprocPerNode"),
    # TrainJob
    ("trainjob", "reserved PET_NODE_RANK in trainer.env",
     lambda ds: ds[0]["spec"]["trainer"]["env"].append({"name": "PET_NODE_RANK", "value": "0"}), "reserved"),
    ("trainjob", "reserved PET_MASTER_ADDR in trainer.env",
     lambda ds: ds[0]["spec"]["trainer"]["env"].append({"name": "PET_MASTER_ADDR", "value": "x"}), "reserved"),
    # JobSet
    ("jobset", "jobset name with invalid character", _rename, "DNS-1035"),
    ("jobset", "enableDNSHostnames is false",
     lambda ds: ds[0]["spec"]["network"].update(enableDNSHostnames=False), "enableDNSHostnames"),
    ("jobset", "network has invalid dns name (subdomain differs from the hosts)",
     lambda ds: ds[0]["spec"]["network"].update(subdomain="Other_Name"), "subdomain"),
    ("jobset", "job completion mode is set to non-indexed", _set(_js_job, "completionMode", "NonIndexed"),
     "Indexed"),
    ("jobset", "job completion mode is unset", _drop(_js_job, "completionMode"), "Indexed"),
    ("jobset", "pod restart policy set (OnFailure defeats podFailurePolicy)",
     lambda ds: _js_job(ds[0])["template"]["spec"].update(restartPolicy="OnFailure"), "restartPolicy Never"),
    ("jobset", "two replicated jobs", lambda ds: ds[0]["spec"]["replicatedJobs"].append(
        {**ds[0]["spec"]["replicatedJobs"][0], "name": "extra"}), "one replicatedJob"),
]


def reverify(kind: str, mutate: Callable[[list[Doc]], None]) -> None:
    spec = full_spec(kind)
    name = kubernetes.filename(spec)
    text = render(spec, "k8s").files[name]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    mutate(docs)
    first_line = text.split("\n", 1)[0] + "\n"  # keep the Pod Security line: it is not under test here
    kubernetes.verify(spec, Rendered(files={name: first_line + yaml.safe_dump_all(docs)}))


@pytest.mark.parametrize(("kind", "rule", "mutate", "message"), ROWS, ids=[f"{r[0]}: {r[1]}" for r in ROWS])
def test_webhook_rule_is_enforced(kind: str, rule: str, mutate: Callable[[list[Doc]], None], message: str) -> None:
    with pytest.raises(RenderError, match=message):
        reverify(kind, mutate)


@pytest.mark.parametrize("kind", kubernetes.KIND_TARGET)
def test_unmutated_manifest_passes(kind: str) -> None:
    """The rows above fail because of their mutation, not the round trip."""
    reverify(kind, lambda docs: None)


@pytest.mark.parametrize(("nodes", "name_len", "ok"), [(10, 63 - len("-node-0-9-abcde"), True),
                                                       (10, 64 - len("-node-0-9-abcde"), False)])
def test_jobset_name_will_result_in_a_pod_name_being_too_long(nodes: int, name_len: int, ok: bool) -> None:
    """jobset_webhook_test.go "jobset name will result in a pod name being too
    long": <jobset>-<rjob>-<jobIndex>-<podIndex>-abcde must fit in 63."""
    spec = make_spec("jobset", name="j" * name_len, nodes=nodes)
    if ok:
        kubernetes.build(spec)
    else:
        with pytest.raises(SpecError, match="JobSet webhook"):
            kubernetes.build(spec)
