"""docker compose: one service per node on one Docker host, node0 the master.

Compose has no per-container shell, so each service gets its node rank
resolved into its own command at render time (service index = node rank).
A cuda job reserves each node's own GPUs (node i: GPUs i*G .. i*G+G-1);
with compose.cpu_test it is a gloo test on CPU instead, and says so.

An elastic job's rendezvous store runs in a service of its own (`rdzv`,
`python -m ddpkit.rdzv_store`), not in node0's agent: any node may then be
lost, node0 too, and every node that fails is restarted by compose and
rejoins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from ..contract import COMPOSE_STORE_SERVICE, Arg, LaunchPlan, RowKey, one_host_gpus, resolve
from ..render.engine import OutputFile, Rendered, RenderError
from ..render.quoting import compose_unliteral
from ..rendezvous import runkey
from ..shared import envnames
from ..shared.agreed import METRICS_TO_LAUNCHER, RDZV_STORE_MODULE, is_ddpkit_module
from ..shared.wording import plural
from ..spec import JobSpec
from . import mounts
from .limits import compose_limits
from .refusals import refuse

NAME = "compose"
FILENAME = "compose.yaml"
RDZV_SERVICE = COMPOSE_STORE_SERVICE  # an elastic job's rendezvous store: its service and host name
RDZV_STOP_S = 5  # the store stops at once on SIGTERM; after the nodes, which `down` stops first (depends_on)


@dataclass(frozen=True)
class Service:
    name: str
    command: list[str]
    environment: dict[str, str]
    restart: str | None = None  # compose's restart policy (elastic: a failed node comes back and rejoins)
    gpus: tuple[int, ...] = ()  # the host's GPUs this node reserves (device ids)
    # `NAME: null`: compose takes the value from the shell that runs it, so no file holds it:
    # the secrets, then the run key (runkey.py), which that shell makes for each run
    secrets: tuple[str, ...] = ()


def cpu_test(spec: JobSpec) -> bool:
    """Whether the file runs the job as a gloo test on CPU: a cpu job, or a
    cuda job whose spec asks for that (compose.cpu_test)."""
    return spec.device == "cpu" or spec.compose.cpu_test


def compose_env(spec: JobSpec, plan: LaunchPlan) -> dict[str, str]:
    """The job env of every service (its records in the container:
    mounts.records_in_container, where `ddpkit report` copies them from, a
    program of the user's own's metrics among them); a cuda job's CPU test runs gloo."""
    env = mounts.records_in_container(plan.env)
    if not is_ddpkit_module(spec.command.module):
        env |= {envnames.DDPKIT_METRICS: METRICS_TO_LAUNCHER}
    if spec.device == "cuda" and spec.compose.cpu_test:
        return env | {envnames.DDPKIT_BACKEND: "gloo"}
    return env


def notes(spec: JobSpec) -> tuple[str, ...]:
    """What the file does with the job's GPUs, said where it differs from the spec's promise."""
    if spec.device != "cuda":
        return ()
    if spec.compose.cpu_test:
        return (f"a gloo test of this cuda job on CPU (compose.cpu_test): no GPUs are reserved; "
                f"remove compose.cpu_test to reserve {plural(spec.gpus_per_node, 'GPU')} per node",)
    total = spec.nodes * spec.gpus_per_node
    return (f"reserves {plural(spec.gpus_per_node, 'GPU')} per node, {total} in all on the Docker host (NVIDIA "
            "Container Toolkit); set compose.cpu_test: true for a gloo test on CPU",)


@dataclass(frozen=True)
class StoreService:
    """An elastic job's rendezvous store, restarted by compose if it fails
    (an empty store: the nodes' agents fail, are restarted and meet again).
    It exits 0 once the job's rendezvous has closed; it names that
    rendezvous as the agents do, with the run key from the same shell."""

    name: str
    command: list[str]
    restart: str = "on-failure"
    secrets: tuple[str, ...] = (runkey.ENV,)


def store_service(spec: JobSpec) -> StoreService | None:
    plan = resolve(spec, RowKey.COMPOSE)
    if spec.elastic is None or plan.sources.rdzv_id is None:
        return None
    return StoreService(RDZV_SERVICE, [spec.command.python, "-m", RDZV_STORE_MODULE, "--port", str(plan.port),
                                       "--rdzv-id", Arg.of(plan.sources.rdzv_id).resolve({})])


def services(spec: JobSpec) -> list[Service]:
    plan = resolve(spec, RowKey.COMPOSE)  # elastic: every agent a client of the rdzv service's store
    env = compose_env(spec, plan)
    out = []
    for index, host in enumerate(plan.hosts):
        injected = plan.node_vars[index]
        gpus = () if cpu_test(spec) else tuple(one_host_gpus(spec, index))
        out.append(Service(host, [a.resolve(injected) for a in plan.argv], env | injected,
                           elastic_restart(spec), gpus, (*spec.secret_names, runkey.ENV)))
    return out


def elastic_restart(spec: JobSpec) -> str | None:
    """Elastic: a node that fails, node0 too (the store is the rdzv
    service's), is restarted by compose, up to max_restarts times, and its
    agent rejoins at the survivors' next restart."""
    if spec.elastic is None:
        return None
    return f"on-failure:{spec.elastic.max_restarts}"


def build(spec: JobSpec) -> list[OutputFile]:
    refuse(spec, RowKey.COMPOSE)
    variables = {"spec": spec, "services": services(spec), "store": store_service(spec), "volumes": mounts.binds(spec),
                 "limits": compose_limits(spec), "rdzv_stop_s": RDZV_STOP_S}
    return [OutputFile(FILENAME, "compose/compose.yaml.j2", variables, "yaml",
                       notes=(*notes(spec), *mounts.container_warnings(spec, "compose")))]


def _unescape(value: object) -> object:
    # Compose interpolates $VAR in the file; the template writes compose_literal.
    return compose_unliteral(value) if isinstance(value, str) else value


def verify(spec: JobSpec, rendered: Rendered) -> None:
    doc = yaml.safe_load(rendered.files[FILENAME])
    lim = compose_limits(spec)
    for svc in services(spec):
        got = doc["services"][svc.name]
        command = [_unescape(c) for c in got["command"]]
        env = {k: _unescape(v) for k, v in got["environment"].items() if v is not None}
        from_shell = tuple(k for k, v in got["environment"].items() if v is None)
        if (command != svc.command or env != svc.environment or from_shell != svc.secrets or got["image"] != spec.image
                or got.get("restart") != svc.restart or _reserved_gpus(got) != svc.gpus
                or [_unescape(v) for v in got.get("volumes", [])] != mounts.binds(spec)
                or (got.get("shm_size"), got.get("cpus"), got.get("mem_limit")) != (lim.shm_size, lim.cpus, lim.memory)):
            raise RenderError(f"{FILENAME}: service {svc.name} does not match the job spec")
    store = store_service(spec)
    got_store = doc["services"].get(RDZV_SERVICE)
    if (store is None) != (got_store is None) or (store is not None and got_store is not None and (
            [_unescape(c) for c in got_store["command"]] != store.command or got_store.get("restart") != store.restart
            or got_store["image"] != spec.image or tuple(got_store.get("environment", {})) != store.secrets)):
        raise RenderError(f"{FILENAME}: service {RDZV_SERVICE} does not match the job spec")


def _reserved_gpus(service: dict[str, Any]) -> tuple[int, ...]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return tuple(int(i) for d in devices for i in d.get("device_ids", []))
