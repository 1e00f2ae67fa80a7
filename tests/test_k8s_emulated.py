"""Kubernetes manifests run in containers, the way the controllers would.

No API server can run here, so for each rendered manifest this test does
what the controller and the kubelet do: one container per pod from the
built image on one Docker network, the pod's hostname and the DNS names the
controller provides (network aliases), the environment the controller
injects (tests/emulators.controller_env: the contract table), and the kubelet's
$(VAR) expansion of command, args and env (tests/expansion.py). The
manifest is read back from the rendered YAML, so the template is what is
tested: a wrong variable leaves a `$(VAR)` or a wrong rank, and the run
fails or its rank report does not match.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.contract import hosts_for
from ddpkit.shared import envnames
from ddpkit.spec import JobSpec
from ddpkit.spec.yamlfile import load_spec
from ddpkit.targets import kubernetes, render
from tests.emulators import controller_env
from tests.expansion import kubelet_container_env, kubelet_expand
from tests.infra import docker_daemon as daemon_infra
from tests.infra.docker_daemon import REPO, Docker

# The fixture, by its name, so that pytest finds it in this module.
docker_daemon = daemon_infra.docker_daemon

TINY = ["--model=tiny", "--data=synthetic", "--image-size=16", "--synthetic-size=24", "--batch-size=8",
        "--epochs=1", "--workers=0", "--no-eval"]


@dataclass(frozen=True)
class Pod:
    hostname: str
    dns_names: list[str]
    argv: list[str]
    env: dict[str, str]
    # mount path -> (PVC claim name, read-only): one Docker volume per claim,
    # shared by every pod, as a ReadWriteMany claim is.
    claims: dict[str, tuple[str, bool]]
    user: str | None  # securityContext.runAsUser
    fs_group: int | None  # pod securityContext.fsGroup


def _containers(kind: str, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training container of every pod, in pod-index order."""
    if kind == "pytorchjob":
        specs = docs[0]["spec"]["pytorchReplicaSpecs"]
        master = specs["Master"]["template"]["spec"]["containers"]
        worker = specs["Worker"]["template"]["spec"]["containers"]
        pick = [next(c for c in master if c["name"] == "pytorch")]
        return pick + [next(c for c in worker if c["name"] == "pytorch")] * specs["Worker"]["replicas"]
    if kind == "indexed-job":
        job = next(d for d in docs if d["kind"] == "Job")
        assert job["spec"]["completionMode"] == "Indexed"
        return [job["spec"]["template"]["spec"]["containers"][0]] * job["spec"]["completions"]
    if kind == "jobset":
        (rjob,) = docs[0]["spec"]["replicatedJobs"]
        assert rjob["replicas"] == 1 and rjob["template"]["spec"]["completionMode"] == "Indexed"
        return [rjob["template"]["spec"]["template"]["spec"]["containers"][0]] * rjob["template"]["spec"]["completions"]
    trainer = docs[0]["spec"]["trainer"]
    return [trainer] * trainer["numNodes"]


def pods(spec: JobSpec, text: str) -> list[Pod]:
    """Every pod as its controller and the kubelet would start it: command,
    args and env from the rendered YAML; names and injected variables from
    the controller's side of the contract (what it derives from the job's
    name, kind and replica counts, which `spec` carries)."""
    kind = spec.k8s.kind
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs[0]["metadata"]["name"] == spec.name
    target = kubernetes.KIND_TARGET[kind]
    if kind == "indexed-job":  # the Service that makes <job>-<i>.<service> resolve
        service = next(d for d in docs if d["kind"] == "Service")
        assert service["spec"]["clusterIP"] == "None"
        job = next(d for d in docs if d["kind"] == "Job")
        assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    if kind == "jobset":  # JobSet makes <jobset>-<rjob>-0-<i>.<jobset> resolve
        assert docs[0]["spec"]["network"]["enableDNSHostnames"] is True
    pod_spec = kubernetes.pod_specs(docs, kind)[0]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod_spec.get("volumes", []) if "persistentVolumeClaim" in v}
    fs_group = (pod_spec.get("securityContext") or {}).get("fsGroup")
    out = []
    for i, (container, host) in enumerate(zip(_containers(kind, docs), hosts_for(spec, target))):
        env = kubelet_container_env(container.get("env", []), controller_env(spec, target, i))
        argv = [kubelet_expand(a, env) for a in container.get("command", []) + container.get("args", [])]
        mounts = {m["mountPath"]: (claims[m["name"]], bool(m.get("readOnly")))
                  for m in container.get("volumeMounts", []) if m["name"] in claims}
        uid = (container.get("securityContext") or {}).get("runAsUser")
        out.append(Pod(host.split(".")[0], sorted({host, host.split(".")[0]}), argv, env, mounts,
                       None if uid is None else str(uid), fs_group))
    return out


def store_pod(spec: JobSpec, text: str, linger_s: float) -> Pod:
    """An elastic PyTorchJob's rendezvous store, as its Job controller starts
    it, reachable by its Service's name; `linger_s` shortens its stay after
    the rendezvous closed (the test's only change)."""
    [job_doc] = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "Job"]
    [service] = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "Service"]
    [container] = job_doc["spec"]["template"]["spec"]["containers"]
    name = service["metadata"]["name"]
    uid = (container.get("securityContext") or {}).get("runAsUser")
    return Pod(f"{name}-0", [name], [*container["command"], "--linger-s", str(linger_s)], {}, {},
               None if uid is None else str(uid), None)


def run_pods(docker: Docker, pods_: list[Pod], *, volumes: dict[str, str] | None = None,
             kill: Callable[[list[Any]], int | None] | None = None,
             fail_fast: bool = True) -> tuple[list[int], list[str]]:
    """Start every pod's container on one network; fail fast like a JobSet
    or an operator with backoffLimit 0 (`fail_fast`; an elastic job's pods
    go on without a lost one); return exit codes and logs. `volumes`: claim
    name -> Docker volume. `kill(containers)`, polled while they run, may
    SIGKILL one and return its index (a lost node)."""
    # By name: run from the repository root, mypy takes its docker/ folder for the SDK.
    sdk: Any = importlib.import_module("docker")

    client = sdk.DockerClient(base_url=docker.host)
    tag = uuid.uuid4().hex[:8]
    net = client.networks.create(f"k8s-emul-{tag}", labels={"io.ddpkit.test": tag})
    containers = []
    # A claim the caller did not provide gets an empty volume for this run.
    own = [client.volumes.create(f"k8s-emul-{tag}-{claim}", labels={"io.ddpkit.test": tag})
           for claim in sorted({c for p in pods_ for c, _ in p.claims.values()} - set(volumes or {}))]
    volumes = {**(volumes or {}), **{v.name.removeprefix(f"k8s-emul-{tag}-"): v.name for v in own}}
    try:
        for pod in pods_:
            endpoint = client.api.create_endpoint_config(aliases=pod.dns_names)
            binds = {volumes[claim]: {"bind": path, "mode": "ro" if ro else "rw"}
                     for path, (claim, ro) in pod.claims.items()}
            created = client.api.create_container(
                docker.image, command=pod.argv, environment=pod.env, hostname=pod.hostname,
                labels={"io.ddpkit.test": tag}, user=pod.user,
                networking_config=client.api.create_networking_config({net.name: endpoint}),
                host_config=client.api.create_host_config(
                    shm_size="256m", binds=binds,
                    group_add=[str(pod.fs_group)] if pod.fs_group is not None else None))
            containers.append(client.containers.get(created["Id"]))
        for c in containers:
            c.start()
        codes: list[int | None] = [None] * len(containers)
        killed = None
        while None in codes:
            if kill is not None and killed is None:
                killed = kill(containers)
            for i, c in enumerate(containers):
                if codes[i] is None:
                    try:
                        codes[i] = int(c.wait(timeout=2)["StatusCode"])
                    except Exception:
                        continue
                    if codes[i] != 0 and fail_fast:
                        for other in containers:
                            other.stop(timeout=2)
        logs = [c.logs().decode("utf-8", "replace") for c in containers]
        return [int(code) for code in codes], logs  # type: ignore[arg-type]
    finally:
        for c in containers:
            c.remove(force=True)
        net.remove()
        for v in own:
            v.remove(force=True)


def job(kind: str, nodes: int) -> JobSpec:
    return load_spec(REPO / "examples" / "cpu-smoke.yaml",
                     overrides=[f"k8s.kind={kind}", "command.args=" + json.dumps(TINY)],
                     nodes=nodes, nproc_per_node=1)


def rendered(spec: JobSpec) -> str:
    files = render(spec, "k8s").files
    assert len(files) == 1
    return next(iter(files.values()))


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_wrong_variable_in_the_template_fails_the_run(docker_daemon: Docker) -> None:
    spec = job("indexed-job", 2)
    text = rendered(spec).replace("$(JOB_COMPLETION_INDEX)", "$(JOB_INDEX)")
    assert text != rendered(spec)
    pods_ = pods(spec, text)
    codes, logs = run_pods(docker_daemon, pods_)
    assert codes != [0, 0], "\n".join(logs)
    assert "$(JOB_INDEX)" in "\n".join(logs)


# ---- a shared checkpoint volume: resume after a pod is lost ----

CKPT = "/ckpt/run"
RESUME_ARGS = ["--model=tiny", "--data=synthetic", "--image-size=16", "--synthetic-size=128", "--batch-size=8",
               "--epochs=3", "--workers=0", "--no-eval", f"--checkpoint-dir={CKPT}", "--checkpoint-every=4",
               "--resume=auto"]
# 24 steps, the first checkpoint at step 4. Rank 0's every step takes STEP_S
# (the trainer's test hook: a slow data loader; rank 1 waits for it), so the
# 20 steps after that checkpoint outlast the kill's poll (run_pods: up to 2 s
# per container) many times over, however fast the tiny model trains.
STEP_S = 0.5
SLOW_STEPS = {envnames.DDPKIT_TEST_SLOW_RANK: f"0:{STEP_S}"}


@contextmanager
def checkpoint_claim(docker: Docker, fs_group: int | None) -> Iterator[tuple[str, Path]]:
    """A Docker volume standing in for the example's ReadWriteMany checkpoint
    claim, prepared as the kubelet does for fsGroup (the volume's group,
    group-writable, setgid); its name and its mount point on the daemon's side."""
    sdk: Any = importlib.import_module("docker")
    client = sdk.DockerClient(base_url=docker.host)
    volume = client.volumes.create(f"k8s-emul-ckpt-{uuid.uuid4().hex[:8]}", labels={"io.ddpkit.test": "ckpt"})
    try:
        client.containers.run(docker.image, ["sh", "-c", f"chgrp {fs_group} /ckpt && chmod 2775 /ckpt"],
                              volumes={volume.name: {"bind": "/ckpt", "mode": "rw"}}, remove=True, user="0")
        yield volume.name, Path(client.api.inspect_volume(volume.name)["Mountpoint"])
    finally:
        volume.remove(force=True)


def kill_after_first_checkpoint(volume_dir: Path, victim: int) -> Callable[[list[Any]], int | None]:
    """SIGKILL pod `victim` once the checkpoint pointer exists on the shared
    volume (read on the daemon's side: the volume's mount point)."""
    latest = volume_dir / CKPT.removeprefix("/ckpt/") / "latest"

    def kill(containers: list[Any]) -> int | None:
        if not latest.exists():
            time.sleep(0.5)
            return None
        containers[victim].kill(signal="SIGKILL")
        return victim
    return kill


@pytest.mark.full  # a killed job resumed from its checkpoint: test_elastic_train.py; the JobSet's pods: test_render_k8s.py
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_jobset_resumes_from_the_shared_checkpoint_volume_after_a_pod_is_killed(docker_daemon: Docker) -> None:
    """JobSet, 2 pods, the checkpoint directory on a PVC (a Docker volume
    mounted in both containers, as a ReadWriteMany claim is), run as the
    manifest's non-root user. Pod 1 is SIGKILLed after the first checkpoint;
    the run fails fast (FailJob); the JobSet restart (fresh containers, same
    claim) resumes from that checkpoint instead of step 0."""
    spec = load_spec(REPO / "examples" / "cpu-smoke.yaml",
                     overrides=["k8s.kind=jobset", "k8s.backoff_limit=1", "command.args=" + json.dumps(RESUME_ARGS)],
                     nodes=2, nproc_per_node=1)
    assert kubernetes.resume_warning(spec) is None, "the example mounts a shared checkpoint claim"
    pods_ = [dataclasses.replace(p, env=p.env | SLOW_STEPS) for p in pods(spec, rendered(spec))]
    assert all(p.claims.get("/ckpt") == ("smoke-checkpoints", False) and p.user == "1000" for p in pods_)
    with checkpoint_claim(docker_daemon, pods_[0].fs_group) as (volume, mountpoint):
        claims = {"smoke-checkpoints": volume}
        codes, logs = run_pods(docker_daemon, pods_, volumes=claims, kill=kill_after_first_checkpoint(mountpoint, 1))
        assert codes[1] == 137 and codes != [0, 0], "\n".join(logs)
        assert not any("resumed from" in log for log in logs), "the first attempt had nothing to resume"
        codes, logs = run_pods(docker_daemon, pods_, volumes=claims)
        assert codes == [0, 0], "\n".join(logs)
        assert "resumed from" in logs[0] and "at step 0 " not in logs[0], logs[0]
